"""Cache reader throughput at the Qwen3-4B recipe's width: 1 vs N prefetch workers, local disk and S3.

Writes a small cache with the product's writer (``CacheRoot.write_shard``, default ``StorageConfig``:
the cache contract's chunking, unchanged): ``--shards`` shards of ``--samples`` samples of ``--tokens``
tokens, features [T, 5 x 2560] bf16 and the final hidden state [T_sup, 2560] bf16 (30.7 KB per token,
~63 MB per 2,048-token sample), once to a local folder and once to a local S3 server (moto on
127.0.0.1, as the tests start one). Then reads every sample through the trainer's
:class:`training.data.Prefetcher` (in a shuffled rank order, micro-batches of 4, collated on the CPU as
the train worker does without pinning) with 1 and with each N of ``--workers`` reading threads, warm
(the shard groups opened first), ``--repeats`` times, and prints samples/s, MB/s (sample bytes
delivered per wall second), CPU-seconds per GB (process CPU time over the bytes: what one core
sustains is 1 / that) and the ratio to 1 worker, side by side.

The local figures read from the page cache (the cache was just written): they bound the decode and
collate side. On S3 it also counts the GET requests per sample (botocore's ``before-send`` event,
``bench_scale.S3Counter``): zarr 3.1's sharding codec fetches a sample's inner chunks (2 MiB) one
after the other, each a ranged GET, plus the zarr shard's index. The S3 figures are moto's: moto
copies the whole object (a 211 MB zarr shard here) under the object's lock for every ranged GET, so
reads of one object never overlap there and its MB/s measure moto, not the reader nor S3.

So that the overlap of the reads can be measured here, ``--latency-ms`` also reads the local cache
through ``latencyfile://``, local files whose every read (a ranged GET's stand-in) first waits that many
milliseconds: an object store whose request time does not grow with the requests in flight (S3 allows
5,500 GET/s per prefix). zarr runs a synchronous filesystem's reads on asyncio's default executor,
``min(32, cores + 4)`` threads (6 on 2 cores), which caps the overlap there; s3fs is asynchronous.

    nice -n 10 python bench/bench_reader.py --workers 2 4 8 --latency-ms 30 --out runs/bench_reader.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from common import s3_server

HIDDEN, LAYERS = 2560, (1, 9, 17, 25, 33)  # Qwen3-4B: hidden size, the recipe's target layer ids
ONE_RANK_GBPS = 0.6  # what one training rank consumes at ~0.3 s of GPU time per micro-step (issue #35)


class LatencyFileSystem(LocalFileSystem):
    """Local files (``latencyfile:///path``) whose every read waits ``latency_s`` first."""

    protocol = ("latencyfile",)
    latency_s = 0.0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return LocalFileSystem._strip_protocol(path[len("latencyfile://"):] if path.startswith("latencyfile://")
                                               else path)

    def unstrip_protocol(self, name: str) -> str:
        return "latencyfile://" + self._strip_protocol(name)

    def cat_file(self, path, start=None, end=None, **kwargs):
        time.sleep(self.latency_s)
        return super().cat_file(path, start=start, end=end, **kwargs)


def fingerprint(max_length: int):
    from cache_schema import Fingerprint

    return Fingerprint(target={"model_type": "qwen3", "hidden_size": HIDDEN, "num_hidden_layers": 36}, embed_hash="e",
                       lm_head_hash="f", tokenizer_hash="a", chat_template_hash="b", target_layer_ids=LAYERS,
                       max_length=max_length, min_loss_tokens=1)


def sample(i: int, tokens: int):
    """A random sample: the first 32 tokens unsupervised (the prompt), the rest supervised."""
    import torch

    from cache_schema import CacheSample

    g = torch.Generator().manual_seed(i)
    mask = torch.ones(tokens, dtype=torch.uint8)
    mask[:32] = 0
    sup = int(mask[1:].sum())
    return CacheSample(input_ids=torch.randint(0, 151_936, (tokens,), generator=g, dtype=torch.int32), loss_mask=mask,
                       features=torch.randn(tokens, HIDDEN * len(LAYERS), generator=g).to(torch.bfloat16),
                       last_hidden=torch.randn(sup, HIDDEN, generator=g).to(torch.bfloat16),
                       sample_id=f"0-{i}", source=0, row=i, content_hash=f"{i:08x}")


def write_cache(url: str, shards: int, samples: int, tokens: int) -> int:
    """Write the cache; returns its sample bytes (ids, mask, features, last hidden state)."""
    from cache_schema import open_cache

    root = open_cache(url, fingerprint(tokens))
    total = 0
    for s in range(shards):
        batch = [sample(s * samples + k, tokens) for k in range(samples)]
        total += sum(t.numel() * t.element_size() for x in batch
                     for t in (x.input_ids, x.loss_mask, x.features, x.last_hidden))
        root.write_shard(s, batch, writer_id="bench", extra={"skipped": {}, "source": 0, "rows": [s * samples,
                                                                                                 (s + 1) * samples]})
        del batch
    return total


def read_all(url: str, workers: int, micro_batch: int) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, samples) of one prefetched pass over every sample."""
    from cache_schema import CacheReader
    from training.blocks import collate_samples
    from training.data import Prefetcher, rank_order, split_shards

    reader = CacheReader(url)
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, 0)
    order = rank_order(split, seed=0, epoch=0, rank=0, world=1)
    first = 0
    for s in reader.shards:  # warm: shard groups opened (object listing, offsets), as after a rank's first read
        reader.sample(first)
        first += reader.records[s].num_samples
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for samples, batch in Prefetcher(reader, order, micro_batch, 0, len(order) // micro_batch,
                                     collate=collate_samples, workers=workers):
        n += len(samples)
        assert batch.features.shape[0] == len(samples)
    return time.perf_counter() - t0, time.process_time() - c0, n


def measure(url: str, workers: list[int], repeats: int, micro_batch: int, sample_bytes: float,
            counter=None) -> list[dict]:
    rows = []
    for w in workers:
        if counter is not None:
            counter.take()
        runs = [read_all(url, w, micro_batch) for _ in range(repeats)]
        walls, cpus, n = [r[0] for r in runs], [r[1] for r in runs], runs[0][2]
        gets = counter.take().get("GET", 0) / (n * repeats) if counter is not None else None
        best, med = min(walls), statistics.median(walls)
        rows.append({"workers": w, "samples": n, "best_s": round(best, 3), "median_s": round(med, 3),
                     "samples_per_s": round(n / best, 2), "MB_per_s": round(n * sample_bytes / best / 1e6, 1),
                     "median_MB_per_s": round(n * sample_bytes / med / 1e6, 1),
                     "cpu_s_per_GB": round(statistics.median(cpus) / (n * sample_bytes / 1e9), 3),
                     **({"GETs_per_sample": round(gets, 1)} if gets is not None else {})})
    base = rows[0]["MB_per_s"]
    for r in rows:
        r["x_vs_1"] = round(r["MB_per_s"] / base, 2)
    return rows


def show(where: str, rows: list[dict]) -> None:
    print(f"\n{where}")
    print(f"{'workers':>8} {'samples/s':>10} {'MB/s best':>10} {'MB/s med':>9} {'x vs 1':>7} {'CPU s/GB':>9} "
          f"{'cores for 1 rank':>17} {'GETs/sample':>12}")
    for r in rows:
        cores = ONE_RANK_GBPS * r["cpu_s_per_GB"]
        print(f"{r['workers']:>8} {r['samples_per_s']:>10} {r['MB_per_s']:>10} {r['median_MB_per_s']:>9} "
              f"{r['x_vs_1']:>7} {r['cpu_s_per_GB']:>9} {cores:>17.2f} {r.get('GETs_per_sample', '-'):>12}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="samples per shard")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="N prefetch workers (1 is always run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--latency-ms", type=float, nargs="*", default=[30.0],
                   help="also read the local cache with this per-request latency (ms)")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--s3-workers", type=int, nargs="+", default=[4], help="N on S3 (moto is slow: few runs)")
    p.add_argument("--s3-repeats", type=int, default=1)
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    workers = [1, *[w for w in a.workers if w != 1]]
    report = {"shards": a.shards, "samples_per_shard": a.samples, "tokens": a.tokens,
              "width": HIDDEN * len(LAYERS), "hidden": HIDDEN, "one_rank_GB_per_s": ONE_RANK_GBPS}
    with tempfile.TemporaryDirectory() as tmp:
        total = write_cache(f"{tmp}/cache", a.shards, a.samples, a.tokens)
        per = total / (a.shards * a.samples)
        report.update(cache_MB=round(total / 1e6, 1), sample_MB=round(per / 1e6, 2))
        print(f"cache: {a.shards} shards x {a.samples} samples x {a.tokens} tokens, {total / 1e6:.0f} MB "
              f"({per / 1e6:.1f} MB per sample); one rank needs {ONE_RANK_GBPS} GB/s")
        report["local"] = measure(f"{tmp}/cache", workers, a.repeats, a.micro_batch, per)
        show("local disk (page cache)", report["local"])
        fsspec.register_implementation("latencyfile", LatencyFileSystem, clobber=True)
        for ms in a.latency_ms:
            LatencyFileSystem.latency_s = ms / 1000
            report[f"latency_{ms:g}ms"] = measure(f"latencyfile://{tmp}/cache", workers, a.repeats, a.micro_batch, per)
            show(f"local disk, {ms:g} ms per read (an object store's request time)", report[f"latency_{ms:g}ms"])
    if not a.no_s3:
        from bench_scale import S3Counter

        counter = S3Counter()
        with s3_server() as bucket:
            write_cache(f"{bucket}/cache", a.shards, a.samples, a.tokens)
            report["s3"] = measure(f"{bucket}/cache", [1, *[w for w in a.s3_workers if w != 1]], a.s3_repeats,
                                   a.micro_batch, per, counter)
            show("S3 (moto on 127.0.0.1, same cores)", report["s3"])
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
