"""Train stage: Ray Train ``TorchTrainer`` + DeepSpeed ZeRO, one run per configured drafter.

The per-worker loop is :func:`training.loop.train_worker`; this module only checks the cache
against the training config (before any worker starts) and launches the trainers.
"""
from __future__ import annotations

import tempfile
from typing import Any

from pipeline.config import RunConfig
from pipeline.storage import join, read_json


def expected_fingerprint(cfg: RunConfig, target_dir: str):
    """The fingerprint a cache must carry to train this config's drafters on it."""
    from transformers import AutoConfig

    from pipeline.cache import _tokenizer, target_fingerprint

    return target_fingerprint(cfg, _tokenizer(target_dir), target_dir,
                              AutoConfig.from_pretrained(target_dir, local_files_only=True))


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
    from training.loop import train_worker

    target_dir = resolve_target_path(cfg.target.path)
    fp = expected_fingerprint(cfg, target_dir)
    reader = CacheReader(cache_url(cfg), fp)  # refuses a mismatching cache before any worker starts
    try:  # an empty or too small cache is reported here, not as a worker traceback
        split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards)
    except ValueError as e:
        raise PipelineError(f"{cache_url(cfg)}: {e}") from None
    init_ray(cfg.ray)
    results = {}
    for name in cfg.train.drafters:
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={"cfg": cfg, "drafter": name, "fingerprint": fp.to_json(), "target_dir": target_dir},
            scaling_config=ray.train.ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu),
            run_config=ray.train.RunConfig(name=f"dspark-train-{name}", storage_path=tempfile.mkdtemp(),
                                           failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures)))
        trainer.fit()
        results[name] = read_json(join(cfg.run_dir, "train", name, "result.json"))
    return {"drafters": results}
