"""Online and hybrid features (``train.features``): the Ray Data streams that feed Ray Train workers.

Per drafter, the driver plans the cache's shards (the same ``pipeline.stages.cache.plan``), renders them
once to count their samples (the same ``render_shard``; tokens only, no prefill), splits them with
the same :func:`training.data.split_shards` and builds, for each training rank, one dataset of shard
items in the rank's seeded order (:func:`training.data.rank_order`: epoch by epoch, shard by shard,
each item naming the positions to emit). The items flat-map through the cache stage's own prefill
actor (:class:`pipeline.stages.cache.ShardPrefillWriter`, ``emit=True``), which renders, prefills and (hybrid)
commits each shard. Ray Data keeps the item order (``preserve_order``) and bounds the stream's object
store memory (``train.stream_memory_bytes``) and each actor holds one shard in flight, so a slow
trainer stalls the prefill actors instead of filling the object store.

Validation samples are prefilled by the same actors into a dataset materialised before training
(every rank reads all of it, as every rank reads the validation shards in cache mode). Held-out
shards are never streamed: hybrid commits them at the end of rank 0's epoch-0 stream (calibrate and
evaluate read them from the cache), online does not compute them.

Why two stream modules: this one holds the Ray Data side (datasets, actors), which must live above
``training``; the row contract and the order check live in :mod:`training.stream`, which imports no Ray Data.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from pipeline.config import RunConfig

__all__ = ["StreamPlan", "stream_plan", "shard_items", "build_datasets", "data_config"]


class StreamPlan:
    """The shards of an online / hybrid run: ``shards`` [(index, ShardSpan)], ``counts`` {index: samples},
    ``tokens`` {index: tokens}, and the :class:`training.data.ShardSplit` of the counts."""

    def __init__(self, shards, counts: dict[int, int], tokens: dict[int, int], split):
        self.shards, self.counts, self.tokens, self.split = shards, counts, tokens, split
        self.spans = dict(shards)


def stream_plan(cfg: RunConfig, local_dir: str, heldout_shards: int, validation_shards: int) -> StreamPlan:
    """Plan and render (count) every shard of the run, as the cache stage would, on Ray tasks.

    Raises:
        PipelineError: the inputs give too few non-empty shards for the held-out and validation split.
    """
    import ray

    from pipeline.stages.cache import plan, render_shard
    from pipeline.chats.ingest import ShardSpan
    from pipeline.errors import PipelineError
    from training.data import split_shards

    shards = plan(cfg)
    items = [{"shard": i, **asdict(s)} for i, s in shards]

    def count(it: dict[str, Any]) -> dict[str, Any]:
        r = render_shard(ShardSpan(**{k: it[k] for k in ShardSpan.__dataclass_fields__}), it["shard"], cfg, local_dir)
        return {"shard": it["shard"], "num_samples": r["num_samples"], "num_tokens": r["num_tokens"]}

    rows = ray.data.from_items(items, override_num_blocks=max(1, len(items))).map(count).take_all()
    counts = {int(r["shard"]): int(r["num_samples"]) for r in rows}
    tokens = {int(r["shard"]): int(r["num_tokens"]) for r in rows}
    try:
        split = split_shards(counts, heldout_shards, validation_shards)
    except ValueError as e:
        raise PipelineError(f"train.features={cfg.train.features.value}: {e}") from None
    return StreamPlan(shards, counts, tokens, split)


def shard_items(plan: StreamPlan, *, seed: int, micro_per_epoch: list[int], micro_batch: int, world: int,
                start_epoch: int, start_micro: int, hybrid: bool, committed: set[int]) -> list[list[dict[str, Any]]]:
    """Each rank's stream items, in the order the rank trains on them.

    Online: epochs ``start_epoch..`` (every epoch prefills again). Hybrid: epoch 0 only (later epochs
    read the cache), every training shard of the rank (a shard whose samples the budget drops is
    still written), and rank 0 ends with the held-out shards, write-only; shards
    already ``committed`` before the resume position are left out (kept), the rest redone.

    Returns:
        per rank, items ``{"shard", span fields, "epoch", "index" (the first emitted sample's place in
        the rank's epoch order), "positions" (JSON list of the shard's positions to emit, in order)}``.
    """
    from training.data import rank_order

    epochs = range(start_epoch, len(micro_per_epoch)) if not hybrid else ([0] if start_epoch == 0 else [])
    out = []
    for rank in range(world):
        items = []
        for e in epochs:
            order = rank_order(plan.split, seed=seed, epoch=e, rank=rank, world=world)
            need = micro_per_epoch[e] * micro_batch
            first = start_micro * micro_batch if e == start_epoch else 0
            i = 0
            while i < len(order):
                shard, n = order[i][0], plan.counts[order[i][0]]
                lo, hi = max(first, i), min(need, i + n)
                if hi > lo or (hybrid and shard not in committed):
                    items.append(_item(plan, shard, e, lo if hi > lo else -2, [p for _, p in order[lo:hi]]))
                i += n
        if hybrid and rank == 0 and start_epoch == 0:
            for shard in plan.split.heldout:  # the validation dataset writes the validation shards
                if shard not in committed:
                    items.append(_item(plan, shard, 0, -2, []))
        out.append(items)
    return out


def _item(plan: StreamPlan, shard: int, epoch: int, index: int, positions: list[int]) -> dict[str, Any]:
    return {"shard": int(shard), **asdict(plan.spans[shard]), "epoch": int(epoch), "index": int(index),
            "positions": json.dumps([int(p) for p in positions])}


def _prefill(ds, cfg: RunConfig, root_url: str, fingerprint, local_dir: str, write: bool):
    import ray

    from pipeline.stages.cache import ShardPrefillWriter, storage_config

    return ds.flat_map(ShardPrefillWriter, fn_constructor_args=(cfg, root_url, fingerprint, storage_config(cfg)),
                       fn_constructor_kwargs={"emit": True, "write": write, "local_dir": local_dir},
                       compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.cache.num_workers),
                                                          max_tasks_in_flight_per_actor=1),
                       num_gpus=cfg.cache.gpus_per_worker or None, num_cpus=cfg.train.stream_cpus_per_worker)


def build_datasets(cfg: RunConfig, plan: StreamPlan, items: list[list[dict[str, Any]]], *, root_url: str,
                   fingerprint, local_dir: str, hybrid: bool) -> dict[str, Any]:
    """The Ray Train ``datasets=`` of one drafter: ``train_rank<r>`` per rank with items (lazy,
    streamed while training) and ``validation`` (materialised now, when the split has validation shards).
    """
    import ray

    from training.stream import VALIDATION_DATASET, rank_dataset_name

    out = {}
    for rank, its in enumerate(items):
        if its:
            ds = _prefill(ray.data.from_items(its, override_num_blocks=len(its)), cfg, root_url, fingerprint,
                          local_dir, hybrid)
            # blocks well under the bound, so that Ray Data's budget (checked per block) and the
            # rank's one-block prefetch stay close to it
            ds.context.target_max_block_size = max(2**16, cfg.train.stream_memory_bytes // 8)
            out[rank_dataset_name(rank)] = ds
    if plan.split.validation:
        val = [_item(plan, s, -1, -1, list(range(plan.counts[s]))) for s in plan.split.validation]
        out[VALIDATION_DATASET] = _prefill(ray.data.from_items(val, override_num_blocks=len(val)), cfg, root_url,
                                           fingerprint, local_dir, hybrid).materialize()
    return out


def data_config(cfg: RunConfig):
    """Ray Train's ``DataConfig``: no dataset split (each rank owns its stream), items kept in order,
    the stream's object-store memory bounded by ``train.stream_memory_bytes``."""
    import ray.train
    from ray.data import ExecutionOptions, ExecutionResources

    opts = ExecutionOptions(preserve_order=True,
                            resource_limits=ExecutionResources(object_store_memory=cfg.train.stream_memory_bytes))
    return ray.train.DataConfig(datasets_to_split=[], execution_options=opts)
