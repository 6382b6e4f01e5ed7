"""Checkpoints and export of a bf16 DeepSpeed run, the real job's path (issues #34 and #35),
held in place on the CPU on the tiny target.

One subprocess (DeepSpeed needs its own process group) trains the tiny drafter 3 optimizer steps in
bf16 under ZeRO-2 with AdamW and a warm-up (``conf/qwen3_4b.yaml``'s engine), commits a checkpoint
through :func:`training.loop._save`, takes a 4th step, then resumes a fresh engine from the
checkpoint (:func:`training.loop._resume`) and takes the same 4th step. The tests read what it wrote.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.run import DEFAULT_CONFIG, load_config
from training.loop import FROZEN_PREFIXES
from paths import REPO

pytestmark = pytest.mark.gpu_path


OVERRIDES = ["train.precision=bf16", "train.zero_stage=2", "train.optimizer=adamw", "train.lr=6e-4",
             "train.warmup_ratio=0.5", "train.num_workers=1", "train.micro_batch_samples=2",
             "train.global_batch_samples=2", "target.target_layer_ids=[0,2]", "~train.drafters.dflash", "~train.drafters.eagle3",
             "train.drafters.dspark.num_layers=1", "train.drafters.dspark.markov_rank=8",
             "train.drafters.dspark.block_size=4", "train.num_anchors=6", "train.drafters.dspark.init=random"]

RUN = r"""
import json, sys
import torch
from deepspeed.utils import safe_get_full_fp32_param
from pipeline.run import DEFAULT_CONFIG, load_config
from pipeline.stages.train import train_job
from training.blocks import collate_samples
from training.engine import make_engine
from training.loop import Position, _resume, _save, build_drafter_from, micro_step
from training.record import model_record

target_dir, run_dir, samples, out = sys.argv[1:5]
cfg = load_config(DEFAULT_CONFIG, [f"target.path={target_dir}", f"run_dir={run_dir}", *json.loads(sys.argv[5])])
job = train_job(cfg, "dspark", "{}", target_dir)
batch = collate_samples(torch.load(samples))
TOTAL = 4


def engine():
    torch.manual_seed(job.seed)
    model = build_drafter_from(job.model, target_dir)
    return make_engine(model, job.zero_stage, lr=job.lr, betas=job.betas, weight_decay=job.weight_decay,
                       total_steps=TOTAL, warmup_ratio=job.warmup_ratio, bf16=job.bf16, micro_batch=2,
                       accumulation=1, grad_clip=job.grad_clip)


def step(e, s):
    micro_step(e, batch, torch.Generator().manual_seed(s), job.loss, 1)


def snapshot(e):
    trainable = [(n, p) for n, p in e.module.named_parameters() if p.requires_grad]
    return {"module": {n: p.detach().clone() for n, p in trainable},
            "master": {n: safe_get_full_fp32_param(p).detach().clone() for n, p in trainable},
            "frozen": {n: p.detach().clone() for n, p in e.module.named_parameters() if not p.requires_grad}}


a = engine()
for s in range(3):
    step(a, s)
state = {"drafter": "dspark", "zero_stage": job.zero_stage, "optimizer": "adamw", "total_steps": TOTAL,
         "seed": job.seed, "model": model_record(a.module.config), "cache_fingerprint": None,
         "reduced_vocabulary": False, "features": "cache", "_consumed": {}, "_rank_consumed": {}}
_save(a, job.output_url, Position(3, 0, 3), state)
saved = snapshot(a)
step(a, 3)
b = engine()
pos, _ = _resume(b, job.output_url, 1, job.zero_stage, "adamw", "dspark")
resumed = snapshot(b)
step(b, 3)
torch.save({"saved": saved, "resumed": resumed, "next": snapshot(a), "resumed_next": snapshot(b),
            "position": [pos.step, pos.epoch, pos.micro]}, out)
"""


def _cfg(target_dir, run_dir):
    return load_config(DEFAULT_CONFIG, [f"target.path={target_dir}", f"run_dir={run_dir}", *OVERRIDES])


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, tiny_target_dir, drafter_samples):
    """(run_dir, what the subprocess recorded): 3 bf16 ZeRO-2 steps, a committed checkpoint, a resume."""
    root = tmp_path_factory.mktemp("bf16run")
    torch.save(drafter_samples, root / "samples.pt")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + (os.getpid() + 7) % 1000),
           "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-c", RUN, str(tiny_target_dir), str(root / "run"), str(root / "samples.pt"),
                        str(root / "out.pt"), json.dumps(OVERRIDES)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return root / "run", torch.load(root / "out.pt", weights_only=False)


def _ckpt(run_dir) -> Path:
    return Path(run_dir) / "train" / "dspark" / "checkpoints" / "step-000003"


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_checkpoint_files_hold_no_frozen_tensor_and_the_weights_in_bf16(bf16_run):
    run_dir, rec = bf16_run
    ckpt = _ckpt(run_dir)
    states = torch.load(ckpt / "engine" / "step-000003" / "mp_rank_00_model_states.pt", weights_only=False)
    module = states["module"]
    assert set(module) == set(rec["saved"]["module"])                    # the trainable tensors, nothing else
    assert not [k for k in module if k.startswith(FROZEN_PREFIXES)]
    assert not states.get("frozen_param_shapes") and not states.get("frozen_param_fragments")
    with safe_open(ckpt / "drafter.safetensors", "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert keys == set(rec["saved"]["module"]) and dtypes == {"BF16"}   # training dtype, trainable only
    assert {v.dtype for v in rec["saved"]["module"].values()} == {torch.bfloat16}
    assert set(rec["saved"]["frozen"]) == {"embed_tokens.weight", "lm_head.weight"}


def test_checkpoint_bytes_are_the_trainable_weights_only(bf16_run):
    """Model states: 2 bytes per trainable parameter (bf16), plus the pickle's few KB; drafter.safetensors:
    the same bytes plus its JSON header. Before: the frozen [V, H] embed_tokens and lm_head in both
    (bf16 in the model states, fp32 in drafter.safetensors) and the trainable weights in fp32."""
    run_dir, rec = bf16_run
    ckpt = _ckpt(run_dir)
    trainable = sum(v.numel() for v in rec["saved"]["module"].values())
    frozen = _nbytes(rec["saved"]["frozen"].values())                     # 2 x 512 x 64 bf16 = 131,072 B
    assert frozen == 2 * 512 * 64 * 2
    states = ckpt / "engine" / "step-000003" / "mp_rank_00_model_states.pt"
    module = torch.load(states, weights_only=False)["module"]
    assert _nbytes(module.values()) == 2 * trainable
    overhead = states.stat().st_size - 2 * trainable
    assert 0 < overhead < frozen / 2                                     # the frozen weights would not fit
    weights = (ckpt / "drafter.safetensors").stat().st_size
    assert 2 * trainable < weights < 2 * trainable + 8192                 # bf16 data + header
    optim = ckpt / "engine" / "step-000003" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert optim.stat().st_size > 12 * trainable                         # fp32 master, exp_avg, exp_avg_sq: kept


def test_resume_restores_the_weights_and_master_weights_bit_for_bit(bf16_run):
    _, rec = bf16_run
    assert rec["position"] == [3, 0, 3]
    for kind in ("module", "master", "frozen"):
        saved, resumed = rec["saved"][kind], rec["resumed"][kind]
        assert saved.keys() == resumed.keys()
        assert all(torch.equal(saved[k], resumed[k]) for k in saved), kind
    for kind in ("module", "master"):                                    # the next step too: optimizer state
        a, b = rec["next"][kind], rec["resumed_next"][kind]
        assert all(torch.equal(a[k], b[k]) for k in a), kind
        assert any(not torch.equal(a[k], rec["saved"][kind][k]) for k in a), kind  # the 4th step moved them


def test_export_accepts_a_three_step_bf16_run_and_still_refuses_untrained_tensors(bf16_run, tiny_target_dir):
    """Issue #34: 3 bf16 steps move the fp32 master of a norm weight at 1.0 by less than bf16's spacing
    there (2**-7), so its stored bf16 copy is still 1.0; the export judged that copy and refused. It now
    reads the checkpoint's record of the master weights that moved (``master_ahead``)."""
    from pipeline.stages.export import run_export
    from pipeline.stages.export_format import ExportError

    run_dir, rec = bf16_run
    saved = rec["saved"]
    stuck = sorted(k for k, v in saved["module"].items() if k.endswith("norm.weight") and bool((v == 1).all()))
    assert "hidden_norm.weight" in stuck                                  # the bf16 copy did not move...
    assert all(not torch.equal(saved["master"][k], saved["module"][k].float()) for k in stuck)  # ...its master did
    cfg = _cfg(tiny_target_dir, run_dir)
    info = run_export(cfg)["drafters"]["dspark"]                          # refused before the fix
    assert info["architecture"] == "Qwen3DSparkModel" and (Path(run_dir) / "export/dspark/config.json").exists()
    record = _ckpt(run_dir) / "COMMITTED.json"
    state = json.loads(record.read_text())
    assert set(stuck) <= set(state["master_ahead"]) and state["weights_dtype"] == "bfloat16"
    record.write_text(json.dumps({**state, "master_ahead": []}))          # as if the masters had not moved
    with pytest.raises(ExportError, match=r"hidden_norm\.weight still holds its initial value"):
        run_export(cfg)
    record.write_text(json.dumps(state))


def test_resume_downloads_once_per_node_and_other_local_ranks_read_that_copy(bf16_run, tiny_target_dir, monkeypatch):
    """Local rank 0 downloads every part's files into the node's folder, loads, then removes it; any other
    local rank downloads nothing and loads from the same folder."""
    import training.checkpoint as checkpoint
    from pipeline.drafters import drafter_config
    from training.loop import _resume, recorded_config

    run_dir, _ = bf16_run
    train_url = str(Path(run_dir) / "train" / "dspark")
    ckpt = str(_ckpt(run_dir))
    state = json.loads((_ckpt(run_dir) / "COMMITTED.json").read_text())
    cfg = _cfg(tiny_target_dir, run_dir)
    current = drafter_config(cfg.train.drafters["dspark"], cfg)
    downloads, loads = [], []
    real = checkpoint.download_files

    def download(url, files, local):
        downloads.append(sorted(files))
        real(url, files, local)

    class Engine:
        module = type("M", (), {"config": recorded_config(state, ckpt, current)})()

        def load(self, local, tag):
            loads.append((local, tag, sorted(p.relative_to(local).as_posix() for p in Path(local).rglob("*")
                                             if p.is_file())))

    monkeypatch.setattr(checkpoint, "download_files", download)
    node = str(checkpoint.resume_dir(ckpt, "node"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _resume(Engine(), train_url, 1, 2, "adamw", "dspark")[0].step == 3
    parts = json.loads((_ckpt(run_dir) / "parts" / "rank-0.json").read_text())["files"]
    assert downloads == [sorted(parts)] and loads == [(node, "step-000003", sorted(parts))]
    assert not Path(node).exists()                                        # removed after the load
    monkeypatch.setenv("LOCAL_RANK", "1")
    _resume(Engine(), train_url, 1, 2, "adamw", "dspark")
    assert len(downloads) == 1 and loads[1][:2] == (node, "step-000003")  # no second download on this node


@pytest.mark.parametrize("where", ["local", "s3"])
def test_ray_train_storage_is_on_the_runs_own_storage(where, s3_url, tmp_path):
    """Issue #35.11: Ray Train's storage is ``<run_dir>/train/<drafter>/ray`` (an S3 run_dir through the
    product's own S3 filesystem), not a temporary folder of the driver: Ray's storage context writes its
    marker there, where every node reads it."""
    import s3fs
    from ray.train.v2._internal.execution.storage import StorageContext

    from pipeline.stages.train import ray_storage

    run_dir = s3_url if where == "s3" else str(tmp_path / "run")
    kwargs = ray_storage(run_dir, "dspark")
    StorageContext(experiment_dir_name="dspark-train-dspark", **kwargs)  # what Ray Train builds from RunConfig
    marker = f"{run_dir}/train/dspark/ray/dspark-train-dspark/.validate_storage_marker"
    if where == "s3":
        assert s3fs.S3FileSystem().exists(marker.removeprefix("s3://"))
        assert kwargs["storage_path"] == f"{s3_url.removeprefix('s3://')}/train/dspark/ray"
    else:
        assert Path(marker).is_file() and kwargs == {"storage_path": str(tmp_path / "run/train/dspark/ray")}
