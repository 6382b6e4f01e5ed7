"""Train stage: Ray Train ``TorchTrainer`` + DeepSpeed ZeRO, one run per configured drafter.

The per-worker loop is :func:`training.loop.train_worker`; this module only checks the cache
against the training config (before any worker starts) and launches the trainers.
"""
from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.config import RunConfig
from storage import join, read_json


def train_job(cfg: RunConfig, name: str, fingerprint_json: str, target_dir: str):
    """The :class:`training.job.TrainJob` of drafter ``name`` of the run config."""
    from pipeline.cache import cache_url
    from pipeline.drafters import drafter_config
    from training.job import TrainJob
    from training.losses import LossConfig

    t = cfg.train
    return TrainJob(
        drafter=name, model=drafter_config(t.drafters[name], cfg), cache_url=cache_url(cfg),
        fingerprint=fingerprint_json, target_dir=target_dir, output_url=join(cfg.run_dir, "train", name),
        loss=LossConfig(ce_weight=t.loss_ce, tv_weight=t.loss_tv, confidence_weight=t.loss_conf,
                        decay_lambda=t.decay_lambda),
        lr=t.lr, betas=(0.9, t.adam_beta2), weight_decay=t.weight_decay, warmup_ratio=t.warmup_ratio,
        grad_clip=t.grad_clip, zero_stage=t.zero_stage, bf16=t.precision == "bf16", use_gpu=t.use_gpu, seed=t.seed,
        epochs=t.epochs, max_steps=t.max_steps, global_batch_samples=t.global_batch_samples,
        micro_batch_samples=t.micro_batch_samples, heldout_shards=t.heldout_shards,
        validation_shards=t.validation_shards, validation_samples=t.validation_samples,
        validate_every_steps=t.validate_every_steps, checkpoint_every_steps=t.checkpoint_every_steps,
        storage=cfg.storage)


def expected_fingerprint(cfg: RunConfig, target_dir: str):
    """The fingerprint a cache must carry to train this config's drafters on it."""
    from transformers import AutoConfig

    from pipeline.cache import _tokenizer, target_fingerprint

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

    Raises:
        FingerprintMismatchError: the cache was built for another target/tokenizer/layers/options.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from cache_schema import CacheReader
    from pipeline.cache import cache_url
    from pipeline.cluster import init_ray
    from pipeline.target import resolve_target_path
    from pipeline.errors import PipelineError
    from training.data import split_shards
    from training.loop import plan_steps, total_steps, train_worker

    target_dir = resolve_target_path(cfg.target.path)
    fp = expected_fingerprint(cfg, target_dir)
    reader = CacheReader(cache_url(cfg), fp)  # refuses a mismatching cache before any worker starts
    try:  # an empty or too small cache is reported here, not as a worker traceback
        split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                             cfg.train.validation_shards)
    except ValueError as e:
        raise PipelineError(f"{cache_url(cfg)}: {e}") from None
    jobs = {name: train_job(cfg, name, fp.to_json(), target_dir) for name in cfg.train.drafters}
    world = cfg.train.num_workers
    first = next(iter(jobs.values()))  # every drafter has the same data, budget and schedule
    total = total_steps(plan_steps(split, first, world), first, world)
    if total == 0:
        raise PipelineError(
            f"{cache_url(cfg)}: the {len(split.train)} training shards ({sum(split.counts[s] for s in split.train)} "
            f"samples) give a rank of train.num_workers={cfg.train.num_workers} no full optimizer step of "
            f"train.global_batch_samples={cfg.train.global_batch_samples} (each rank reads whole shards): cache "
            "more rows, use a smaller cache.rows_per_shard, fewer workers or a smaller global batch")
    results = {name: _finished(job, total) for name, job in jobs.items()}
    if all(r is not None for r in results.values()):  # nothing to do: no Ray, no workers
        return {"drafters": results}
    init_ray(cfg.ray)

    def fit(name: str) -> dict[str, Any]:
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={"job": jobs[name]},
            scaling_config=ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu),
            run_config=ray.train.RunConfig(name=f"dspark-train-{name}", storage_path=tempfile.mkdtemp(),
                                           failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures)))
        trainer.fit()
        return read_json(join(cfg.run_dir, "train", name, "result.json"))

    todo = [n for n, r in results.items() if r is None]
    with ThreadPoolExecutor(max_workers=cfg.train.concurrent_drafters) as pool:  # each fit() blocks its thread
        for name, result in zip(todo, pool.map(fit, todo)):
            results[name] = result
    return {"drafters": results}
