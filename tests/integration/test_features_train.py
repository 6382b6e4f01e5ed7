"""train.features: cache | online | hybrid. One model and loss path, the same samples in the same order,
exactly-once resume, a hybrid cache equal to the cache stage's, a bounded stream."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.run import DEFAULT_CONFIG, load_config
from chatgen import write_chats

TRAIN = ["train.num_anchors=8", "train.drafters.dspark.markov_rank=8", "train.drafters.dspark.num_layers=1",
         "~train.drafters.dflash", "~train.drafters.eagle3", "train.num_workers=1", "train.concurrent_drafters=1", "train.heldout_shards=1",
         "train.validation_shards=1", "train.validate_every_steps=4", "train.micro_batch_samples=4",
         "train.global_batch_samples=4", "train.lr=3e-3", "train.epochs=2", "cache.num_workers=1",
         "train.checkpoint_every_steps=100", "ray.num_cpus=2"]


def _args(target, run_dir, data, *extra):
    return [f"target.path={target}", f"run_dir={run_dir}", f"data.train_files=[{data}]", "generate.enabled=false",
            "cache.rows_per_shard=16", "data.min_loss_tokens=1", *TRAIN, *extra]


def _cfg(*a, **k):
    return load_config(DEFAULT_CONFIG, _args(*a, **k))


def _rows(run_dir, name="dspark"):
    return [json.loads(x) for x in (Path(run_dir) / "train" / name / "metrics.jsonl").read_text().splitlines()]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def cache_run(tmp_path_factory, ray_local, tiny_target_dir):
    """The reference: +stage=cache then +stage=train (cache mode) on 80 chats (5 shards of 16 rows: 3 to
    train on, 12 steps an epoch, one for validation, one held out)."""
    from pipeline.stages.cache import run_cache
    from pipeline.stages.train import run_train

    root = tmp_path_factory.mktemp("features")
    data = root / "chats.jsonl"
    write_chats(data, 80)
    run_cache(_cfg(tiny_target_dir, root / "cache", data))
    run_train(_cfg(tiny_target_dir, root / "cache", data))
    return root, data


def _result(run_dir, name="dspark"):
    return json.loads((Path(run_dir) / "train" / name / "result.json").read_text())


@pytest.mark.integration
def test_stream_stays_within_its_memory_bound_when_the_trainer_is_slow(ray_local, tiny_target_dir, tmp_path):
    """A 0.3 s pause per step makes the trainer far slower than the prefill actor. Unbounded, the
    actor runs ahead through the whole epoch; with a 512 KiB bound (under one shard) the stream's
    in-flight bytes stay within the bound plus the shards in flight (one per actor, one queued)."""
    from pipeline.stages.train import run_train

    root, data = tmp_path, tmp_path / "chats.jsonl"
    write_chats(data, 120)  # 8 shards of 16 rows: 7 to train on
    ahead = {}
    for bound in (2**30, 2**19):
        run_dir = root / f"slow{bound}"
        run_train(_cfg(tiny_target_dir, run_dir, data, "train.features=online", f"train.stream_memory_bytes={bound}",
                       "train.step_delay_s=0.3", "train.epochs=1", "train.validation_shards=0"))
        res = _result(run_dir)["stream"]
        assert res["bound_bytes"] == bound and res["rows"] == 112  # 7 training shards of 16 samples
        ahead[bound] = res["max_ahead_bytes"]
        assert all(0 <= r["data_wait_fraction"] <= 1 for r in _rows(run_dir))
    per_shard = res["bytes"] / 7
    print(ahead, res["bytes"], per_shard)
    assert ahead[2**30] >= res["bytes"] - 2 * per_shard  # unbounded: nearly the whole epoch waits in the store
    assert ahead[2**19] <= 2**19 + 2 * per_shard < ahead[2**30]


def _cli(target, run_dir, data, *extra):
    return [sys.executable, "-m", "pipeline.run", "+stage=train", str(DEFAULT_CONFIG),
            *_args(target, run_dir, data, "train.checkpoint_every_steps=6", *extra)]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_killed_stream_run_resumes_and_equals_the_cache_run(mode, cache_run, tiny_target_dir, capsys):
    """SIGKILL the ``+stage=train`` CLI in ``mode`` after its checkpoint of step 6 (epoch 0); the rerun
    resumes there. Same seed, same order: the whole run's per-step losses, validation tau and consumed
    samples equal the cache-mode reference's bit for bit (the stream carries the bf16 bits the cache
    stores, prefilled in the same batches). Online stores nothing but the drafter's checkpoints and
    metrics; hybrid streams epoch 0 only, and the cache it writes verifies and equals the cache stage's
    (``ops verify``, ``ops diff``). Runs only CLI subprocesses (one Ray at a time)."""
    from ops.__main__ import main

    root, data = cache_run
    killed = root / f"killed-{mode}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "DS_ACCELERATOR": "cpu"}
    p = subprocess.Popen(_cli(tiny_target_dir, killed, data, f"train.features={mode}", "train.step_delay_s=0.3"),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = killed / "train" / "dspark" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and not latest.exists():
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    step = int(latest.read_text().split("-")[1])
    assert step == 6
    ckpt = json.loads((killed / "train/dspark/checkpoints/step-000006/COMMITTED.json").read_text())
    assert ckpt["consumed"][0]["samples"] == 6 * 4
    r = subprocess.run(_cli(tiny_target_dir, killed, data, f"train.features={mode}"), env=env, capture_output=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    ref, got = _rows(root / "cache"), _rows(killed)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, len(ref) + 1)) and len(ref) == 24
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]  # exact, not within a tolerance
    val = [r["val_tau_expected"] for r in got if "val_tau_expected" in r]
    assert val == [r["val_tau_expected"] for r in ref if "val_tau_expected" in r] and len(val) >= 3
    a, b = _result(root / "cache"), _result(killed)
    assert b["consumed"] == a["consumed"] and b["consumed"]["samples"] == len(ref) * 4
    assert b["features"] == mode and b["stream"]["bytes"] > 0
    if mode == "online":  # the resumed attempt streamed every step after the checkpoint
        assert b["stream"]["rows"] == (len(ref) - step) * 4
        assert {f.split("/")[0] for f in _files(killed)} == {"train"}  # no cache: checkpoints and metrics only
    else:  # epoch 1 read the cache
        epoch0 = sum(1 for r in ref if r["epoch"] == 0) * 4
        assert b["stream"]["rows"] == epoch0 - step * 4
        capsys.readouterr()
        assert main(["verify", str(killed / "cache"), "--cursor", str(root / "hv.jsonl")]) == 0
        assert main(["diff", str(root / "cache" / "cache"), str(killed / "cache")]) == 0, capsys.readouterr().out
