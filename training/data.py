"""Training data from cache shards: held-out split, per-rank epoch order, resumable position, prefetch.

The order of samples is a pure function of (committed shards, seed, epoch, rank, world size), so a
checkpoint only needs ``(epoch, micro-steps done in the epoch)`` to resume at the exact sample: no
sample of an epoch is seen twice and none is skipped.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from cache_schema import CacheReader, CacheSample
from cache_schema.split import ShardSplit, split_shards  # noqa: F401 (re-exported: the split is the cache's)


def rank_order(split: ShardSplit, *, seed: int, epoch: int, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's ``(shard, position)`` sample order for one epoch.

    The training shards are permuted with ``(seed, epoch)``, dealt round-robin to ranks (each rank
    reads only its own shards), and each shard's samples permuted with ``(seed, epoch, shard)``.
    """
    shards = np.random.default_rng([seed, epoch]).permutation(np.asarray(split.train, dtype=np.int64))
    order = []
    for s in shards[rank::world].tolist():
        perm = np.random.default_rng([seed, epoch, s]).permutation(split.counts[s])
        order += [(s, int(k)) for k in perm]
    return order


def micro_steps_per_epoch(split: ShardSplit, *, seed: int, epoch: int, world: int, micro_batch: int,
                          accumulation: int) -> int:
    """Micro-steps every rank runs in ``epoch``: the shortest rank's full micro-batches, rounded
    down to whole optimizer steps (the tail of longer ranks is dropped, the same way every run)."""
    shortest = min(len(rank_order(split, seed=seed, epoch=epoch, rank=r, world=world)) for r in range(world))
    return (shortest // micro_batch) // accumulation * accumulation


def as_mapping(s: CacheSample) -> dict:
    """The fields ``training.blocks.collate_samples`` takes, and ``sample_id`` (what a checkpoint's
    ``consumed`` record hashes)."""
    return {"input_ids": s.input_ids, "loss_mask": s.loss_mask, "features": s.features,
            "last_hidden": s.last_hidden, "sample_id": getattr(s, "sample_id", None)}


def sample_batches(reader: CacheReader, shards: Sequence[int], micro_batch: int, limit: int | None = None
                   ) -> Iterator[list[dict]]:
    """The samples of ``shards`` in order (the first ``limit`` of them), in lists of ``micro_batch``
    sample mappings (the last list may be shorter): the held-out reading of calibrate and evaluate."""
    batch, seen = [], 0
    for sample in reader.iter_samples(shards):
        if seen == limit:
            break
        batch.append(as_mapping(sample))
        seen += 1
        if len(batch) == micro_batch:
            yield batch
            batch = []
    if batch:
        yield batch


class Prefetcher:
    """Reads micro-batches on a background thread so the step does not wait on storage.

    Args:
        reader: the rank's cache reader.
        order: ``(shard, position)`` list (from :func:`rank_order`).
        micro_batch: samples per micro-batch.
        start: micro-batches to skip (resume position); ``stop``: micro-batch count to end at.
        depth: micro-batches read ahead.

    Iterating yields lists of sample mappings; :attr:`wait_seconds` accumulates the time the
    consumer spent blocked (what the data-wait fraction reports).
    """

    def __init__(self, reader: CacheReader, order: Sequence[tuple[int, int]], micro_batch: int,
                 start: int, stop: int, depth: int = 4):
        starts = {s: g for s, g in zip(reader.shards, np.cumsum([0] + [reader.records[s].num_samples
                                                                       for s in reader.shards]).tolist())}
        self._globals = [starts[s] + k for s, k in order]
        self._mb, self._start, self._stop = micro_batch, start, stop
        self._reader = reader
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for m in range(self._start, self._stop):
                idx = self._globals[m * self._mb:(m + 1) * self._mb]
                self._q.put([as_mapping(self._reader.sample(i)) for i in idx])
        except Exception as e:  # surfaced to the consumer, never swallowed
            self._q.put(e)
        self._q.put(None)

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            t0 = time.perf_counter()
            item = self._q.get()
            self.wait_seconds += time.perf_counter() - t0
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
