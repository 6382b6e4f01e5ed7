"""The cache shard writer before and after streaming (issue #35 finding 5), side by side in one run, at
the real width: Qwen3-4B's 5 captured layers x 2,560 bf16 features + the 2,560 bf16 final hidden state,
2,048-token samples, a ~0.9 GiB shard (16 samples), to local disk and to a local S3 server (moto).

Each writer runs in its own process pinned to ONE core (``os.sched_setaffinity``, torch and zarr threads
included; the S3 server is started before and runs on the other cores, its CPU is not counted):

- old: the writer as it was (copied below): the prefill's samples are all held, then validated with
  ``torch.isfinite``, concatenated, hashed via ``tobytes()`` and written with zarr ``create_array(data=...)``;
- new: ``CacheRoot.new_shard`` / ``ShardBuffer.put`` per 2-sample batch (the batch is then dropped, as in
  the prefill actor) and ``CacheRoot.commit_shard``: bit checks, hashlib over pieces, streamed zarr shards.

Reported per writer: peak RSS increase / shard bytes (from before the shard's samples exist: the held
samples count), write MiB/s of wall time on its core and its split (copy, finiteness check, hash, PUT),
MiB per CPU-second of the writer's own process (the S3 server's excluded), and from that the cores per GPU
the cache stage needs to keep up with one H200 prefilling Qwen3-4B at ~1.8 GB/s of cache. On S3 the new
writer also runs with the request bodies SHA-256-signed ("new+sign": botocore's default on a plain-HTTP
endpoint, as before ``storage.s3_options`` set ``s3.payload_signing_enabled: False``).

    python bench/bench_cache_writer.py [--samples 16] [--tokens 2048] [--core 0] [--no-s3] [--no-local] [--no-zstd]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from common import REPO, s3_server

H, LAYERS = 2560, (1, 9, 17, 25, 33)  # Qwen3-4B: hidden size, captured layers
GPU_CACHE_BYTES_PER_S = 1.8e9  # one H200 prefilling Qwen3-4B at 50% MFU (issue #35)


def peak_kib() -> int:
    """VmHWM: this process's resident-set high-water mark (KiB) since the last :func:`reset_peak`."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0])


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def fingerprint(tokens: int):
    from cache_schema import Fingerprint

    return Fingerprint(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 36,
                               "vocab_size": 151936, "config_sha256": "bench"},
                       embed_hash="e" * 64, lm_head_hash="f" * 64, tokenizer_hash="a" * 64, chat_template_hash="b" * 64,
                       render_options={}, target_layer_ids=LAYERS, max_length=tokens, min_loss_tokens=1)


def make_sample(i: int, tokens: int):
    """A sample of finite bf16 values (positive bit patterns below 0x3E80, drawn as int16), a quarter of
    its tokens unsupervised (a prompt)."""
    import torch

    from cache_schema import CacheSample

    g = torch.Generator().manual_seed(i)
    bits = lambda *shape: torch.randint(0, 16000, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    mask = torch.ones(tokens, dtype=torch.uint8)
    mask[: tokens // 4] = 0
    return CacheSample(input_ids=torch.randint(0, 151936, (tokens,), generator=g, dtype=torch.int32), loss_mask=mask,
                       features=bits(tokens, len(LAYERS) * H), last_hidden=bits(int(mask[1:].sum()), H),
                       sample_id=f"0-{i}", source=0, row=i, content_hash=hashlib.sha256(str(i).encode()).hexdigest())


def old_write_shard(root, shard_index: int, samples, seconds: dict[str, float]) -> dict[str, str]:
    """The writer before streaming, step by step (validate, concatenate, hash, zarr write), timed into
    ``seconds``; returns the checksums it would record."""
    import numpy as np
    import torch
    import zarr

    from cache_schema.layout import bf16_to_bits

    t = time.perf_counter()
    for s in samples:  # check_finite as it was: a float pass per tensor
        assert all(bool(torch.isfinite(x).all()) for x in (s.features, s.last_hidden))
    seconds["check"] = time.perf_counter() - t
    t = time.perf_counter()
    arrays = {"input_ids": torch.cat([s.input_ids for s in samples]).numpy(),
              "loss_mask": torch.cat([s.loss_mask for s in samples]).numpy(),
              "last_hidden": bf16_to_bits(torch.cat([s.last_hidden for s in samples])),
              "offsets": np.concatenate([[0], np.cumsum([s.num_tokens for s in samples])]).astype(np.int64),
              "sup_offsets": np.concatenate([[0], np.cumsum([s.num_hidden_rows for s in samples])]).astype(np.int64),
              "source": np.array([s.source for s in samples], np.int32),
              "row": np.array([s.row for s in samples], np.int64),
              "features": bf16_to_bits(torch.cat([s.features for s in samples]))}
    seconds["copy"] = time.perf_counter() - t
    t = time.perf_counter()
    checksums = {k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for k, a in arrays.items()}
    seconds["hash"] = time.perf_counter() - t
    t = time.perf_counter()
    store = root.shard_store(shard_index, read_only=False)
    zarr.create_group(store, zarr_format=3, attributes={"sample_ids": [s.sample_id for s in samples]})
    for name, data in arrays.items():
        chunks, shards = root.storage.grid(data.shape, data.itemsize)
        zarr.create_array(store, name=name, data=data, chunks=chunks, shards=shards, compressors=None,
                          zarr_format=3, config={"write_empty_chunks": True})
    seconds["put"] = time.perf_counter() - t
    return checksums


def child(writer: str, url: str, num: int, tokens: int, core: int, zstd: bool, sign: bool = False) -> dict:
    """One writer's run in this process, pinned to ``core``; ``sign``: S3 request bodies SHA-256-signed."""
    os.sched_setaffinity(0, {core})
    import torch

    from cache_schema import StorageConfig, open_cache
    from storage import configure_storage

    torch.set_num_threads(1)
    configure_storage()
    if sign:
        import fsspec.config

        fsspec.config.conf["s3"]["config_kwargs"]["s3"] = {"payload_signing_enabled": True}
    root = open_cache(url, fingerprint(tokens), storage=StorageConfig(zstd_level=3 if zstd else None))
    reset_peak()
    base = peak_kib()
    seconds: dict[str, float] = {}
    if writer == "old":
        samples = [make_sample(i, tokens) for i in range(num)]  # the old prefill held the whole shard
        shard_bytes = sum(s.features.nbytes + s.last_hidden.nbytes + 5 * s.num_tokens for s in samples)
        held, cpu = peak_kib(), time.process_time()
        checksums = old_write_shard(root, 0, samples, seconds)
        cpu = time.process_time() - cpu
        write_only = (peak_kib() - held) * 1024 / shard_bytes
    else:
        first = make_sample(0, tokens)
        buffer = root.new_shard([tokens] * num, [first.num_hidden_rows] * num)
        del first
        cpu = 0.0  # process CPU seconds of the writer's calls (sample generation excluded)
        for b in range(0, num, 2):  # one prefill batch of 2 samples at a time, then dropped
            batch = [make_sample(i, tokens) for i in range(b, min(num, b + 2))]
            cpu -= time.process_time()
            for s in batch:
                buffer.put(s.row, s)
            cpu += time.process_time()
            del batch, s
        cpu -= time.process_time()
        record = root.commit_shard(0, buffer, writer_id="bench")
        cpu += time.process_time()
        shard_bytes, checksums, seconds = buffer.nbytes, record.checksums, dict(buffer.seconds)
        write_only = None
    peak = (peak_kib() - base) * 1024 / shard_bytes
    root.fs.rm(root.path, recursive=True)  # frees the S3 server's memory for the next run
    return {"writer": writer, "shard_bytes": shard_bytes, "peak_over_shard": peak, "write_only_over_shard": write_only,
            "seconds": seconds, "cpu_seconds": cpu, "checksums": checksums, "cores": len(os.sched_getaffinity(0))}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        raise SystemExit(f"bench child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_writer(writer: str = "new", samples: int = 16, tokens: int = 2048, core: int = 0) -> dict:
    """One writer's shard (``samples`` real-width samples of ``tokens`` tokens) to a temporary local
    directory, in its own process pinned to ``core`` (:func:`child`); ``bench/rehearsal.py`` reports its
    ``peak_over_shard`` (peak RSS increase / shard bytes) as the cache writer's memory per shard.

    Returns:
        :func:`child`'s dict (``shard_bytes``, ``peak_over_shard``, ``seconds`` per phase, ``cpu_seconds``, ...).

    Raises:
        SystemExit: the child process failed (its stderr's tail in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        return run_child(writer, f"{tmp}/{writer}", "--samples", str(samples), "--tokens", str(tokens),
                         "--core", str(core))


def mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / 2**20 / max(seconds, 1e-9)


def report(where: str, old: dict, new: dict, zstd: dict | None, signed: dict | None = None) -> None:
    rows = ([("old", old), ("new", new)] + ([("new+zstd3", zstd)] if zstd else [])
            + ([("new+sign", signed)] if signed else []))
    print(f"\n{where}: shard {new['shard_bytes'] / 2**30:.2f} GiB, 1 core per writer")
    print("MiB/s of wall time on the pinned core, overall and per phase; MiB/CPU-s: over the writer's own CPU "
          "time;\ncores/GPU: cores to write 1.8 GB/s at that MiB/CPU-s")
    print(f"{'writer':<10} {'peak/shard':>10} {'MiB/s':>7} {'copy':>7} {'check':>7} {'hash':>7} {'put':>7} "
          f"{'MiB/CPU-s':>9} {'cores/GPU':>9}")
    for name, r in rows:
        total = sum(r["seconds"].values())
        phases = " ".join(f"{mib_s(r['shard_bytes'], r['seconds'].get(k, 0.0)):>7.0f}"
                          for k in ("copy", "check", "hash", "put"))
        cores = GPU_CACHE_BYTES_PER_S / (r["shard_bytes"] / r["cpu_seconds"])
        print(f"{name:<10} {r['peak_over_shard']:>10.2f} {mib_s(r['shard_bytes'], total):>7.0f} {phases} "
              f"{mib_s(r['shard_bytes'], r['cpu_seconds']):>9.0f} {cores:>9.1f}")
    speed = sum(old["seconds"].values()) / sum(new["seconds"].values())
    print(f"new/old: throughput per core x{speed:.2f} (wall), x{old['cpu_seconds'] / new['cpu_seconds']:.2f} (CPU), peak memory x{new['peak_over_shard'] / old['peak_over_shard']:.2f} "
          f"(old write alone adds {old['write_only_over_shard']:.2f}x on top of the held samples); "
          f"checksums equal: {old['checksums'] == new['checksums']}")
    if signed:
        print(f"new/new+sign: x{signed['cpu_seconds'] / new['cpu_seconds']:.2f} (CPU); "
              f"old/new+sign: x{old['cpu_seconds'] / signed['cpu_seconds']:.2f} (CPU)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--no-local", action="store_true")
    ap.add_argument("--no-zstd", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("WRITER", "URL"), help=argparse.SUPPRESS)
    ap.add_argument("--zstd", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sign", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (str(args.samples), str(args.tokens), str(args.core))
    if args.child:
        print(json.dumps(child(*args.child, args.samples, args.tokens, args.core, args.zstd, args.sign)))
        return
    common = ["--samples", shape[0], "--tokens", shape[1], "--core", shape[2]]
    if not args.no_local:
        with tempfile.TemporaryDirectory() as tmp:
            runs = {w: run_child(w, f"{tmp}/{w}", *common) for w in ("old", "new")}
            z = None if args.no_zstd else run_child("new", f"{tmp}/zstd", *common, "--zstd")
            report("local disk", runs["old"], runs["new"], z)
    if not args.no_s3:
        with s3_server() as bucket:
            runs = {w: run_child(w, f"{bucket}/{w}", *common) for w in ("old", "new")}
            signed = run_child("new", f"{bucket}/signed", *common, "--sign")
            report("S3 (moto server on 127.0.0.1, its CPU not counted)", runs["old"], runs["new"], None, signed)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
