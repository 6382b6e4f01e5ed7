"""Training data from cache shards: held-out split, per-rank epoch order, resumable position, prefetch.

The order of samples is a pure function of (committed shards, seed, epoch, rank, world size), so a
checkpoint only needs ``(epoch, micro-steps done in the epoch)`` to resume at the exact sample: no
sample of an epoch is seen twice and none is skipped.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

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


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: the object itself when a tensor, the fields
    of a dataclass, the values of a dict, the items of a list / tuple (named tuples included), nested.
    Anything else is kept as is; a container none of whose tensors changed is returned itself."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            new = _map_tensors(v, fn)
            if new is not v:
                changed[f.name] = new
        if not changed:
            return obj
        out = copy.copy(obj)  # no __init__ / __post_init__: moving a batch re-validates nothing
        for k, v in changed.items():
            object.__setattr__(out, k, v)
        return out
    if isinstance(obj, dict):
        changed = {k: new for k, v in obj.items() if (new := _map_tensors(v, fn)) is not v}
        if not changed:
            return obj
        out = copy.copy(obj)
        out.update(changed)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (else its first buffer; the CPU when it has
    neither): where its inputs must be, since neither the module nor a DeepSpeed / DDP engine
    around it moves them."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def pin_batch(obj: Any) -> Any:
    """``obj`` (a :class:`training.blocks.DraftBatch`, :class:`training.blocks.Blocks`, or dicts /
    lists / tuples / dataclasses of tensors, nested) with every CPU tensor copied into pinned
    (page-locked) host memory, so that :func:`to_device`'s ``non_blocking`` copy to CUDA is an
    asynchronous DMA that overlaps compute. Shapes and dtypes are kept; tensors already pinned or
    not on the CPU are kept as they are.

    Raises:
        RuntimeError: from torch, when no CUDA device is available (pinned memory needs one).
    """
    return _map_tensors(obj, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` (a :class:`training.blocks.DraftBatch`, :class:`training.blocks.Blocks`, or dicts /
    lists / tuples / dataclasses of tensors, nested) with every tensor on ``device``: the one
    boundary where a batch built on the CPU meets the model (:func:`module_device`).

    Shapes and dtypes are kept (a bf16 ``features`` stays bf16; the model casts it); non-tensor
    fields are kept. A tensor already on ``device`` is returned itself (``Tensor.to`` is a no-op
    there), and a container with nothing to move is returned itself: on a CPU model the move
    changes nothing, bit for bit. Towards CUDA, CPU tensors not yet pinned are pinned first
    (:func:`pin_batch`; the prefetch thread pins the batch ahead of time) and copied with
    ``non_blocking=True`` (ordered on the current stream before the kernels that read them);
    towards the CPU the copies are blocking, so the result is safe to read at once.

    Raises:
        RuntimeError: from torch, when ``device`` is not available.
    """
    device = torch.device(device)
    to_cuda, non_blocking = device.type == "cuda", device.type != "cpu"

    def move(t: torch.Tensor) -> torch.Tensor:
        if to_cuda and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=non_blocking)

    return _map_tensors(obj, move)


READ_THREADS_PER_CPU = 2
"""Prefetch reading threads per CPU of a train worker (``train.cpus_per_worker``): a thread mostly waits
on its ranged GETs (zarr 3.1 reads a sample's ~48 chunks of 2 MiB one after the other), while the CPU
work is ~1.5 s per GB read, decoded and collated (``bench/bench_reader.py``): a rank's 0.6 GB/s takes
under one core, but ~13 GET streams at 30 ms per request, so 8 CPUs read on 16 threads."""


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int, ahead: int) -> Iterator[Any]:
    """``fn(item)`` for every item, yielded in the order of ``items``, computed by ``workers`` threads
    with at most ``ahead`` calls submitted but not yet yielded (the look-ahead that bounds memory).

    ``concurrent.futures.Executor.map`` submits every item at once (unbounded memory); Python 3.14's
    ``buffersize`` bounds it, this is that for 3.11. An exception of ``fn`` is raised here, at its item's
    place in the order; calls not yet started are cancelled when the generator is closed.

    Raises:
        ValueError: ``workers`` or ``ahead`` < 1.
    """
    if workers < 1 or ahead < 1:
        raise ValueError(f"workers={workers} and ahead={ahead} must be >= 1 (threads, calls in flight)")
    it = iter(items)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch") as pool:
        pending: collections.deque[Future] = collections.deque(pool.submit(fn, x) for x in itertools.islice(it, ahead))
        try:
            while pending:
                result = pending.popleft().result()
                pending.extend(pool.submit(fn, x) for x in itertools.islice(it, 1))
                yield result
        finally:
            for f in pending:
                f.cancel()


class Prefetcher:
    """Reads micro-batches ahead of the step, samples in parallel, so the step does not wait on storage.

    ``workers`` threads read and decode samples (:meth:`cache_schema.CacheReader.sample`: zarr's ranged
    reads and copies, the finiteness pass over the bits; I/O waits and numpy's loops release the GIL,
    so the threads overlap both: on S3, ``workers`` ranged GETs are in flight at once), at most
    ``workers * 2`` samples ahead; one background thread takes them in the rank's order, groups them
    into micro-batches and runs ``collate`` on each. The samples, micro-batches and their order are
    those of ``workers=1``, exactly: only the time differs.

    Args:
        reader: the rank's cache reader (thread-safe: :class:`cache_schema.CacheReader`).
        order: ``(shard, position)`` list (from :func:`rank_order`).
        micro_batch: samples per micro-batch.
        start: micro-batches to skip (resume position); ``stop``: micro-batch count to end at.
        depth: collated micro-batches held ready (each a micro-batch of decoded samples, plus its
            collated, pinned copy with ``collate``: about ``2 * micro_batch * 63 MB`` at 2,048 tokens of
            the Qwen3-4B recipe, 30.7 KB per token).
        collate: if given, run on the background thread over each micro-batch's sample mappings
            (e.g. :func:`training.blocks.collate_samples`, then :func:`pin_batch` for a CUDA model,
            so that the host-to-device copy overlaps compute); its exceptions reach the consumer.
        workers: sample-reading threads (the train worker passes ``READ_THREADS_PER_CPU`` per CPU of
            ``train.cpus_per_worker``).

    Iterating yields lists of sample mappings, or with ``collate`` ``(samples, collate(samples))``
    pairs; :attr:`wait_seconds` accumulates the time the consumer spent blocked (what the
    data-wait fraction reports). A read error reaches the consumer at its sample's micro-batch.

    Raises:
        ValueError: ``workers`` or ``depth`` < 1.
    """

    def __init__(self, reader: CacheReader, order: Sequence[tuple[int, int]], micro_batch: int,
                 start: int, stop: int, depth: int = 4, collate: Callable[[list[dict]], Any] | None = None,
                 workers: int = 1):
        if workers < 1 or depth < 1:
            raise ValueError(f"Prefetcher workers={workers} and depth={depth} must be >= 1")
        starts = {s: g for s, g in zip(reader.shards, np.cumsum([0] + [reader.records[s].num_samples
                                                                       for s in reader.shards]).tolist())}
        self._globals = [starts[s] + k for s, k in order]
        self._mb, self._start, self._stop = micro_batch, start, stop
        self._reader = reader
        self._collate = collate
        self.workers = workers
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self.wait_seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read(self, index: int) -> dict:
        return as_mapping(self._reader.sample(index))

    def _run(self) -> None:
        try:
            idx = self._globals[self._start * self._mb:self._stop * self._mb]
            with contextlib.closing(ordered_map(self._read, idx, self.workers, 2 * self.workers)) as samples:
                for _ in range(self._start, self._stop):
                    batch = list(itertools.islice(samples, self._mb))
                    self._q.put(batch if self._collate is None else (batch, self._collate(batch)))
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
