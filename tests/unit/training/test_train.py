"""Train stage's parts: the LR schedule, stale DeepSpeed build locks, the rank order, checkpoint parts, the
metrics log across a resume and whole validation batches (Ray Train + DeepSpeed ZeRO on CPU, DDP cross-check,
exact resume, refusals: tests/integration/test_train_stage.py)."""
import json
import os
import time
from pathlib import Path

import pytest

from training.checkpoint import CheckpointError, commit, latest_checkpoint, read_parts, write_part
from training.data import micro_steps_per_epoch, rank_order, split_shards
from training.engine import clear_stale_build_locks, lr_lambda


def test_lr_schedule_warmup_then_cosine_peak_first():
    f = lr_lambda(100, 0.04)
    assert [round(f(s), 4) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]  # W = 4; step 4 is the peak
    assert f(5) < 1.0 and f(99) < 0.001 and abs(f(52) - 0.5) < 1e-9


def test_only_stale_deepspeed_build_locks_are_removed(tmp_path):
    """A build killed mid-way leaves its lock and every later DeepSpeed CPU init would wait on it."""
    old, fresh, other = (tmp_path / "deepspeed_shm_comm/lock", tmp_path / "deepspeed_adam/lock",
                         tmp_path / "my_op/lock")
    for p in (old, fresh, other):
        p.parent.mkdir()
        p.touch()
    for p in (old, other):
        os.utime(p, (time.time() - 1000, time.time() - 1000))
    assert clear_stale_build_locks(str(tmp_path), max_age_s=900) == [str(old)]
    assert not old.exists() and fresh.exists() and other.exists()
    assert clear_stale_build_locks(str(tmp_path), max_age_s=900) == []


def test_rank_order_partitions_each_epoch():
    split = split_shards({0: 5, 1: 4, 2: 6, 3: 0, 4: 3}, heldout_shards=1)
    assert split.train == (0, 1, 2) and split.heldout == (4,)
    orders = [rank_order(split, seed=0, epoch=1, rank=r, world=2) for r in range(2)]
    assert sorted(orders[0] + orders[1]) == sorted((s, k) for s in (0, 1, 2) for k in range(split.counts[s]))
    assert not {s for s, _ in orders[0]} & {s for s, _ in orders[1]}  # ranks read disjoint shards
    assert rank_order(split, seed=0, epoch=1, rank=0, world=2) == orders[0]
    assert rank_order(split, seed=0, epoch=2, rank=0, world=2) != orders[0]
    n = micro_steps_per_epoch(split, seed=0, epoch=1, world=2, micro_batch=2, accumulation=2)
    assert n == (min(len(o) for o in orders) // 2) // 2 * 2
    with pytest.raises(ValueError, match="leave none to train on"):
        split_shards({0: 3}, heldout_shards=1)
    three = split_shards({0: 5, 1: 4, 2: 6, 3: 0, 4: 3}, heldout_shards=1, validation_shards=1)
    assert three.train == (0, 1) and three.validation == (2,) and three.heldout == (4,)
    with pytest.raises(ValueError, match="validation_shards=2 leave none"):
        split_shards({0: 5, 1: 4, 2: 6}, heldout_shards=1, validation_shards=2)


def test_checkpoint_refuses_missing_rank_part(tmp_path):
    url = str(tmp_path / "train")
    ckpt = f"{url}/checkpoints/step-000002"
    (tmp_path / "train/checkpoints/step-000002/engine").mkdir(parents=True)
    (tmp_path / "train/checkpoints/step-000002/engine/a.pt").write_bytes(b"1234")
    write_part(ckpt, 0, {"a.pt": 4})
    with pytest.raises(CheckpointError, match="rank 1's part is missing"):
        commit(url, 2, {"world_size": 2})
    assert latest_checkpoint(url) is None
    write_part(ckpt, 1, {"b.pt": 9})
    with pytest.raises(CheckpointError, match="engine/b.pt is missing or truncated"):
        read_parts(ckpt, 2)
    (tmp_path / "train/checkpoints/step-000002/engine/b.pt").write_bytes(b"123456789")
    commit(url, 2, {"world_size": 2, "step": 2})
    assert latest_checkpoint(url)[1]["step"] == 2
    (tmp_path / "train/latest").write_text("step-000004")
    with pytest.raises(CheckpointError, match="not committed"):
        latest_checkpoint(url)


def test_metrics_log_keeps_one_row_per_step_across_a_resume(tmp_path):
    from training.metrics_log import LiveMetrics as MetricsLog

    url = str(tmp_path / "train" / "metrics.jsonl")
    first = MetricsLog(url, 0)
    for step in range(1, 8):
        first.add({"step": step, "loss": float(step)})
    first.flush()  # the killed attempt got to step 7; its last checkpoint was step 4
    again = MetricsLog(url, 4)
    assert [r["step"] for r in again.rows] == [1, 2, 3, 4]
    for step in range(5, 9):
        again.add({"step": step, "loss": -float(step)})
    again.flush()
    rows = [json.loads(x) for x in Path(url).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[4]["loss"] == -5.0


def test_validation_batches_are_whole_and_equal_per_rank():
    from types import SimpleNamespace

    from training.validation import validation_batches

    counts = {0: 5, 1: 7, 2: 9, 3: 3}
    reader = SimpleNamespace(shards=[0, 1, 2, 3], records={s: SimpleNamespace(num_samples=n) for s, n in counts.items()})
    split = split_shards(counts, heldout_shards=1, validation_shards=1)  # validation = shard 2 (9 samples)
    assert validation_batches(split, reader, micro_batch=2, max_samples=100, world=1) == \
        [[12, 13], [14, 15], [16, 17], [18, 19]]
    assert len(validation_batches(split, reader, micro_batch=2, max_samples=100, world=3)) == 3
    assert validation_batches(split, reader, micro_batch=2, max_samples=5, world=1) == [[12, 13], [14, 15]]
    assert validation_batches(split_shards(counts, 1), reader, micro_batch=2, max_samples=9, world=1) == []
