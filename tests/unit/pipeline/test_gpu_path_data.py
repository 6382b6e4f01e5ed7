"""Data paths that keep a GPU busy, held in place on the CPU (issue #35 findings 6 and 10).

- Training reads: :class:`training.data.Prefetcher` reads samples on ``workers`` threads at once and
  still yields the micro-batches of one worker, tensor for tensor, in the same order; its look-ahead
  is bounded; :class:`cache_schema.CacheReader` is safe to read from several threads.
- vLLM generate: the engine gets a shard's whole round in one ``llm.generate`` call
  (``generate.max_num_seqs`` bounds vLLM's concurrency), and a prompt that makes the call raise is
  isolated by bisection. vLLM is not installed in this venv, so ``vllm.LLM`` / ``SamplingParams``
  are stood in for at the lowest level (the ``llm.generate`` call); everything above it is the product's.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cache_schema import CacheReader, CacheSample, Fingerprint, StorageConfig, open_cache
from training.blocks import collate_samples
from training.data import Prefetcher, rank_order, split_shards

pytestmark = pytest.mark.gpu_path

H, LAYERS = 8, (0, 1)


def _sample(i: int, t: int) -> CacheSample:
    g = torch.Generator().manual_seed(i)
    mask = torch.ones(t, dtype=torch.uint8)
    mask[:2] = 0
    return CacheSample(input_ids=torch.randint(0, 512, (t,), generator=g, dtype=torch.int32), loss_mask=mask,
                       features=torch.randn(t, H * len(LAYERS), generator=g).to(torch.bfloat16),
                       last_hidden=torch.randn(int(mask[1:].sum()), H, generator=g).to(torch.bfloat16),
                       sample_id=f"s{i}", source=0, row=i, content_hash=f"{i:08x}")


@pytest.fixture
def cache_url(tmp_path) -> str:
    """3 shards x 6 samples of 5..22 tokens, several zarr chunks per sample."""
    fp = Fingerprint(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 4}, embed_hash="e",
                     lm_head_hash="f", tokenizer_hash="a", chat_template_hash="b", target_layer_ids=LAYERS,
                     max_length=64, min_loss_tokens=1)
    url = str(tmp_path / "cache")
    root = open_cache(url, fp, storage=StorageConfig(chunk_bytes=256, shard_bytes=1024))
    for s in range(3):
        root.write_shard(s, [_sample(6 * s + k, 5 + (7 * (6 * s + k)) % 18) for k in range(6)], writer_id="t")
    return url


def _epoch(url: str, workers: int, reader: CacheReader | None = None) -> list:
    reader = reader or CacheReader(url, max_open_shards=1)  # 1: shard groups reopened while threads read
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, 0)
    order = rank_order(split, seed=3, epoch=1, rank=0, world=1)
    return list(Prefetcher(reader, order, 4, 1, 4, collate=collate_samples, workers=workers))


def test_prefetch_with_n_workers_reads_in_parallel_and_yields_the_batches_of_one(cache_url):
    """4 workers: 4 reads run at once (a barrier only 4 concurrent reads pass), and the micro-batches
    (sample ids, every tensor, the collated batch) equal one worker's, in the same order. Before the
    fix the Prefetcher took no ``workers`` and read one sample at a time on one thread."""
    one = _epoch(cache_url, 1)
    reader = CacheReader(cache_url, max_open_shards=1)
    barrier, threads, calls, read = threading.Barrier(4, timeout=10), set(), itertools.count(), reader.sample

    def sample(i):
        threads.add(threading.get_ident())
        if next(calls) < 4:
            barrier.wait()  # passes only when 4 reads are in progress at the same time
        return read(i)

    reader.sample = sample
    four = _epoch(cache_url, 4, reader)
    assert len(threads) == 4
    assert len(one) == 3 and [len(b) for b, _ in one] == [4, 4, 4]  # micro-batches 1..3 of the epoch
    assert [[s["sample_id"] for s in b] for b, _ in four] == [[s["sample_id"] for s in b] for b, _ in one]
    for (b1, c1), (b4, c4) in zip(one, four):
        for s1, s4 in zip(b1, b4):
            for k in ("input_ids", "loss_mask", "features", "last_hidden"):
                assert s1[k].dtype == s4[k].dtype and torch.equal(_bits(s1[k]), _bits(s4[k])), k
        for f in ("input_ids", "loss_mask", "features", "last_hidden", "row_offsets", "lengths"):
            assert torch.equal(_bits(getattr(c1, f)), _bits(getattr(c4, f))), f


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 compared bit for bit (NaN-safe, -0.0 != 0.0)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_prefetch_order_is_the_rank_order_and_errors_arrive_in_place(cache_url):
    """The yielded samples are the rank order's micro-batches 1..3; a read error reaches the consumer
    after the micro-batches before it, not earlier (sample s17 is in the third)."""
    reader = CacheReader(cache_url)
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, 0)
    order = rank_order(split, seed=3, epoch=1, rank=0, world=1)
    ids = [f"s{6 * s + k}" for s, k in order]  # the fixture writes sample 6s+k at (shard s, position k)
    got = [s["sample_id"] for b in Prefetcher(reader, order, 4, 1, 4, workers=3) for s in b]
    assert got == ids[4:16] and len(set(got)) == 12
    read = reader.sample

    def sample(i):
        if i == 17:
            raise OSError("boom")
        return read(i)

    reader.sample = sample
    feed = iter(Prefetcher(reader, [(2, k) for k in range(6)] * 2, 2, 0, 6, workers=4))
    assert [s["sample_id"] for s in next(feed)] == ["s12", "s13"]
    assert [s["sample_id"] for s in next(feed)] == ["s14", "s15"]
    with pytest.raises(OSError, match="boom"):
        list(feed)


def test_ordered_map_bounds_its_look_ahead():
    """At most ``ahead`` calls beyond the items yielded are ever started (memory stays bounded), and
    the results come in input order even when later calls finish first."""
    from training.data import ordered_map

    started = []

    def fn(x):
        started.append(x)
        time.sleep(0.02 * (5 - x % 5))  # later items finish first
        return x * x

    gen = ordered_map(fn, range(40), workers=3, ahead=5)
    assert next(gen) == 0
    deadline = time.monotonic() + 10
    while len(started) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(started) == 6  # the first item, yielded, and 5 ahead: nothing more is read
    assert list(gen) == [x * x for x in range(1, 40)]
    with pytest.raises(ValueError, match="workers=0"):
        next(ordered_map(fn, [1], workers=0, ahead=1))


# --- vLLM generate: the whole round in one call, failures isolated by bisection -------------------------


class _FakeLLM:
    """``vllm.LLM``'s ``generate`` for token-id prompts: answers ``[7, stop]``, raises when a chosen
    prompt is in the call, records every call's prompt count."""

    def __init__(self, stop_id: int, bad=(), dead=False):
        self.stop_id, self.bad, self.dead, self.calls = stop_id, [list(b) for b in bad], dead, []

    def generate(self, prompts, params, use_tqdm=False):
        ids = [p["prompt_token_ids"] for p in prompts]
        self.calls.append(len(ids))
        assert len(params) == len(ids) and not use_tqdm
        if self.dead or any(p in self.bad for p in ids):
            raise RuntimeError("vLLM: request failed")
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, self.stop_id], finish_reason="stop")])
                for _ in ids]


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module with ``LLM`` (records its keyword arguments) and ``SamplingParams``."""
    made = []

    class LLM:
        def __init__(self, **kw):
            made.append(kw)

    params = lambda **kw: SimpleNamespace(**kw)  # noqa: E731
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=params))
    return made


def _vllm_engine(tokenizer, llm):
    from pipeline.target_model.engines import VLLMEngine, stop_token_ids

    engine = VLLMEngine.__new__(VLLMEngine)  # the product's generate(), a stand-in llm under it
    engine.tokenizer, engine.stop_ids, engine.llm = tokenizer, stop_token_ids(tokenizer), llm
    return engine


def _chats(n: int):
    from pipeline.chats.ingest import Chat

    return [Chat(({"role": "user", "content": f"Question number {i} " + "x " * (i % 5)},), 0, i, "mem.jsonl", f"c{i}")
            for i in range(n)]


def _cfg(tmp_path, *extra):
    from pipeline.run import DEFAULT_CONFIG, load_config

    return load_config(DEFAULT_CONFIG, [f"run_dir={tmp_path}", "data.train_files=[unused.jsonl]",
                                        "generate.max_new_tokens=8", "generate.batch_size=4", *extra])


def test_vllm_gets_the_whole_round_and_one_bad_prompt_costs_log_n_calls(tiny_tokenizer, fake_vllm, tmp_path):
    """32 prompts, one that makes ``llm.generate`` raise: the first call holds all 32 (not
    ``generate.batch_size`` = 4), bisection takes 1 + 2 log2(32) = 11 calls, and only the bad row is
    skipped, as ``generation_error``, counted in ``rows_failed``. Before the fix: 8 calls of 4, then
    the failing batch's 4 prompts one at a time."""
    from pipeline.chats.render import render_prompt
    from pipeline.stages.generate import regenerate

    cfg = _cfg(tmp_path)
    chats = _chats(32)
    bad = render_prompt(tiny_tokenizer, list(chats[13].messages), cfg.data.render)
    llm = _FakeLLM(tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"), bad=[bad])
    res = regenerate(chats, _vllm_engine(tiny_tokenizer, llm), cfg)
    assert llm.calls[0] == 32
    assert sorted(llm.calls) == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32]  # both halves, down to the bad prompt
    assert [(e["row"], e["reason"]) for e in res.errors] == [(13, "generation_error")]
    assert "RuntimeError: vLLM: request failed" in res.errors[0]["detail"]
    assert [r["row"] for r in res.rows] == [i for i in range(32) if i != 13]
    assert res.stats["rows_failed"] == {"generation_error": 1} and res.stats["rows_kept"] == 31
    assert res.stats["turns_generated"] == 31 and res.stats["new_tokens"] == 62


def test_a_dead_vllm_engine_stops_the_shard_instead_of_committing_every_row_as_failed(tiny_tokenizer, fake_vllm,
                                                                                        tmp_path):
    """Every prompt fails on its own: the engine is broken, so the shard raises (stays uncommitted,
    a rerun regenerates it) instead of becoming a committed shard of errors."""
    from pipeline.stages.generate import GenerationEngineError, regenerate

    llm = _FakeLLM(0, dead=True)
    with pytest.raises(GenerationEngineError, match="each of the 6 prompts.*rerun \\+stage=generate"):
        regenerate(_chats(6), _vllm_engine(tiny_tokenizer, llm), _cfg(tmp_path))
    assert llm.calls[0] == 6 and len(llm.calls) == 11  # 2n - 1 calls: every half fails down to single prompts


def test_max_num_seqs_reaches_vllm_and_hf_keeps_its_batches(tiny_target_dir, fake_vllm, tmp_path):
    """``generate.max_num_seqs`` is passed to ``vllm.LLM`` (None: vLLM's default, not passed);
    the HF engine still pads ``generate.batch_size`` prompts per call."""
    from pipeline.target_model.engines import HFEngine, make_engine

    cfg = _cfg(tmp_path, f"target.path={tiny_target_dir}", "generate.engine=vllm", "generate.max_num_seqs=64")
    engine = make_engine(cfg.generate, cfg.target, 128)
    assert engine.schedules_batches and fake_vllm[-1]["max_num_seqs"] == 64 and fake_vllm[-1]["max_model_len"] == 128
    make_engine(_cfg(tmp_path, f"target.path={tiny_target_dir}", "generate.engine=vllm").generate, cfg.target, 128)
    assert "max_num_seqs" not in fake_vllm[-1]
    assert HFEngine.schedules_batches is False
