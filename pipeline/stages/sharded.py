"""The skeleton the sharded stages (generate, cache) share.

Both run: plan the spans (a shard = a fixed row range of one input file, numbered across files) ->
read the commit records -> refuse records whose rows differ from the plan (:func:`check_spans`) ->
the shards still to write (:func:`pending`) -> an actor pool that owns whole shards, each call
writing and committing one shard and returning metadata only (:func:`run_actor_pool`: progress bar,
per-shard storage failures gathered into one error) -> totals summed over the commit records.
What differs (the work of a shard, its record, the settings a record must match) stays in the stage.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

from cache_schema.errors import StorageUnavailableError
from pipeline.errors import PipelineError
from pipeline.chats.ingest import ShardSpan

Plan = Sequence[tuple[int, ShardSpan]]


def pending(shards: Plan, committed: Mapping[int, Any]) -> list[tuple[int, ShardSpan]]:
    """The planned shards that have no commit record, in plan order."""
    return [(i, s) for i, s in shards if i not in committed]


def check_spans(url: str, shards: Plan, recorded: Mapping[int, tuple[Any, int, int]], *, key: str,
                fix: str, error: type[PipelineError]) -> None:
    """Refuse to resume into shards committed under another plan.

    A shard's rows are a function of the input files and the stage's ``rows_per_shard`` (``max_rows``
    keeps whole spans, so it only adds or drops shards); a committed shard is reused only if it holds
    exactly the rows this run plans for it, else rows would be silently skipped or written twice.

    Args:
        url: the stage's output root (for the message). shards: ``(index, span)`` of this run's plan.
        recorded: shard index -> ``(input file, row_start, row_end)`` from its commit record, the file
            named as ``key`` says (``"source"``: its index in the input list; ``"url"``: its URL).
        fix: what the user should do, appended to the message. error: the exception class raised.

    Raises:
        error: naming the first differing shard, both row ranges and ``fix``.
    """
    for i, span in shards:
        if i not in recorded:
            continue
        file, a, b = recorded[i]
        planned = getattr(span, key)
        if (file, a, b) != (planned, span.row_start, span.row_end):
            raise error(f"{url}: committed shard {i} holds rows {a}-{b} of input file {file}, but this run plans "
                        f"rows {span.row_start}-{span.row_end} of file {planned} for it: {fix}")


def span_item(shard: int, span: ShardSpan) -> dict[str, Any]:
    """One row of the actor pool's input: the shard index and its span's fields."""
    return {"shard": shard, **asdict(span)}


def item_span(item: Mapping[str, Any]) -> ShardSpan:
    """The span of a :func:`span_item` row."""
    return ShardSpan(**{k: item[k] for k in ShardSpan.__dataclass_fields__})


@dataclass
class PoolRun:
    """What the driver saw of an actor pool: every written shard's metadata, the sums of their
    numeric fields (booleans count as 0/1), the wall seconds and what faults cost
    (:meth:`FaultLedger.summary`)."""

    metas: list[dict[str, Any]]
    totals: dict[str, float]
    seconds: float
    faults: dict[str, Any]


class FaultLedger:
    """A small actor on the driver's node that counts what faults cost an actor pool (issue #37 item 4):
    every actor start and every shard call started, with its wall time and the actor that ran it. A
    shard started more than once was redone: its first call died with its actor process or node, and
    Ray Data retried it (``max_task_retries``) on a restarted or surviving actor. On the driver's
    node it outlives any worker node; only the actors' own ``.remote`` calls reach it."""

    def __init__(self):
        self.actors, self.starts = 0, {}

    def actor_started(self) -> None:
        self.actors += 1

    def shard_started(self, shard: int, at: float, actor: str) -> None:
        self.starts.setdefault(shard, []).append((at, actor))

    def summary(self) -> dict[str, Any]:
        """``actors_started`` (first starts and restarts, as many as had started by the end: a
        replacement still loading when the last shard committed is not counted); ``actors_lost``
        (the actors whose shard calls were redone); ``redone_shards`` (sorted indices started more
        than once); ``retry_delay_seconds`` (over the redone shards, wall seconds from a shard's
        first start to its last: the work lost with the first call plus the time to detect the
        fault and reschedule)."""
        redone = sorted(s for s, t in self.starts.items() if len(t) > 1)
        return {"actors_started": self.actors, "actors_lost": len({min(self.starts[s])[1] for s in redone}),
                "redone_shards": redone,
                "retry_delay_seconds": round(sum(max(self.starts[s])[0] - min(self.starts[s])[0] for s in redone), 2)}


class _Tracked:
    """The pool's callable: ``actor(*ctor_args)`` whose start and shard calls are told to a :class:`FaultLedger`."""

    def __init__(self, actor: type, ledger, *ctor_args):
        import ray

        self.inner, self.ledger = actor(*ctor_args), ledger
        self.actor_id = ray.get_runtime_context().get_actor_id()
        ledger.actor_started.remote()

    def __call__(self, item: dict[str, Any]):
        self.ledger.shard_started.remote(int(item["shard"]), time.time(), self.actor_id)
        return self.inner(item)


def run_actor_pool(ds, actor: type, ctor_args: tuple, *, workers: int, gpus: float | None, desc: str,
                   unit: str, total: int, advance: str,
                   postfix: Callable[[dict[str, float]], dict[str, Any]], cpus: float = 1.0,
                   concurrent_calls: int = 1) -> PoolRun:
    """Map ``actor`` over ``ds`` (a Ray Dataset, one row per shard) with a pool of ``workers`` actors
    of ``cpus`` CPUs (and ``gpus`` GPUs) each; show progress; gather the shards that failed on storage.
    ``concurrent_calls`` > 1 runs that many calls of one actor at once, in threads (the actor must be
    thread-safe; the cache stage overlaps one shard's write with the next one's prefill).

    An actor lost with its process or node is restarted and its unfinished calls retried (Ray Data's
    actor-pool defaults, ``max_restarts=-1`` and ``max_task_retries=-1``; passing them is deprecated in
    Ray 2.60, and ``tests/integration/test_cluster_faults.py`` holds the behaviour); a retried shard is rewritten
    whole (deterministic, committed once), a shard committed by a lost call is kept. What that cost is counted by a
    :class:`FaultLedger` (``PoolRun.faults``).

    Each call returns one metadata dict per shard with an ``"error"`` key: empty when the shard was
    committed (or already was), else the one-line :class:`StorageUnavailableError` message of a write
    whose storage retries ran out. Every other shard is still written before the failures are raised.

    Args:
        advance: the metadata field that is one shard's progress, in ``unit`` (``total`` in all).
        postfix: the bar's postfix from the running totals of the metadata fields.

    Raises:
        StorageUnavailableError: some shards failed; the message counts them and quotes the first.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tqdm import tqdm

    strategy = ray.data.ActorPoolStrategy(size=workers, max_concurrent_calls_per_actor=concurrent_calls,
                                          enable_true_multi_threading=concurrent_calls > 1)
    ledger = ray.remote(num_cpus=0)(FaultLedger).options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)).remote()
    mapped = ds.map(_Tracked, fn_constructor_args=(actor, ledger, *ctor_args), compute=strategy, num_gpus=gpus,
                    num_cpus=cpus)
    t0, metas, failed, totals = time.perf_counter(), [], [], {}
    with tqdm(total=total, unit=unit, desc=desc, unit_scale=True) as bar:
        for meta in mapped.iter_rows():
            if meta["error"]:
                failed.append(meta)
                continue
            metas.append(meta)
            for k, v in meta.items():
                if isinstance(v, (int, float)) and k != "shard":
                    totals[k] = totals.get(k, 0) + v
            bar.update(meta[advance])
            bar.set_postfix(**postfix(totals))
    faults = ray.get(ledger.summary.remote())
    ray.kill(ledger)
    if failed:
        failed.sort(key=lambda m: m["shard"])
        raise StorageUnavailableError(
            f"{len(failed)} of {len(metas) + len(failed)} shards were not written ({len(metas)} were, and are "
            f"committed): {failed[0]['error']}")
    return PoolRun(metas, totals, time.perf_counter() - t0, faults)
