"""The caches and checks of the ops verify-cursor tests (tests/unit/ops/test_verify_cursor.py,
tests/integration/test_verify_cursor_s3.py, tests/integration/test_ops_s3.py)."""
from __future__ import annotations

from cache_schema import open_cache
from opscache import make_fp, make_sample

SHARDS, OBJECT = 4, "features/c/0/0"  # every shard: 2 samples of 10 and 7 tokens (equal object sizes)


def _checks(p: dict) -> list[tuple]:
    return [(q["shard"], q["check"]) for q in p["problems"]]


def interrupting(real, calls: list, at: int = 3):
    """A stand-in for ``ops.verify.verify_shard`` that records each shard and raises Ctrl-C at the
    ``at``-th call, so a verify stops after ``at - 1`` shards as a user's interrupt would."""
    def verify_shard(r, i):
        calls.append(i)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(r, i)
    return verify_shard


def _tiny_cache(url: str, n: int) -> None:
    """``n`` shards of one 4-token sample each, as bench/bench_scale.py writes them."""
    root = open_cache(url, make_fp())
    for i in range(n):
        root.write_shard(i, [make_sample(i, 4)], writer_id="w", extra={"skipped": {}, "source": 0, "rows": [i, i + 1]})
