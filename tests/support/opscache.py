"""Small caches for the ops tests, written with the product's writer: fingerprints, samples, committed
and crashed shards, and ``ops ... --json`` run in process (tests/unit/ops, tests/integration)."""
from __future__ import annotations

import hashlib
import json

import torch

from cache_schema import CacheSample, Fingerprint, StorageConfig, open_cache
from cache_schema.layout import commit_key
from ops.__main__ import main

H, LAYERS = 16, (0, 1, 2)
SMALL = StorageConfig(chunk_bytes=512, shard_bytes=2048)  # several zarr shard objects per array


def make_fp(hidden: int = H, **changes) -> Fingerprint:
    fields = dict(target={"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": 4,
                          "vocab_size": 512, "config_sha256": "c0ffee"},
                  embed_hash="e" * 64, lm_head_hash="f" * 64, tokenizer_hash="a" * 64,
                  chat_template_hash="b" * 64, render_options={"system_prompt": "keep"},
                  target_layer_ids=LAYERS, max_length=256, min_loss_tokens=1)
    return Fingerprint(**{**fields, **changes})


def make_sample(i: int, t: int, *, source: int = 0, row: int | None = None, sid: str | None = None) -> CacheSample:
    g = torch.Generator().manual_seed(i)
    mask = (torch.arange(t) >= t // 3).to(torch.uint8)
    return CacheSample(input_ids=torch.randint(0, 512, (t,), generator=g, dtype=torch.int32), loss_mask=mask,
                       features=torch.randn(t, len(LAYERS) * H, generator=g).to(torch.bfloat16),
                       last_hidden=torch.randn(int(mask[1:].sum()), H, generator=g).to(torch.bfloat16),
                       sample_id=sid or f"{source}-{i if row is None else row}", source=source,
                       row=i if row is None else row, content_hash=hashlib.sha256(str(i).encode()).hexdigest())


def commit(root, shard: int, samples: list[CacheSample], *, rows: int = 4, writer: str | None = None):
    """Write and commit a shard with the extra the cache stage writes (source 0, ``rows`` rows per shard)."""
    extra = {"skipped": {"invalid_json": 1}, "source": 0, "rows": [rows * shard, rows * shard + rows]}
    return root.write_shard(shard, samples, writer_id=writer or f"w{shard}", extra=extra)


def build(url: str, shards: dict[int, list[CacheSample]]):
    """A cache at ``url`` with these committed shards."""
    root = open_cache(url, make_fp(), storage=SMALL)
    for i, samples in shards.items():
        commit(root, i, samples)
    return root


def crash(root, shard: int, samples: list[CacheSample]) -> None:
    """Leave a shard as a killed writer does: all data objects written, no commit record."""
    root.write_shard(shard, samples, writer_id="crashed")
    root.fs.rm(f"{root.path}/{commit_key(shard)}")


def run(capsys, *argv) -> tuple[int, dict]:
    code = main([*map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)
