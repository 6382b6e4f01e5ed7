"""Scale of the cache tools with the number of shards: seconds, peak memory, storage requests.

Writes a synthetic cache straight through the product's writer (``CacheRoot.write_shard``: one
sample of 4 tokens per shard, hidden size 8, one target layer, each record holding the row range
the cache stage would plan for it), grown to each size in turn, and after each size runs every
command once in this process (peak RSS is sampled above the command's start, imports excluded):

    ls, stat, du, verify (from scratch), verify (resumed from its cursor), diff (the cache against
    itself: two roots), resume (the cache stage's resume planning, everything committed),
    reader (CacheReader opening the cache), order (the train stage's data-order planning: reader,
    split, every epoch's rank order).

Storage requests: on S3 (moto on 127.0.0.1), every HTTP request the S3 clients send, counted on
botocore's ``before-send`` event (LIST = one listing page of up to 1,000 keys); on local disk, file
opens plus directory listings (Python audit events ``open``, ``os.listdir``, ``os.scandir``). The slope (per shard) is the least-squares fit over the sizes.

Also measures the requests of one shard write and of a training epoch's reads on S3, the
constants behind the request cost model of ``ops estimate``.

    nice -n 10 python bench/bench_scale.py --local 1000 5000 20000 --s3 1000 5000 --cost --out runs/bench_scale.json
    python bench/bench_scale.py --local --s3 1000 5000 --s3-upload --out runs/bench_scale_s3.json
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import s3_server

COMMANDS = ("ls", "stat", "du", "verify", "verify_resumed", "diff", "resume", "reader", "order")
H, T = 8, 4


def fingerprint():
    from cache_schema import Fingerprint

    return Fingerprint(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 2}, embed_hash="e",
                       lm_head_hash="f", tokenizer_hash="a", chat_template_hash="b", target_layer_ids=(0,),
                       max_length=64, min_loss_tokens=1)


def sample(i: int):
    import torch

    from cache_schema import CacheSample

    g = torch.Generator().manual_seed(i)
    mask = torch.tensor([0] + [1] * (T - 1), dtype=torch.uint8)
    return CacheSample(input_ids=torch.randint(0, 512, (T,), generator=g, dtype=torch.int32), loss_mask=mask,
                       features=torch.randn(T, H, generator=g).to(torch.bfloat16),
                       last_hidden=torch.randn(T - 1, H, generator=g).to(torch.bfloat16),
                       sample_id=f"0-{i}", source=0, row=i, content_hash=f"{i:08x}")


def grow(url: str, start: int, stop: int, workers: int = 4) -> None:
    """Write shards ``start..stop-1`` (one sample each, row i of input file 0)."""
    from cache_schema import open_cache

    root = open_cache(url, fingerprint())

    def one(i: int) -> None:
        root.write_shard(i, [sample(i)], writer_id="bench",
                         extra={"skipped": {}, "source": 0, "rows": [i, i + 1]})

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(start, stop)))


def grow_by_upload(url: str, start: int, stop: int, mirror: str, workers: int = 8) -> None:
    """Shards ``start..stop-1`` written through the writer into the local ``mirror`` cache, then their
    objects (the shard's arrays first, its commit record last) PUT one by one into the S3 cache ``url``:
    the same bytes as :func:`grow`, at one request per object instead of the writer's ~80 per shard
    (the local S3 server takes 20-60 min for 4,000 shards the writer's way; the measured commands only
    read)."""
    import boto3
    from storage import indexed_name

    grow(mirror, start, stop)
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")

    def put(path: Path) -> None:
        key = f"{prefix}/{path.relative_to(mirror).as_posix()}"
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    def shard(i: int) -> None:
        name = indexed_name("s", i)
        for path in sorted(p for p in (Path(mirror) / "shards" / name).rglob("*") if p.is_file()):
            put(path)
        put(Path(mirror) / "commits" / f"{name}.json")

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(shard, range(start, stop)))


def data_file(n: int, folder: str) -> str:
    """A chat file of ``n`` rows: the input the resume planning maps shards onto (1 row per shard)."""
    path = Path(folder) / f"chats-{n}.jsonl"
    if not path.exists():
        row = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        path.write_text((row + "\n") * n)
    return str(path)


def run_command(name: str, url: str, data: str, cursor: str) -> None:
    """One command, as the product runs it (called in a fresh process)."""
    from ops import compare, listing, verify

    if name == "ls":
        listing.ls(url)
    elif name == "stat":
        listing.stat(url)
    elif name == "du":
        listing.du(url)
    elif name in ("verify", "verify_resumed"):
        report, _ = verify.verify(url, workers=4, cursor=cursor, restart=name == "verify", progress=False)
        assert report["ok"] and report["verified_now"] == (report["shards"] if name == "verify" else 0), report
    elif name == "diff":
        assert compare.diff(url, url)[0]["identical"]
    elif name == "resume":
        from cache_schema import open_cache
        from pipeline.stages.cache import resume_plan
        from pipeline.run import DEFAULT_CONFIG, load_config

        cfg = load_config(DEFAULT_CONFIG, [f"data.train_files=[{data}]", "generate.enabled=false",
                                           "cache.rows_per_shard=1"])
        _, done, pending = resume_plan(cfg, open_cache(url, create=False))
        assert not pending and done, (len(done), len(pending))
    elif name in ("reader", "order"):
        from cache_schema import CacheReader

        reader = CacheReader(url)
        if name == "order":
            from training.data import rank_order, split_shards

            split = split_shards({s: r.num_samples for s, r in reader.records.items()}, 1, 1)
            for epoch in range(3):
                assert len(rank_order(split, seed=0, epoch=epoch, rank=0, world=1)) == len(split.train)


class LocalCounter:
    """File opens and directory listings of this process (Python audit events)."""

    def __init__(self):
        self.counts = {"open": 0, "list": 0}
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args) -> None:
        if event == "open":
            self.counts["open"] += 1
        elif event in ("os.listdir", "os.scandir"):
            self.counts["list"] += 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {"open": 0, "list": 0}
        return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(name: str, url: str, data: str, cursor: str, counter) -> dict:
    """Seconds, peak resident memory above the start of the command (MiB, sampled every 5 ms) and
    storage requests of one command run in this process (the S3 filesystem cache cleared first)."""
    import gc

    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    gc.collect()
    counter.take()
    base, peak, stop = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], rss_mib())

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    run_command(name, url, data, cursor)
    seconds = time.perf_counter() - t0
    stop.set()
    watcher.join()
    by_kind = counter.take()
    return {"seconds": seconds, "peak_mib": max(0.0, max(peak[0], rss_mib()) - base),
            "requests": sum(by_kind.values()), "by_kind": by_kind}


class S3Counter:
    """HTTP requests (every attempt) of every S3 client of this process, by operation, counted on
    botocore's ``before-send`` event of each client s3fs creates."""

    def __init__(self):
        import s3fs

        self.counts: dict[str, int] = {}
        counter, original = self, s3fs.S3FileSystem.set_session

        async def set_session(fs, *args, **kwargs):
            client = await original(fs, *args, **kwargs)
            if not getattr(client, "_bench_counted", False):
                client.meta.events.register("before-send.s3", counter._hook)
                client._bench_counted = True
            return client

        s3fs.S3FileSystem.set_session = set_session

    def _hook(self, request=None, event_name: str = "", **kwargs) -> None:
        op = event_name.rsplit(".", 1)[-1]
        kind = {"ListObjectsV2": "LIST", "ListObjects": "LIST", "HeadObject": "HEAD", "GetObject": "GET",
                "PutObject": "PUT", "DeleteObject": "DELETE", "DeleteObjects": "DELETE"}.get(op, op)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def sweep(url: str, sizes: list[int], tmp: str, counter, upload: bool = False) -> dict:
    """Every command at each size; ``upload``: past the first size, shards are added by
    :func:`grow_by_upload` (the write figures of those sizes are the upload's: its PUTs are not counted)."""
    out, have = {}, 0
    cursor = f"{tmp}/cursor-{abs(hash(url))}.jsonl"
    for n in sizes:
        t0 = time.perf_counter()
        counter.take()
        if upload and have:
            grow_by_upload(url, have, n, f"{tmp}/mirror")
        else:
            grow(url, have, n)
        write = {"seconds": time.perf_counter() - t0, "shards": n - have, "requests": counter.take(),
                 "uploaded": bool(upload and have)}
        print(f"{url}: wrote {n - have} shards in {write['seconds']:.0f} s: {write['requests']}", flush=True)
        have = n
        data = data_file(n, tmp)
        rows = {name: measure(name, url, data, cursor, counter) for name in COMMANDS}
        for name, r in rows.items():
            print(f"  {n:>6} {name:<15} {r['seconds']:8.2f} s {r['peak_mib']:7.0f} MiB {r['requests']:>8} req "
                  f"{r['by_kind']}", flush=True)
        out[n] = {"write": write, "commands": rows}
    return out


def epoch_reads(url: str, counter, shards: int, samples_per_shard: int) -> dict:
    """Requests of writing ``shards`` shards and of reading them all in training order once (S3)."""
    from cache_schema import CacheReader, open_cache
    from training.data import rank_order, split_shards

    root = open_cache(url, fingerprint())
    counter.take()
    for i in range(shards):
        root.write_shard(i, [sample(i * samples_per_shard + k) for k in range(samples_per_shard)], writer_id="b")
    write = counter.take()
    reader = CacheReader(url)
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, 0)
    starts = {s: sum(reader.records[t].num_samples for t in reader.shards if t < s) for s in reader.shards}
    counter.take()
    for s, k in rank_order(split, seed=0, epoch=0, rank=0, world=1):
        reader.sample(starts[s] + k)
    return {"shards": shards, "samples_per_shard": samples_per_shard, "write": write,
            "read_epoch": counter.take()}


def table(results: dict, where: str) -> str:
    sizes = sorted(int(n) for n in results)
    lines = [f"| {where} command | " + " | ".join(f"{n:,} shards: s / MiB / requests" for n in sizes)
             + " | slope per shard: ms / KiB / requests |", "|---" * (len(sizes) + 2) + "|"]
    for name in COMMANDS:
        rows = [results[n]["commands"][name] for n in sizes]
        cells = [f"{r['seconds']:.2f} / {r['peak_mib']:.0f} / {r['requests']:,}" for r in rows]
        s = (1000 * slope(sizes, [r["seconds"] for r in rows]), 1024 * slope(sizes, [r["peak_mib"] for r in rows]),
             slope(sizes, [r["requests"] for r in rows]))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {s[0]:.3f} / {s[1]:.1f} / {s[2]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local", type=int, nargs="*", default=[1000, 5000, 20000])
    parser.add_argument("--s3", type=int, nargs="*", default=[1000, 5000])
    parser.add_argument("--out", default="runs/bench_scale.json")
    parser.add_argument("--cost", action="store_true", help="also the write and epoch-read requests (ops estimate)")
    parser.add_argument("--s3-upload", action="store_true",
                        help="past the first S3 size, add shards by writing them locally and uploading their objects")
    args = parser.parse_args()
    from storage import configure_storage

    configure_storage()
    import ops.compare, ops.listing, ops.verify, pipeline.stages.cache, pipeline.run, training.data  # noqa: F401,E401
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.local:
            results["local"] = sweep(f"{tmp}/cache", sorted(args.local), tmp, LocalCounter())
            print(table(results["local"], "local disk"), flush=True)
        if args.s3:
            with s3_server() as bucket:
                counter = S3Counter()
                results["s3"] = sweep(f"{bucket}/cache", sorted(args.s3), tmp, counter, args.s3_upload)
                print(table(results["s3"], "S3 (moto)"), flush=True)
                if args.cost:
                    results["s3_cost"] = [epoch_reads(f"{bucket}/cost{k}", counter, 20, k) for k in (1, 8)]
                    print(json.dumps(results["s3_cost"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
