"""What one drafter's training run is given: a typed job, built by the train stage
(:func:`pipeline.stages.train.train_job`) from the run config, so that ``training`` knows nothing of it."""
from __future__ import annotations

from dataclasses import dataclass

from storage import RetryPolicy
from training.drafter import DrafterConfig
from training.losses import LossConfig

__all__ = ["TrainJob"]


@dataclass(frozen=True)
class TrainJob:
    """One drafter's training run.

    Attributes:
        drafter: its name (messages, Ray run names). model: the drafter's full config.
        cache_url: the committed cache it trains on. fingerprint: that cache's expected
            fingerprint, as JSON (``cache_schema.Fingerprint.to_json``).
        target_dir: local folder of the target's safetensors (the frozen ``embed_tokens`` and
            ``lm_head`` the drafter shares). output_url: where checkpoints, ``metrics.jsonl``,
            TensorBoard events, ``curves.png`` and ``result.json`` go (``<run_dir>/train/<drafter>``).
        loss: the loss weights.
        lr, betas, weight_decay, warmup_ratio, grad_clip: AdamW, the warm-up + cosine schedule
            (:func:`training.engine.lr_lambda`) and the gradient-norm clip.
        muon_lr: None for AdamW alone; else DeepSpeed's Muon at this peak learning rate for the 2-D
            weights, AdamW at ``lr`` for the rest, no clip (:class:`training.engine.DeepSpeedEngine`).
        zero_stage: 0 = DDP, 1-3 = DeepSpeed ZeRO. bf16: bf16 autocast. use_gpu: CUDA workers.
        seed: initialisation, data order and anchors. epochs, max_steps: the budget.
        global_batch_samples, micro_batch_samples: samples per optimizer step and per forward.
        heldout_shards, validation_shards: shards kept out of training (:func:`training.data.split_shards`).
        validation_samples, validate_every_steps: the held-out learning curve.
        checkpoint_every_steps: committed checkpoint cadence (and the last step).
        preemption_check_every_steps: optimizer steps between looks for a preemption notice
            (``ray.train.get_preemption_info``); the first notice writes a checkpoint at once; 0 = never.
        keep_checkpoints: committed checkpoints kept after each commit, the newest ones (older ones
            deleted by rank 0: :func:`training.checkpoint.prune_checkpoints`), or None to keep all.
        storage: the object-storage retry policy of the worker's S3 clients.
        features: ``cache`` (read ``cache_url``), ``online`` (rank r reads Ray Train dataset
            ``train_rank<r>``, validation from ``validation``: :mod:`training.stream`) or ``hybrid``
            (epoch 0 as online while the stream commits the cache, later epochs from ``cache_url``).
        shard_counts: online / hybrid: samples per planned shard (rendered by the driver), the
            split and the order are computed from it exactly as from a cache's commit records.
        step_delay_s: seconds of artificial pause after every optimizer step (back-pressure tests).
        stream_bound_bytes: the stream's object-store bound (reported next to the measured peak).
        metrics_flush_seconds: on object storage, the most frequent rewrite of ``metrics.jsonl`` and
            upload of TensorBoard events while the run goes (:class:`training.metrics_log.LiveMetrics`).
        report_to: where rank 0's per-step metrics go: ``jsonl`` (always), ``tensorboard``, ``wandb``,
            ``mlflow`` (:mod:`training.trackers`). tracker_project: the W&B project / MLflow experiment.
        tracker_params: ``(key, value)`` pairs the trackers record as the run's config.
    """

    drafter: str
    model: DrafterConfig
    cache_url: str
    fingerprint: str
    target_dir: str
    output_url: str
    loss: LossConfig
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_ratio: float
    grad_clip: float
    zero_stage: int
    bf16: bool
    use_gpu: bool
    seed: int
    epochs: int
    max_steps: int | None
    global_batch_samples: int
    micro_batch_samples: int
    heldout_shards: int
    validation_shards: int
    validation_samples: int
    validate_every_steps: int
    checkpoint_every_steps: int
    storage: RetryPolicy
    features: str = "cache"
    shard_counts: dict[int, int] | None = None
    step_delay_s: float = 0.0
    preemption_check_every_steps: int = 0
    stream_bound_bytes: int | None = None
    muon_lr: float | None = None
    metrics_flush_seconds: float = 30.0
    keep_checkpoints: int | None = None
    report_to: tuple[str, ...] = ("jsonl", "tensorboard")
    tracker_project: str = "dspark"
    tracker_params: tuple[tuple[str, str], ...] = ()

    def accumulation(self, world: int) -> int:
        """Micro-steps per optimizer step on each of ``world`` ranks."""
        return self.global_batch_samples // (self.micro_batch_samples * world)
