"""GPU-path review at the Qwen3-4B shape: bounds on calibrate's compute and on checkpoint storage.

- ``calibrate.max_samples``: calibrate runs the drafter over at most that many held-out samples, the
  first ones in the held-out shards' stored order (:func:`pipeline.stages.calibrate.select_heldout`),
  and reports ``samples_used`` / ``samples_available``.
- ``train.keep_checkpoints``: after each commit rank 0 deletes the committed checkpoints older than
  the newest N (:func:`training.checkpoint.prune_checkpoints`), commit record first.

Both end to end on the tiny target (the unit checks: tests/unit/pipeline/test_limits.py). The imports of the new
names are inside the tests, so that each test fails on its own without them.
"""
from __future__ import annotations

import json

import pytest

from training.checkpoint import latest_checkpoint

from checkpointdirs import _folders

pytestmark = pytest.mark.gpu_path


@pytest.mark.integration
def test_train_keeps_the_newest_checkpoints_and_calibrate_runs_the_capped_samples(tmp_path, ray_local,
                                                                                  tiny_target_dir):
    """End to end on the tiny target: the training loop prunes after each commit (checkpoints at
    steps 2, 4, 6 with keep 2: 4 and 6 remain), and calibrate runs 5 of the held-out samples."""
    from chatgen import write_chats
    from test_train_stage import _cfg

    from cache_schema import CacheReader
    from pipeline.stages.cache import cache_url, run_cache
    from pipeline.stages.calibrate import load_confidence, run_calibrate
    from pipeline.stages.train import run_train

    data = tmp_path / "chats.jsonl"
    write_chats(data, 80)
    cfg = _cfg(tiny_target_dir, tmp_path / "run", data, "train.max_steps=6", "train.checkpoint_every_steps=2",
               "train.keep_checkpoints=2", "calibrate.max_samples=5", "calibrate.bins=10")
    run_cache(cfg)
    run_train(cfg)
    train_url = str(tmp_path / "run" / "train" / "dspark")
    assert _folders(train_url) == {"step-000004": True, "step-000006": True}
    found = latest_checkpoint(train_url)
    assert found[0].endswith("step-000006") and found[1]["step"] == 6
    summary = run_calibrate(cfg)
    available = CacheReader(cache_url(cfg)).records[3].num_samples  # 80 rows / 20 per shard: shard 3 held out
    assert summary["heldout_shards"] == [3] and available > 5
    s = summary["drafters"]["dspark"]
    assert (s["samples_used"], s["samples_available"]) == (5, available)
    report = json.loads((tmp_path / "run" / "calibrate" / "dspark" / "report.json").read_text())
    assert (report["samples_used"], report["samples_available"]) == (5, available)
    batches = load_confidence(str(tmp_path / "run" / "calibrate" / "dspark" / "confidence.safetensors")).batch
    assert int(batches.max()) + 1 == 2                       # 5 samples in micro-batches of 4: two forward passes
