"""Live training metrics: ``metrics.jsonl`` and TensorBoard events, readable while a run goes.

The one home of a training run's metrics output (rank 0 only; :func:`training.loop.train_worker`).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from fsspec.implementations.local import LocalFileSystem

from storage import filesystem, join, read_or_none
from training.trackers import Tracker, metric_tags, safe_log

__all__ = ["LiveMetrics"]


class LiveMetrics:
    """Rank 0's per-step metrics of one drafter's run, written as the run goes.

    What and where (``<train>`` = ``<run_dir>/train/<drafter>``, any fsspec URL):

    - ``<train>/metrics.jsonl`` (``url``): one JSON object per line per optimizer step, in step order,
      exactly the row the loop passes to :meth:`add` (``step``, ``epoch``, ``lr``, the loss metrics,
      ``tokens_per_s`` in tokens per second of all ranks together, ``data_wait_fraction`` of the
      step's wall time, and ``val_*`` on validation steps).
    - ``<train>/tensorboard/`` (``tensorboard_url``, None for none): TensorBoard event files with
      every float of a row as a scalar at ``global_step = step``: ``train/<key>``, and
      ``validation/<key>`` for ``val_<key>``. ``tensorboard --logdir <run_dir>/train`` shows every
      drafter, live for a local run_dir.
    - ``trackers`` (:mod:`training.trackers`: W&B, MLflow): every row's floats under the same tags,
      as each row is added.

    When:

    - local ``url``: each row is appended to the file as it is added (one small write per step).
    - object storage (no append): the whole object is rewritten, at most once per ``flush_seconds``
      (seconds of ``clock``; the first row is written at once), so a run of S steps makes about
      ``run time / flush_seconds`` PUTs, not S.
    - TensorBoard: the writer is flushed on the same throttle; on object storage it writes to a
      local temporary folder whose changed event files are then uploaded (same names).
    - always, and whatever the throttle, at :meth:`flush` (the loop calls it at every checkpoint)
      and :meth:`close` (end of the run).

    Resume: rows of the existing file with ``step > resumed_step`` (flushed by a killed attempt past
    its last committed checkpoint) are dropped and the file is rewritten at once, so after the rerun
    it holds each step exactly once. A trailing half-written line (a kill mid-append) is dropped too.
    TensorBoard's earlier event files stay; the new writer starts with ``purge_step = resumed_step +
    1``, so TensorBoard hides their events from that step on.

    Errors: a throttled write made by :meth:`add` that fails (storage unavailable after the storage
    retries) is reported on stderr and retried at the next due write, never stopping training; the
    rows stay in memory (``rows``). :meth:`flush` and :meth:`close` raise the storage error.
    """

    def __init__(self, url: str, resumed_step: int = 0, *, tensorboard_url: str | None = None,
                 flush_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 trackers: Sequence[Tracker] = ()):
        self.fs, self.path = filesystem(url)
        self.url, self.flush_seconds, self.clock = url, float(flush_seconds), clock
        self.append = isinstance(self.fs, LocalFileSystem)
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        self.rows, stale = self._read(resumed_step)
        self._written = len(self.rows)  # rows already in the file
        if stale:
            self._rewrite()
        self._flushed_at = -math.inf
        self._writer = self._events_fs = None
        self._uploaded: dict[str, int] = {}
        self.trackers = list(trackers)
        if tensorboard_url is not None:
            self._open_tensorboard(tensorboard_url, resumed_step)

    def _read(self, resumed_step: int) -> tuple[list[dict[str, Any]], bool]:
        """The existing rows up to ``resumed_step``, and whether the file held anything else."""
        data = read_or_none(self.fs, self.path)
        if data is None:
            return [], False
        lines = data.decode().splitlines()
        partial = bool(data) and not data.endswith(b"\n")
        if partial:
            lines.pop()  # half-written by a killed attempt
        rows = [json.loads(x) for x in lines if x]
        kept = [r for r in rows if r["step"] <= resumed_step]
        return kept, partial or len(kept) != len(rows)

    def _open_tensorboard(self, url: str, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        fs, path = filesystem(url)
        if isinstance(fs, LocalFileSystem):
            log_dir = path  # written in place: nothing to upload
        else:
            self._events_fs, self._events_root = fs, path
            log_dir = tempfile.mkdtemp(prefix="dspark-tb-")
        self._writer = SummaryWriter(log_dir, purge_step=resumed_step + 1)

    def add(self, row: dict[str, Any]) -> None:
        """Record one optimizer step's row (it must carry ``step``); write it if due (see the class)."""
        self.rows.append(row)
        tags = metric_tags(row)
        if self._writer is not None:
            for tag, v in tags.items():
                self._writer.add_scalar(tag, v, row["step"])
        safe_log(self.trackers, tags, row["step"])
        now = self.clock()
        due = now - self._flushed_at >= self.flush_seconds
        if not (due or self.append):
            return
        try:
            if due:
                self._flushed_at = now  # a failed write waits for the next period too
                self.flush()
            else:
                self._write_rows()
        except Exception as e:  # noqa: BLE001 - storage errors of any backend; a live view never stops training
            print(f"warning: metrics of step {row['step']} not yet written to {self.url} ({type(e).__name__}: "
                  f"{e}); retrying at the next write", file=sys.stderr, flush=True)

    def flush(self) -> None:
        """Write every row and TensorBoard event added so far, now.

        Raises:
            OSError (or the backend's error): the storage refused a write.
        """
        self._write_rows()
        if self._writer is not None:
            self._writer.flush()
            self._upload_events()

    def close(self) -> None:
        """Write everything (as :meth:`flush`), close the TensorBoard writer and the trackers (a tracker
        that fails to close is reported on stderr); ``rows`` stay readable."""
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - a tracker never fails the run
                print(f"warning: {type(t).__name__} did not close ({type(e).__name__}: {e})", file=sys.stderr)
        self.trackers = []
        self._write_rows()
        if self._writer is not None:
            self._writer.close()
            self._upload_events()
            if self._events_fs is not None:
                shutil.rmtree(self._writer.log_dir, ignore_errors=True)
            self._writer = None

    def _write_rows(self) -> None:
        if self._written == len(self.rows):
            return
        if not self.append or self._written < 0:
            self._rewrite()
            return
        n = len(self.rows)
        try:
            with self.fs.open(self.path, "ab") as f:
                f.write(_lines(self.rows[self._written:n]))
        except Exception:
            self._written = -1  # the file may end in a partial line: rewrite it whole next time
            raise
        self._written = n

    def _rewrite(self) -> None:
        n = len(self.rows)
        self.fs.pipe_file(self.path, _lines(self.rows))
        self._written = n

    def _upload_events(self) -> None:
        """Object storage: upload the event files that grew since their last upload."""
        if self._events_fs is None:
            return
        for p in sorted(Path(self._writer.log_dir).rglob("*")):
            if not p.is_file():
                continue
            rel, size = p.relative_to(self._writer.log_dir).as_posix(), p.stat().st_size
            if self._uploaded.get(rel) == size:
                continue
            dest = join(self._events_root, rel)
            self._events_fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            self._events_fs.put_file(str(p), dest)
            self._uploaded[rel] = size


def _lines(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
