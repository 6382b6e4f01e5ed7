"""train.features: cache | online | hybrid. The config check, the stream's order and resume inside a shard,
its memory bound and the estimate per mode (the training runs: tests/integration/test_features_train.py)."""
import json

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.run import DEFAULT_CONFIG, load_config
from training.data import rank_order, split_shards
from training.stream import ConsumedLog, MemoryReader, StreamFeed, StreamOrderError, max_ahead_bytes, sample_row


def test_features_mode_is_validated_at_config_load():
    assert load_config(DEFAULT_CONFIG, []).train.features.value == "cache"
    assert load_config(DEFAULT_CONFIG, ["train.features=hybrid"]).train.features.value == "hybrid"
    with pytest.raises(ConfigError, match=r"train.features: Invalid value 'stream', expected one of \[cache, "
                                          r"online, hybrid\]"):
        load_config(DEFAULT_CONFIG, ["train.features=stream"])
    with pytest.raises(ConfigError, match="draft_vocab_size: a reduced draft vocabulary is counted over the cache"):
        load_config(DEFAULT_CONFIG, ["train.features=online", "++train.drafters.dspark.draft_vocab_size=40"])
    with pytest.raises(ConfigError, match="train.stream_memory_bytes: must be >= 64 KiB"):
        load_config(DEFAULT_CONFIG, ["train.features=online", "train.stream_memory_bytes=10"])


def test_stream_items_follow_the_cache_order_and_resume_inside_a_shard():
    from pipeline.chats.ingest import ShardSpan
    from pipeline.stages.stream import StreamPlan, shard_items

    counts = {0: 5, 1: 4, 2: 6, 3: 0, 4: 3, 5: 2}
    split = split_shards(counts, heldout_shards=1, validation_shards=1)
    plan = StreamPlan([(i, ShardSpan("f", 0, i * 8, i * 8 + 8)) for i in counts], counts, {}, split)
    micro = [3, 3]  # 3 micro-batches of 2 per rank and epoch (world 2)
    items = shard_items(plan, seed=0, micro_per_epoch=micro, micro_batch=2, world=2, start_epoch=0, start_micro=0,
                        hybrid=False, committed=set())
    for rank in range(2):
        got = [(it["epoch"], it["shard"], p) for it in items[rank] for p in json.loads(it["positions"])]
        want = [(e, s, p) for e in range(2) for s, p in rank_order(split, seed=0, epoch=e, rank=rank, world=2)[:6]]
        assert got == want  # the cache's seeded order, cut at the micro-steps every rank runs
    # resumed at epoch 1, micro 1: the first emitted sample is the epoch's third, inside its shard
    again = shard_items(plan, seed=0, micro_per_epoch=micro, micro_batch=2, world=2, start_epoch=1, start_micro=1,
                        hybrid=False, committed=set())
    order = rank_order(split, seed=0, epoch=1, rank=0, world=2)
    assert again[0][0]["index"] == 2 and again[0][0]["epoch"] == 1
    assert [(it["shard"], p) for it in again[0] for p in json.loads(it["positions"])] == order[2:6]
    # hybrid: epoch 0 only, every training shard of the rank (even the dropped tail), rank 0 ends with
    # the held-out shard (write-only); committed shards before the resume position are kept
    hyb = shard_items(plan, seed=0, micro_per_epoch=micro, micro_batch=2, world=2, start_epoch=0, start_micro=0,
                      hybrid=True, committed=set())
    assert {it["shard"] for r in hyb for it in r} == set(split.train) | set(split.heldout)
    assert hyb[0][-1]["shard"] == split.heldout[0] and hyb[0][-1]["positions"] == "[]"
    first = rank_order(split, seed=0, epoch=0, rank=0, world=2)[0][0]
    resumed = shard_items(plan, seed=0, micro_per_epoch=micro, micro_batch=2, world=2, start_epoch=0,
                          start_micro=3, hybrid=True, committed={first, split.heldout[0]})
    assert first not in {it["shard"] for it in resumed[0]} and split.heldout[0] not in {
        it["shard"] for it in resumed[0]}
    assert shard_items(plan, seed=0, micro_per_epoch=micro, micro_batch=2, world=2, start_epoch=1, start_micro=0,
                       hybrid=True, committed=set()) == [[], []]


def _row(epoch, index, shard, position, produced=0.0):
    g = torch.Generator().manual_seed(shard * 100 + position)
    ids = torch.randint(0, 50, (6,), generator=g, dtype=torch.int32)
    mask = torch.tensor([0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    feats = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    last = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    return sample_row(ids, mask, feats, last, epoch=epoch, index=index, shard=shard, position=position,
                      sample_id=f"0-{shard * 10 + position}", produced_at=produced)


def test_stream_feed_rebuilds_cache_samples_bit_for_bit_and_refuses_another_order():
    order = [(2, 1), (2, 0), (0, 0), (0, 1)]
    rows = [_row(0, i, s, p) for i, (s, p) in enumerate(order)]
    feed = StreamFeed(iter(rows), order, micro_batch=2, start=0, stop=2, epoch=0)
    batches = list(feed)
    assert [[b["sample_id"] for b in m] for m in batches] == [["0-21", "0-20"], ["0-0", "0-1"]]
    ref = _row(0, 0, 2, 1)
    s = batches[0][0]
    assert s["features"].dtype == torch.bfloat16 and s["features"].shape == (6, 8) and s["last_hidden"].shape == (3, 4)
    from training.stream import row_sample

    back = row_sample(ref)
    assert torch.equal(s["features"].view(torch.int16), back["features"].view(torch.int16))
    # resume at micro 1: the rows a restarted stream repeats before it are dropped
    assert [[b["sample_id"] for b in m] for m in StreamFeed(iter(rows), order, 2, 1, 2, 0)] == [["0-0", "0-1"]]
    swapped = [rows[1], rows[0], *rows[2:]]
    with pytest.raises(StreamOrderError, match=r"expected \(0, 0, 2, 1\)"):
        list(StreamFeed(iter(swapped), order, 2, 0, 2, 0))
    with pytest.raises(StreamOrderError, match="ended inside epoch 0"):
        list(StreamFeed(iter(rows[:3]), order, 2, 0, 2, 0))
    mem = MemoryReader([_row(-1, p, 4, p) for p in (1, 0)])
    assert mem.shards == [4] and mem.records[4].num_samples == 2 and mem.sample(1).sample_id == "0-41"
    log = ConsumedLog()
    log.add(batches[0])
    again = ConsumedLog(log.state(0, 1))
    again.add(batches[1])
    whole = ConsumedLog()
    whole.add(batches[0] + batches[1])
    assert again.sha256 == whole.sha256 and again.samples == 4 and again.last == "0-1"


def test_max_ahead_bytes_counts_rows_produced_but_not_consumed():
    # rows of 10 bytes: produced at 0, 0, 0, 5; consumed at 1, 2, 6, 7
    tl = [(0, 1, 10), (0, 2, 10), (0, 6, 10), (5, 7, 10)]
    assert max_ahead_bytes(tl) == 30 and max_ahead_bytes([]) == 0
    assert max_ahead_bytes([(0, 1, 5), (2, 3, 5)]) == 5


def test_estimate_prints_storage_and_prefill_passes_per_mode():
    """6 epochs online = 6 prefills of the training shards; hybrid = 1 prefill + the cache's bytes."""
    from ops.estimate import feature_modes

    cfg = load_config(DEFAULT_CONFIG, ["train.epochs=6", "train.heldout_shards=1", "train.validation_shards=1",
                                       "~train.drafters.dflash", "~train.drafters.eagle3"])
    counts = [{"shard": i, "samples": 10, "tokens": 1000 + i} for i in range(5)]  # 3 train, 1 val, 1 held out
    m = feature_modes(counts, cfg, nbytes=123_456, objects=77)
    assert m["cache"] == {"bytes": 123_456, "objects": 77, "prefill_tokens_before_training": 5010,
                          "prefill_tokens_per_epoch": [0] * 6, "prefill_tokens_run": 5010, "prefills": 1.0}
    assert m["online"]["bytes"] == 0 and m["online"]["prefill_tokens_per_epoch"] == [3003] * 6
    assert m["online"]["prefill_tokens_run"] == 6 * 3003 + 1003 and m["online"]["prefill_tokens_before_training"] == 1003
    assert m["hybrid"]["bytes"] == 123_456 and m["hybrid"]["prefill_tokens_per_epoch"] == [5010, 0, 0, 0, 0, 0]
    assert m["hybrid"]["prefills"] == 1.0 and round(m["online"]["prefills"], 2) == round((6 * 3003 + 1003) / 5010, 2)
