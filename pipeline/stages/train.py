"""Train stage: Ray Train ``TorchTrainer`` + DeepSpeed ZeRO, one run per configured drafter.

The per-worker loop is :func:`training.loop.train_worker`; this module only checks the cache
against the training config (before any worker starts) and launches the trainers.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.config import RunConfig
from storage import filesystem, join, read_json, write_json

log = logging.getLogger("pipeline.stages.train")


def train_job(cfg: RunConfig, name: str, fingerprint_json: str, target_dir: str):
    """The :class:`training.job.TrainJob` of drafter ``name`` of the run config."""
    from pipeline.stages.cache import cache_url
    from pipeline.drafters import drafter_config
    from training.job import TrainJob
    from training.losses import LossConfig

    t = cfg.train
    return TrainJob(
        drafter=name, model=drafter_config(t.drafters[name], cfg), cache_url=cache_url(cfg),
        fingerprint=fingerprint_json, target_dir=target_dir, output_url=join(cfg.run_dir, "train", name),
        loss=LossConfig(ce_weight=t.loss_ce, tv_weight=t.loss_tv, confidence_weight=t.loss_conf,
                        decay_lambda=t.decay_lambda),
        lr=t.lr, muon_lr=t.muon_lr if t.optimizer.value == "muon" else None, betas=(0.9, t.adam_beta2),
        weight_decay=t.weight_decay, warmup_ratio=t.warmup_ratio,
        grad_clip=t.grad_clip, zero_stage=t.zero_stage, bf16=t.precision == "bf16", use_gpu=t.use_gpu, seed=t.seed,
        epochs=t.epochs, max_steps=t.max_steps, global_batch_samples=t.global_batch_samples,
        micro_batch_samples=t.micro_batch_samples, heldout_shards=t.heldout_shards,
        validation_shards=t.validation_shards, validation_samples=t.validation_samples,
        validate_every_steps=t.validate_every_steps, checkpoint_every_steps=t.checkpoint_every_steps,
        storage=cfg.storage, features=t.features.value, step_delay_s=t.step_delay_s,
        preemption_check_every_steps=t.preemption_check_every_steps,
        stream_bound_bytes=t.stream_memory_bytes if t.features.value != "cache" else None,
        metrics_flush_seconds=t.metrics_flush_seconds, keep_checkpoints=t.keep_checkpoints,
        report_to=tuple(t.report_to), tracker_project=t.tracker_project, tracker_params=tracker_params(cfg, name))


def tracker_params(cfg: RunConfig, name: str) -> tuple[tuple[str, str], ...]:
    """What the experiment trackers record as a drafter run's config: the drafter's spec
    (``drafter.<key>``), the training recipe (``train.<key>``, without the drafter table), the target and
    the run_dir, flattened to strings."""
    from pipeline.config import to_dict

    d = to_dict(cfg)
    train = {k: v for k, v in d["train"].items() if k != "drafters"}
    flat = {**{f"drafter.{k}": v for k, v in d["train"]["drafters"][name].items()},
            **{f"train.{k}": v for k, v in train.items()},
            "target.path": cfg.target.path, "target.target_layer_ids": d["target"]["target_layer_ids"],
            "run_dir": cfg.run_dir, "drafter": name}
    return tuple((k, str(v)) for k, v in sorted(flat.items()))


def ray_storage(run_dir: str, name: str) -> dict[str, Any]:
    """Ray Train's storage for drafter ``name`` (``RunConfig`` keyword arguments): the run's own
    storage, ``<run_dir>/train/<name>/ray``, which every node of a cluster reaches (a temporary folder
    on the driver does not: the workers of other nodes would write their storage marker into a
    folder of their own machine).

    Ray Train keeps only its own run state there (a storage marker per run; checkpoints only for
    ``ray.train.report(checkpoint=...)``, which the workers never call): the product's checkpoints
    and resume are :mod:`training.checkpoint`'s, on ``<run_dir>/train/<name>``. Object storage
    goes through the product's fsspec filesystem (its S3 endpoint, credentials and retry policy),
    wrapped for Ray as a ``pyarrow.fs.PyFileSystem(FSSpecHandler(fs))``.

    Returns:
        ``{"storage_path": path}`` (absolute) for a local ``run_dir``, else also
        ``"storage_filesystem"``.
    """
    from fsspec.implementations.local import LocalFileSystem

    fs, path = filesystem(join(run_dir, "train", name, "ray"))
    if isinstance(fs, LocalFileSystem):
        return {"storage_path": path}
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return {"storage_path": path, "storage_filesystem": PyFileSystem(FSSpecHandler(fs))}


def attempt_worker(config: dict[str, Any]) -> None:
    """The Ray Train entry point: :func:`training.loop.train_worker`, after rank 0 has recorded this
    worker-group attempt in ``config["attempts_url"]`` (a JSON list, rewritten whole): its start time
    (Unix seconds), the step of the newest committed checkpoint it resumes from, the last step the
    previous attempt logged in ``metrics.jsonl`` (read before the loop drops the rows past the
    checkpoint) and that file's modification time (the previous attempt's last logged step), and why
    that checkpoint was written (``periodic``, or ``preemption``: on a preemption notice).
    Ray Train starts one attempt per worker group, a new one after each failure (``train.max_failures``)
    or preemption (``train.max_preemption_failures``)."""
    import ray.train

    from training.checkpoint import latest_checkpoint
    from training.loop import train_worker

    if ray.train.get_context().get_world_rank() == 0:
        job, url = config["job"], config["attempts_url"]
        found = latest_checkpoint(job.output_url)
        fs, path = filesystem(join(job.output_url, "metrics.jsonl"))
        logged, logged_at = 0, None
        if fs.exists(path):
            lines = [ln for ln in fs.cat_file(path).decode().splitlines() if ln.endswith("}")]
            logged = json.loads(lines[-1])["step"] if lines else 0
            logged_at = fs.info(path).get("mtime") or fs.info(path).get("LastModified")
            logged_at = logged_at.timestamp() if hasattr(logged_at, "timestamp") else logged_at
        try:
            attempts = read_json(url)
        except FileNotFoundError:
            attempts = []
        attempts.append({"started_at": time.time(), "resumed_step": found[1]["step"] if found else 0,
                         "resumed_reason": found[1].get("reason", "periodic") if found else None,
                         "logged_step": logged, "logged_at": logged_at})
        write_json(url, attempts)
    train_worker(config)


def fault_summary(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """What failures cost one drafter's training, from the attempts :func:`attempt_worker` recorded.

    Returns:
        ``worker_group_restarts`` (attempts after the first); ``resumed_from_steps`` (each restart's
        checkpoint step s); ``preemption_checkpoints`` (those of them written on a preemption notice,
        :func:`training.loop.preemption_notice`); ``redone_steps`` (sum over restarts of t - s, t the last step the failed
        attempt logged: the optimizer steps computed twice); ``restart_seconds`` (sum over restarts of
        the wall seconds from the failed attempt's last logged step to the new worker group's start:
        fault detection, rescheduling and start-up; the redone steps' own time comes on top).
    """
    restarts = attempts[1:]
    return {"worker_group_restarts": len(restarts), "resumed_from_steps": [a["resumed_step"] for a in restarts],
            "preemption_checkpoints": [a["resumed_step"] for a in restarts if a.get("resumed_reason") == "preemption"],
            "redone_steps": sum(max(0, a["logged_step"] - a["resumed_step"]) for a in restarts),
            "restart_seconds": round(sum(a["started_at"] - a["logged_at"] for a in restarts
                                         if a["logged_at"] is not None), 2)}


def expected_fingerprint(cfg: RunConfig, target_dir: str):
    """The fingerprint a cache must carry to train this config's drafters on it."""
    from transformers import AutoConfig

    from pipeline.stages.cache import _tokenizer, target_fingerprint

    return target_fingerprint(cfg, _tokenizer(target_dir), target_dir,
                              AutoConfig.from_pretrained(target_dir, local_files_only=True))


def _finished(job, total: int) -> dict[str, Any] | None:
    """The result of a drafter whose newest committed checkpoint is its last step, else None.

    Raises:
        CheckpointError: that checkpoint was trained as another model than the config now says
            (:func:`training.record.check_record`), before any worker starts.
    """
    from training.checkpoint import latest_checkpoint
    from training.loop import recorded_config
    from training.record import check_record

    train_url = job.output_url
    found = latest_checkpoint(train_url)
    if found is not None:
        check_record(recorded_config(found[1], found[0], job.model), job.model, drafter=job.drafter, where=found[0])
    if found is None or found[1]["step"] != total or found[1].get("total_steps") != total:
        return None
    try:
        return read_json(join(train_url, "result.json"))
    except FileNotFoundError:
        return None


def run_train(cfg: RunConfig) -> dict[str, Any]:
    """``+stage=train``: train every drafter of ``train.drafters`` on the same cache and budget.

    Each drafter's result carries ``faults`` (:func:`fault_summary`): the worker-group restarts Ray
    Train made after a lost worker or node (up to ``train.max_failures``), the steps redone from the
    last committed checkpoint and the restart seconds.

    ``train.features`` picks where the features come from: the committed cache, or (online,
    hybrid) the prefill actors streaming through Ray Data into the workers (:mod:`pipeline.stages.stream`);
    the worker, model, loss and sample order are the same in every mode.

    Raises:
        FingerprintMismatchError: the cache was built for another target/tokenizer/layers/options.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from cache_schema import CacheReader
    from pipeline.stages.cache import cache_url
    from pipeline.cluster import init_ray
    from pipeline.target_model.loader import resolve_target_path
    from pipeline.errors import PipelineError
    from pipeline.stages.stream import data_config, stream_plan
    from training.data import split_shards
    from pipeline.drafters import prepare_pretrained
    from training.checkpoint import latest_checkpoint
    from training.loop import plan_steps, total_steps

    target_dir = resolve_target_path(cfg.target.path)
    fp = expected_fingerprint(cfg, target_dir)
    mode = cfg.train.features.value
    if mode == "cache":
        reader = CacheReader(cache_url(cfg), fp)  # refuses a mismatching cache before any worker starts
        try:  # an empty or too small cache is reported here, not as a worker traceback
            split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                                 cfg.train.validation_shards)
        except ValueError as e:
            raise PipelineError(f"{cache_url(cfg)}: {e}") from None
        plan = None
    else:
        init_ray(cfg.ray)
        plan = stream_plan(cfg, target_dir, cfg.train.heldout_shards, cfg.train.validation_shards)
        split = plan.split
    jobs = {name: train_job(cfg, name, fp.to_json(), target_dir) for name in cfg.train.drafters}
    if plan is not None:
        jobs = {n: dataclasses.replace(j, shard_counts=dict(plan.counts)) for n, j in jobs.items()}
    world = cfg.train.num_workers
    first = next(iter(jobs.values()))  # every drafter has the same data, budget and schedule
    micro_per_epoch = plan_steps(split, first, world)
    total = total_steps(micro_per_epoch, first, world)
    if total == 0:
        raise PipelineError(
            f"{cache_url(cfg)}: the {len(split.train)} training shards ({sum(split.counts[s] for s in split.train)} "
            f"samples) give a rank of train.num_workers={cfg.train.num_workers} no full optimizer step of "
            f"train.global_batch_samples={cfg.train.global_batch_samples} (each rank reads whole shards): cache "
            "more rows, use a smaller cache.rows_per_shard, fewer workers or a smaller global batch")
    results = {name: _finished(job, total) for name, job in jobs.items()}
    if all(r is not None for r in results.values()):  # nothing to do: no Ray, no workers
        return {"drafters": results}
    pretrained = {name: prepare_pretrained(cfg, name, target_dir) for name, job in jobs.items()
                  if job.model.init == "pretrained" and latest_checkpoint(job.output_url) is None}
    for name, info in pretrained.items():
        log.info("train %s starts from %s (%d tensors; fresh: %s)", name, info["source"], info["tensors"],
                 info["fresh"] or "none")
    init_ray(cfg.ray)
    root = None
    if mode == "hybrid":  # the cache the stream commits: same root, fingerprint and plan checks as +stage=cache
        from cache_schema import open_cache
        from pipeline.stages.cache import resume_plan, storage_config

        root = open_cache(cache_url(cfg), fp, create=True, storage=storage_config(cfg))
        resume_plan(cfg, root)

    def fit(name: str) -> dict[str, Any]:
        datasets, dataset_config = None, None
        if plan is not None:
            datasets = _stream_datasets(cfg, jobs[name], plan, micro_per_epoch, fp, target_dir, root)
            dataset_config = data_config(cfg)
        attempts_url = join(cfg.run_dir, "train", name, "attempts", f"{time.time_ns()}.json")
        trainer = TorchTrainer(
            attempt_worker,
            train_loop_config={"job": jobs[name], "attempts_url": attempts_url},
            scaling_config=ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                                   resources_per_worker={"CPU": cfg.train.cpus_per_worker}),
            run_config=ray.train.RunConfig(name=f"dspark-train-{name}", **ray_storage(cfg.run_dir, name),
                                           failure_config=ray.train.FailureConfig(
                                               max_failures=cfg.train.max_failures,
                                               max_preemption_failures=cfg.train.max_preemption_failures)),
            **({"datasets": datasets, "dataset_config": dataset_config} if datasets is not None else {}))
        trainer.fit()
        return {**read_json(join(cfg.run_dir, "train", name, "result.json")),
                "faults": fault_summary(read_json(attempts_url))}

    todo = [n for n, r in results.items() if r is None]
    # one at a time in this (main) thread, where Ray Train's Ctrl-C handler aborts a run gracefully;
    # concurrently, each fit() blocking a thread of its own
    serial = cfg.train.concurrent_drafters == 1 or len(todo) <= 1
    with ThreadPoolExecutor(max_workers=1 if serial else cfg.train.concurrent_drafters) as pool:
        for name, result in zip(todo, map(fit, todo) if serial else pool.map(fit, todo)):
            results[name] = {**result, **({"pretrained": pretrained[name]} if name in pretrained else {})}
    if mode == "hybrid":
        from pipeline.stages.cache import cache_totals

        storage_write_summary(cfg, cache_totals(cache_url(cfg)))
    return {"drafters": results}


def _stream_datasets(cfg: RunConfig, job, plan, micro_per_epoch: list[int], fp, target_dir: str, root):
    """Ray Train datasets of one drafter's online / hybrid run, from its resume position on
    (:mod:`pipeline.stages.stream`). A hybrid run resumed after epoch 0 first completes the cache it was
    writing with the cache stage itself (committed shards kept, uncommitted ones redone)."""
    from pipeline.stages.cache import cache_url
    from pipeline.stages.stream import build_datasets, shard_items
    from training.checkpoint import latest_checkpoint

    found = latest_checkpoint(job.output_url)
    epoch, micro = (found[1]["epoch"], found[1]["micro"]) if found is not None else (0, 0)
    hybrid = cfg.train.features.value == "hybrid"
    committed = set(root.committed_records()) if root is not None else set()
    if hybrid and epoch > 0 and not set(plan.counts) <= committed:
        from pipeline.stages.cache import run_cache

        run_cache(cfg)
    items = shard_items(plan, seed=job.seed, micro_per_epoch=micro_per_epoch, micro_batch=job.micro_batch_samples,
                        world=cfg.train.num_workers, start_epoch=epoch, start_micro=micro, hybrid=hybrid,
                        committed=committed)
    return build_datasets(cfg, plan, items, root_url=cache_url(cfg), fingerprint=fp, local_dir=target_dir,
                          hybrid=hybrid)


def storage_write_summary(cfg: RunConfig, totals: dict[str, Any]) -> None:
    """``cache/summary.json`` of a cache the hybrid stream wrote (what the cache stage writes)."""
    from pipeline.stages.cache import cache_url

    write_json(join(cache_url(cfg), "summary.json"), totals)
