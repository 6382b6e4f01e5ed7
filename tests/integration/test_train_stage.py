"""Train stage: Ray Train + DeepSpeed ZeRO on CPU, DDP cross-check, exact resume, refusals (the stage's parts:
tests/unit/training/test_train.py)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cache_schema import FingerprintMismatchError
from pipeline.stages.cache import run_cache
from pipeline.run import DEFAULT_CONFIG, load_config
from training.checkpoint import CheckpointError
from training.engine import lr_lambda
from chatgen import write_chats
from paths import REPO

TRAIN = ["train.num_anchors=8", "train.drafters.dspark.markov_rank=8", "train.drafters.dspark.num_layers=1",
         "~train.drafters.dflash", "~train.drafters.eagle3", "train.num_workers=2", "train.concurrent_drafters=1", "train.heldout_shards=1",
         "train.validation_shards=0", "train.micro_batch_samples=4", "train.global_batch_samples=16", "train.lr=3e-3"]


def _cfg(target, run_dir, data, *extra):
    return load_config(DEFAULT_CONFIG, [f"target.path={target}", f"run_dir={run_dir}", f"data.train_files=[{data}]",
                                        "generate.enabled=false", "cache.rows_per_shard=20", "data.min_loss_tokens=1",
                                        *TRAIN, *extra])


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory, ray_local, tiny_target_dir):
    root = tmp_path_factory.mktemp("train")
    data = root / "chats.jsonl"
    write_chats(data, 120)
    run_cache(_cfg(tiny_target_dir, root / "run", data))
    return root, data


def _losses(run_dir, name="dspark"):
    rows = [json.loads(x) for x in (Path(run_dir) / "train" / name / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


MUON_STEP = r"""
import json, os, sys
import torch
from torch import nn
from training.engine import DeepSpeedEngine

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 16, bias=False)  # a matrix: Muon
        self.norm = nn.Parameter(torch.ones(16))  # 1-D: AdamW
    def trainable_parameters(self):
        return list(self.parameters())
    def forward(self, x):
        return (self.proj(x) * self.norm).pow(2).mean()

torch.manual_seed(0)
model = Tiny()
w0, n0 = model.proj.weight.detach().clone(), model.norm.detach().clone()
engine = DeepSpeedEngine(model, lr=1e-3, muon_lr=0.02, betas=(0.9, 0.95), weight_decay=0.0, total_steps=10,
                         warmup_ratio=0.0, zero_stage=2, bf16=False, micro_batch=1, accumulation=1, grad_clip=1.0)
x = torch.randn(64, 32)
loss = engine(x)
engine.backward(loss)
g, gn = model.proj.weight.grad, model.norm.grad
g = g.clone() if g is not None else None
engine.step()
json.dump({"dw": (model.proj.weight.detach() - w0).tolist(), "dn": (model.norm.detach() - n0).tolist(),
           "lr": engine.lr()}, open(sys.argv[1], "w"))
"""


@pytest.mark.integration
def test_muon_orthogonalises_the_matrices_and_leaves_the_rest_to_adamw(tmp_path):
    """train.optimizer=muon (DeepSpeed's Muon under ZeRO-2): one step moves a matrix by
    ``muon_lr * NS(g)``, whose singular values are all near 1 (an AdamW step would be ``lr * sign(g)``
    elementwise), and a 1-D weight by AdamW's first step ``lr * sign(g)``."""
    out = tmp_path / "step.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    r = subprocess.run([sys.executable, "-c", MUON_STEP, str(out)], env=env, capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    dw, dn = torch.tensor(res["dw"]), torch.tensor(res["dn"])
    sv = torch.linalg.svdvals(-dw / 0.02)
    assert sv.min() > 0.5 and sv.max() < 1.5, sv  # orthogonalised: Newton-Schulz, 5 steps
    assert res["lr"] == pytest.approx(1e-3 * lr_lambda(10, 0.0)(1))  # the AdamW half's, after one step
    assert dn.abs().min() > 0.9e-3 and dn.abs().max() < 1.1e-3  # AdamW's first step: lr * sign(g)
    assert not torch.allclose(dw.abs(), torch.full_like(dw, dw.abs().mean()), rtol=0.2)  # not sign(g)


@pytest.mark.integration
def test_fingerprint_mismatch_refused_before_training(cached_run, tiny_target_dir):
    from pipeline.stages.train import run_train

    root, data = cached_run
    cfg = _cfg(tiny_target_dir, root / "run", data, "target.target_layer_ids=[0,1]")
    t0 = time.time()
    with pytest.raises(FingerprintMismatchError, match="target_layer_ids"):
        run_train(cfg)
    assert time.time() - t0 < 30 and not (root / "run" / "train").exists()


@pytest.mark.integration
def test_zero2_loss_falls_and_matches_ddp(cached_run, tiny_target_dir, tmp_path):
    from pipeline.stages.train import run_train

    root, data = cached_run
    runs = {}
    for stage in (2, 0):
        run_dir = tmp_path / f"z{stage}"
        run_dir.mkdir()
        (run_dir / "cache").symlink_to(root / "run" / "cache")
        s = run_train(_cfg(tiny_target_dir, run_dir, data, f"train.zero_stage={stage}", "train.optimizer=adamw",
                           "train.max_steps=8",
                           "train.checkpoint_every_steps=100", "train.validation_shards=1",
                           "train.validate_every_steps=3"))
        assert s["drafters"]["dspark"]["world_size"] == 2
        assert s["drafters"]["dspark"]["torch_threads"] == 1  # train.cpus_per_worker (default 1)
        runs[stage] = _losses(run_dir)
        rows = [json.loads(x) for x in (run_dir / "train/dspark/metrics.jsonl").read_text().splitlines()]
        val = {r["step"]: r for r in rows if "val_tau_expected" in r}
        assert sorted(val) == [3, 6, 8]  # every 3 steps and the last one
        runs[stage] += ([val[k]["val_tau_expected"] for k in sorted(val)],)
        curves = s["drafters"]["dspark"]["validation"]
        assert curves["last"]["step"] == 8 and curves["points"] == 3
        assert curves["best"]["tau_expected"] == max(v["val_tau_expected"] for v in val.values())
        assert all(1.0 <= v["val_tau_expected"] <= 8 and len(v["val_acceptance_per_position"]) == 7
                   and v["val_blocks"] > 0 for v in val.values())
        assert (run_dir / "train/dspark/curves.png").stat().st_size > 10_000
    steps, z2, val2 = runs[2]
    assert steps == list(range(1, 9))
    assert sum(z2[-3:]) / 3 < sum(z2[:3]) / 3  # the loss falls
    torch.testing.assert_close(torch.tensor(z2), torch.tensor(runs[0][1]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(val2), torch.tensor(runs[0][2]), rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_kill_and_resume_continues_at_next_step(cached_run, tiny_target_dir, tmp_path):
    """SIGKILL the CLI after checkpoint step 4; the rerun continues at step 5 and ends with the
    weights of an uninterrupted run (same samples, same anchors, same optimizer state; run in this
    process on the session's Ray, reporting to metrics.jsonl only). Both attempts report to W&B
    (offline) and MLflow (file store): one tracker run across them, every step in it."""
    from pipeline.stages.train import run_train

    root, data = cached_run
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)

    def cli(run_dir):
        run_dir.mkdir()
        (run_dir / "cache").symlink_to(root / "run" / "cache")
        args = ["+stage=train", str(DEFAULT_CONFIG), f"target.path={tiny_target_dir}", f"run_dir={run_dir}",
                f"data.train_files=[{data}]", "generate.enabled=false", "cache.rows_per_shard=20",
                "data.min_loss_tokens=1", *TRAIN, "train.max_steps=10", "train.checkpoint_every_steps=2",
                "ray.num_cpus=2", "train.report_to=[jsonl,tensorboard,wandb,mlflow]"]
        return [sys.executable, "-m", "pipeline.run", *args]

    killed, full = tmp_path / "killed", tmp_path / "full"
    p = subprocess.Popen(cli(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    latest = killed / "train" / "dspark" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.exists() and latest.read_text() >= "step-000004"):
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    ckpt_step = int(latest.read_text().split("-")[1])
    assert 4 <= ckpt_step < 10
    args = cli(killed / "again")[3:]  # same command, same run_dir
    args = [a if not a.startswith("run_dir=") else f"run_dir={killed}" for a in args]
    assert subprocess.run([sys.executable, "-m", "pipeline.run", *args], env=env, capture_output=True,
                          timeout=400).returncode == 0
    reference = [a for a in cli(full)[5:] if not a.startswith(("train.report_to=", "ray.num_cpus="))]
    run_train(load_config(DEFAULT_CONFIG, reference))
    steps, losses = _losses(killed)
    assert steps == list(range(1, 11))  # one row per step: the killed attempt's later rows are dropped
    resumed = steps[ckpt_step:]
    full_steps, full_losses = _losses(full)
    assert full_steps == list(range(1, 11))
    torch.testing.assert_close(torch.tensor(losses[-len(resumed):]), torch.tensor(full_losses[ckpt_step:]))
    _check_trackers(killed / "train/dspark", dict(zip(steps, losses)), ckpt_step)
    a = load_file(killed / "train/dspark/checkpoints/step-000010/drafter.safetensors")
    b = load_file(full / "train/dspark/checkpoints/step-000010/drafter.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def _check_trackers(train: Path, losses: dict[int, float], resumed_step: int) -> None:
    """The killed and the resumed attempt logged into one W&B run and one MLflow run; each step's last
    value there is metrics.jsonl's (a step the killed attempt logged past its checkpoint is logged again).
    W&B's own process may die with the killed attempt before writing its last records: only the resumed
    attempt's steps must all be in its offline files."""
    from mlflow.tracking import MlflowClient
    from wandblog import wandb_history

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only with this
    client = MlflowClient(tracking_uri=f"file://{train}/mlruns")
    runs = client.search_runs([client.get_experiment_by_name("dspark").experiment_id])
    assert len(runs) == 1 and runs[0].data.params["drafter.block_size"] == "7"
    history = {}
    for m in sorted(client.get_metric_history(runs[0].info.run_id, "train.loss"), key=lambda m: m.timestamp):
        history[m.step] = m.value
    assert history == pytest.approx(losses)
    attempts = sorted(glob.glob(f"{train}/wandb/offline-run-*"))
    assert attempts and len({a.rsplit("-", 1)[1] for a in attempts}) == 1  # one run id across the attempts
    logged = {}
    for a in attempts:
        for h in wandb_history(a):
            logged[h["_step"]] = h["train/loss"]
    assert set(range(resumed_step + 1, 11)) <= set(logged)
    assert logged == pytest.approx({k: losses[k] for k in logged})


@pytest.mark.integration
def test_reduced_draft_vocabulary_built_from_the_cache(cached_run, tiny_target_dir, tmp_path):
    """``draft_vocab_size``: d2t = the most frequent supervised tokens of the training shards."""
    from cache_schema import CacheReader
    from pipeline.stages.train import run_train
    from training.data import split_shards
    from training.draft_vocab import build_d2t, count_supervised_tokens
    from pipeline.drafters import load_trained_drafter

    root, data = cached_run
    run_dir = tmp_path / "vocab"
    run_dir.mkdir()
    (run_dir / "cache").symlink_to(root / "run" / "cache")
    cfg = _cfg(tiny_target_dir, run_dir, data, "train.max_steps=2", "train.checkpoint_every_steps=100",
               "++train.drafters.dspark.draft_vocab_size=40")
    run_train(cfg)
    reader = CacheReader(str(run_dir / "cache"))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards)
    samples = [(s.input_ids, s.loss_mask) for s in reader.iter_samples(split.train)]
    expected = build_d2t(count_supervised_tokens(samples, 512), 40)
    model = load_trained_drafter(cfg, "dspark", tiny_target_dir)
    assert torch.equal(model.d2t, expected)
    assert model.markov_head.markov_w2.weight.shape == (40, 8)


@pytest.mark.integration
def test_later_stages_refuse_a_config_that_disagrees_with_the_checkpoint(cached_run, tiny_target_dir, tmp_path):
    """The checkpoint records its model; calibrate, export and evaluate build from that record and
    refuse, before any compute, a config whose drafter differs (no weight shape would notice)."""
    from pipeline.stages.calibrate import run_calibrate
    from pipeline.stages.evaluate import run_evaluate
    from pipeline.stages.export import run_export
    from pipeline.stages.train import run_train

    root, data = cached_run
    run_dir = tmp_path / "record"
    run_dir.mkdir()
    (run_dir / "cache").symlink_to(root / "run" / "cache")
    base = ("train.max_steps=2", "train.checkpoint_every_steps=100", f"data.eval_files=[{data}]",
            "evaluate.num_prompts=2", "evaluate.max_new_tokens=4", "evaluate.block_samples=4")
    run_train(_cfg(tiny_target_dir, run_dir, data, *base))
    state = json.loads((run_dir / "train/dspark/checkpoints/step-000002/COMMITTED.json").read_text())
    assert state["model"]["block_size"] == 7 and state["model"]["target_layer_ids"] == [0, 1, 2]
    assert state["cache_fingerprint"] and state["reduced_vocabulary"] is False
    changes = {"block_size": "train.drafters.dspark.block_size=3",
               "sample_from_anchor": "train.drafters.dspark.sample_from_anchor=false",
               "mask_token_id": "train.drafters.dspark.mask_token_id=9",
               "target_layer_ids": "target.target_layer_ids=[-1,1,2]",
               "enable_thinking": "data.render.enable_thinking=false"}
    for field, override in changes.items():
        cfg = _cfg(tiny_target_dir, run_dir, data, *base, override)
        for stage in (run_export, run_calibrate, run_evaluate, run_train):
            t0 = time.time()
            with pytest.raises((CheckpointError, FingerprintMismatchError), match=field):
                stage(cfg)
            assert time.time() - t0 < 30, (field, stage)
    assert not (run_dir / "export").exists() and not (run_dir / "calibrate").exists()
    exported = run_export(_cfg(tiny_target_dir, run_dir, data, *base))  # the unchanged config works
    assert exported["drafters"]["dspark"]["architecture"] == "Qwen3DSparkModel"
    assert exported["drafters"]["dspark"]["enable_thinking"] is None
    assert json.loads((run_dir / "export/dspark/config.json").read_text())["enable_thinking"] is None
    with pytest.raises(CheckpointError, match="set train.drafters.dspark.block_size=7"):
        run_export(_cfg(tiny_target_dir, run_dir, data, *base, changes["block_size"]))
    # a drafter trained in another thinking mode than the cache and config now use: refused with the fix
    ckpt = run_dir / "train/dspark/checkpoints/step-000002/COMMITTED.json"
    other = json.loads(state["cache_fingerprint"])
    other["render_options"]["enable_thinking"] = True
    ckpt.write_text(json.dumps({**state, "cache_fingerprint": json.dumps(other)}))
    for stage in (run_calibrate, run_evaluate, run_export):
        with pytest.raises(CheckpointError, match="trained on chats rendered with data.render.enable_thinking=true, "
                                                  "the config says null: set data.render.enable_thinking=true"):
            stage(_cfg(tiny_target_dir, run_dir, data, *base))
    del state["model"]  # a checkpoint of an older version: refused, its layout cannot be known
    (run_dir / "train/dspark/checkpoints/step-000002/COMMITTED.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="records no model config"):
        run_export(_cfg(tiny_target_dir, run_dir, data, *base))


@pytest.mark.integration
def test_training_continues_from_a_published_drafter(cached_run, tiny_target_dir, tmp_path):
    """init: pretrained through the train stage (Ray Train + ZeRO-2): one step at a tiny learning rate
    leaves every trainable weight within a step of the published drafter's, far from a fresh start."""
    from pipeline.drafters import build_drafter
    from pipeline.stages.export_format import export_drafter
    from pipeline.stages.train import run_train

    root, data = cached_run
    cfg = _cfg(tiny_target_dir, tmp_path / "pub", data)
    torch.manual_seed(11)
    published = build_drafter(cfg.train.drafters["dspark"], cfg, tiny_target_dir)
    with torch.no_grad():
        for p in published.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    export_drafter(published, tiny_target_dir, str(tmp_path / "export"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "cache").symlink_to(root / "run" / "cache")
    s = run_train(_cfg(tiny_target_dir, run_dir, data, "train.drafters.dspark.init=pretrained",
                       f"train.drafters.dspark.pretrained_path={tmp_path / 'export'}", "train.optimizer=adamw",
                       "train.lr=1e-6", "train.warmup_ratio=0", "train.max_steps=1", "train.checkpoint_every_steps=1"))
    assert s["drafters"]["dspark"]["pretrained"]["source"] == str(tmp_path / "export")
    trained = load_file(run_dir / "train/dspark/checkpoints/step-000001/drafter.safetensors")
    mine = {k: v for k, v in published.state_dict().items() if k in trained}
    assert len(mine) == len(trained) > 5
    fresh = build_drafter(cfg.train.drafters["dspark"], cfg, tiny_target_dir).state_dict()
    for k, v in trained.items():
        assert (v - mine[k]).abs().max() < 1e-4, k  # one AdamW step of 1e-6 from the published weights
        assert (v - fresh[k]).abs().max() > 1e-2, k  # and not where a fresh drafter starts
