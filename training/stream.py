"""Online and hybrid features: the rows a prefill stream carries to a training rank, and how the
rank turns them back into the micro-batches cache mode would read (docs/feature-modes.md).

The row contract (produced by ``pipeline.stages.stream``, consumed here; no Ray import in this module):

- ``epoch`` int, ``index`` int: the sample's place in the rank's epoch order
  (:func:`training.data.rank_order`); validation rows have epoch -1 and index = position.
- ``shard`` int, ``position`` int: the sample's shard and its place among the shard's kept samples
  (the cache's stored order), ``sample_id`` str (``"<source>-<row>"``, as the cache writer names it).
- ``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``features`` int16 [T * width] (the bf16 bits of
  [T, L*H]), ``width`` int, ``last_hidden`` int16 [T_sup * hidden] (bf16 bits), ``hidden`` int.
- ``produced_at`` float (seconds since the epoch, when the prefill actor finished the shard) and
  ``nbytes`` int (the row's array bytes): what the back-pressure report measures.

A rank's stream is ordered by ``(epoch, index)`` (Ray Data ``preserve_order``); :class:`StreamFeed`
checks every row against the seeded order, so a sample that arrived out of order, twice or not at all
stops the run instead of silently changing the data.

Why two stream modules: the Ray Data side that produces these rows needs ``pipeline`` (the cache
stage's actors) and lives in :mod:`pipeline.stages.stream`; this layer imports neither.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

__all__ = ["VALIDATION_DATASET", "rank_dataset_name", "sample_row", "row_sample", "StreamFeed",
           "StreamOrderError", "MemoryReader", "ConsumedLog", "max_ahead_bytes"]

VALIDATION_DATASET = "validation"
"""Ray Train dataset name of the validation samples (every rank gets all of them)."""


class StreamOrderError(RuntimeError):
    """A streamed sample is not the one the seeded order expects at that place (a bug, never data)."""


def rank_dataset_name(rank: int) -> str:
    """Ray Train dataset name of training rank ``rank``'s stream (not split: each rank owns one)."""
    return f"train_rank{rank}"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).reshape(-1).numpy()


def sample_row(input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor, last_hidden: torch.Tensor,
               *, epoch: int, index: int, shard: int, position: int, sample_id: str,
               produced_at: float) -> dict[str, Any]:
    """One stream row (module docstring) of a sample: ``input_ids`` [T], ``loss_mask`` [T],
    ``features`` bf16 [T, L*H], ``last_hidden`` bf16 [T_sup, H]."""
    feats, last = features.to(torch.bfloat16), last_hidden.to(torch.bfloat16)
    row = {"epoch": int(epoch), "index": int(index), "shard": int(shard), "position": int(position),
           "sample_id": sample_id, "input_ids": np.asarray(input_ids, dtype=np.int32),
           "loss_mask": np.asarray(loss_mask, dtype=np.uint8), "features": _bits(feats), "width": int(feats.shape[1]),
           "last_hidden": _bits(last), "hidden": int(last.shape[1]) if last.ndim == 2 else 0,
           "produced_at": float(produced_at)}
    row["nbytes"] = int(sum(row[k].nbytes for k in ("input_ids", "loss_mask", "features", "last_hidden")))
    return row


def row_sample(row: dict[str, Any]) -> dict[str, Any]:
    """The sample mapping :func:`training.blocks.collate_samples` takes (plus ``sample_id``), bit for
    bit the tensors a cache read returns."""
    ids = torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int32))
    width, hidden = int(row["width"]), int(row["hidden"])
    feats = torch.as_tensor(np.asarray(row["features"], dtype=np.int16).copy()).view(torch.bfloat16)
    last = torch.as_tensor(np.asarray(row["last_hidden"], dtype=np.int16).copy()).view(torch.bfloat16)
    return {"input_ids": ids, "loss_mask": torch.as_tensor(np.asarray(row["loss_mask"], dtype=np.uint8)),
            "features": feats.reshape(ids.shape[0], width), "last_hidden": last.reshape(-1, hidden),
            "sample_id": str(row["sample_id"])}


class StreamFeed:
    """Micro-batches of one epoch of a rank, read from its stream of rows.

    Args:
        rows: the rank's row iterator, shared by consecutive epochs (it is not restarted).
        order: the rank's ``(shard, position)`` order of this epoch (:func:`training.data.rank_order`).
        micro_batch: samples per micro-batch. start, stop: micro-batches of the epoch to begin at
            (the resume position) and to end at. epoch: the epoch number.
        timeline: a list the feed appends ``(produced_at, consumed_at, nbytes)`` to, one per row.

    Rows of earlier epochs, or before ``start`` (what a restarted worker group's stream repeats of
    what the checkpoint already consumed), are dropped unread; iterating yields lists of sample
    mappings; :attr:`wait_seconds` is the time blocked waiting for rows (the data-wait fraction).

    Raises:
        StreamOrderError: a row is not the sample the order expects next, or the stream ends early.
    """

    def __init__(self, rows: Iterator[dict[str, Any]], order: Sequence[tuple[int, int]], micro_batch: int,
                 start: int, stop: int, epoch: int, timeline: list | None = None):
        self._rows, self._order, self._mb = rows, order, micro_batch
        self._start, self._stop, self._epoch = start, stop, epoch
        self.timeline = timeline if timeline is not None else []
        self.wait_seconds = 0.0

    def _next(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            row = next(self._rows)
        except StopIteration:
            raise StreamOrderError(f"the stream ended inside epoch {self._epoch}: a sample the seeded order "
                                   "expects never arrived") from None
        finally:
            self.wait_seconds += time.perf_counter() - t0
        self.timeline.append((float(row["produced_at"]), time.time(), int(row["nbytes"])))
        return row

    def __iter__(self) -> Iterator[list[dict]]:
        want = self._start * self._mb
        end = self._stop * self._mb
        batch: list[dict] = []
        while want < end:
            row = self._next()
            if (row["epoch"], row["index"]) < (self._epoch, want):
                continue  # consumed before the checkpoint this run resumed from
            expected = (self._epoch, want, *self._order[want])
            got = (row["epoch"], row["index"], row["shard"], row["position"])
            if got != expected:
                raise StreamOrderError(f"stream row (epoch, index, shard, position) = {got}, expected {expected}")
            batch.append(row_sample(row))
            want += 1
            if len(batch) == self._mb:
                yield batch
                batch = []


def max_ahead_bytes(timeline: Sequence[tuple[float, float, int]]) -> int:
    """Largest number of row bytes produced but not yet consumed at any consumption instant.

    Args:
        timeline: ``(produced_at, consumed_at, nbytes)`` per row (seconds since the epoch, bytes).
    Returns:
        bytes: at each row's consumption time t, the bytes of every row with ``produced_at <= t <
        consumed_at`` (the stream's in-flight data: object store and the rank's prefetch buffer).
    """
    if not timeline:
        return 0
    events = sorted([(p, 0, n) for p, _, n in timeline] + [(c, 1, -n) for _, c, n in timeline])
    cur = best = 0
    for _, kind, n in events:
        if kind == 1:  # a consumption instant: measure before releasing the row
            best = max(best, cur)
        cur += n
    return int(best)


@dataclass
class _Record:
    num_samples: int


class MemoryReader:
    """The validation samples of a stream held in memory, behind the part of the
    :class:`cache_schema.CacheReader` interface :mod:`training.validation` uses (``shards``,
    ``records[s].num_samples``, ``sample(global index)``), so online validation runs the same code.

    Args:
        rows: stream rows of whole shards (any order).
    """

    def __init__(self, rows: Sequence[dict[str, Any]]):
        by_shard: dict[int, dict[int, dict[str, Any]]] = {}
        for r in rows:
            by_shard.setdefault(int(r["shard"]), {})[int(r["position"])] = r
        self.shards = sorted(by_shard)
        self.records = {s: _Record(len(by_shard[s])) for s in self.shards}
        self._rows = [by_shard[s][k] for s in self.shards for k in range(len(by_shard[s]))]

    def sample(self, index: int):
        """Global sample ``index`` as an object with the tensor attributes of a CacheSample."""
        from types import SimpleNamespace

        return SimpleNamespace(**row_sample(self._rows[index]))


class ConsumedLog:
    """What a run has trained on, in order: a count and a chained SHA-256 over the sample ids
    (``h_i = sha256(h_{i-1} + ":" + id_i)``), recorded in every checkpoint (``consumed``), so two runs
    (cache vs online, killed-and-resumed vs uninterrupted) can be compared sample for sample."""

    def __init__(self, state: dict[str, Any] | None = None):
        state = state or {}
        self.samples = int(state.get("samples", 0))
        self.sha256 = state.get("sha256", "")
        self.last = state.get("last_sample")

    def add(self, samples: Sequence[dict]) -> None:
        for s in samples:
            self.sha256 = hashlib.sha256(f"{self.sha256}:{s['sample_id']}".encode()).hexdigest()
            self.samples += 1
            self.last = s["sample_id"]

    def state(self, epoch: int, micro: int) -> dict[str, Any]:
        return {"samples": self.samples, "sha256": self.sha256, "last_sample": self.last, "epoch": epoch,
                "micro": micro}
