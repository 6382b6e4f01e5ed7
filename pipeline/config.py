"""Typed run configuration: the single source of truth that Hydra composes into.

Every YAML under ``conf/`` (and a user's own) is merged onto :class:`RunConfig`; an unknown key or a
value of the wrong type or range fails with a one-line :class:`ConfigError` naming the key, e.g.
``config error: train.lr: must be > 0 (got -1.0)``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.errors import ConfigError
from storage import RetryPolicy


class Stage(str, Enum):
    generate = "generate"
    cache = "cache"
    train = "train"
    calibrate = "calibrate"
    export = "export"
    evaluate = "evaluate"
    all = "all"


STAGE_ORDER = ("generate", "cache", "train", "calibrate", "export", "evaluate")


class SystemPromptPolicy(str, Enum):
    keep = "keep"  # render system turns as given
    drop = "drop"  # remove every system turn
    default = "default"  # keep a given one, else insert ``default_system_prompt``


class _Dtype(str, Enum):
    """A dtype key's value: one canonical spelling (``bf16``, ``fp32``, ``fp8_e4m3``), long aliases
    (``bfloat16``, ``float32``) accepted as enum aliases, so a config is normalised when it is
    loaded. ``str()``, f-strings and printed configs give the canonical name; the member's string
    content (``.value``, JSON) is what its consumers and on-disk records always had."""

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


class TargetDtype(_Dtype):
    """``target.dtype``. The value is torch's / vLLM's name: the cache fingerprint records it as
    ``target.prefill_dtype`` (unchanged, so existing caches keep their fingerprint)."""

    bf16 = "bfloat16"
    fp32 = "float32"
    bfloat16 = "bfloat16"  # alias of bf16
    float32 = "float32"  # alias of fp32


class Precision(_Dtype):
    """``train.precision``: the drafter's training precision (DeepSpeed bf16 or fp32)."""

    bf16 = "bf16"
    fp32 = "fp32"
    bfloat16 = "bf16"  # alias of bf16
    float32 = "fp32"  # alias of fp32


class FeatureDtype(_Dtype):
    """``cache.feature_dtype``: the cached features' dtype (the value is the fingerprint's spelling)."""

    bf16 = "bf16"
    fp8_e4m3 = "fp8_e4m3"
    bfloat16 = "bf16"  # alias of bf16


DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32", "fp8_e4m3": "fp8_e4m3"}
"""Every accepted dtype spelling -> its canonical one (the one place spellings are defined)."""


def canonical_dtype(name: str) -> str:
    """The canonical spelling of a dtype: ``bf16``, ``fp32`` or ``fp8_e4m3``.

    Args:
        name: any accepted spelling (see :data:`DTYPE_ALIASES`) or a dtype key's enum member.
    Raises:
        ConfigError: an unknown spelling (the message lists the accepted ones).
    """
    if isinstance(name, _Dtype):
        return name.name
    if name not in DTYPE_ALIASES:
        raise ConfigError(f"dtype: {name!r} is not a dtype; use one of {', '.join(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[name]


def torch_dtype(name: str):
    """The torch dtype of a dtype spelling (``bf16``/``bfloat16`` -> ``torch.bfloat16``, ...).

    Args:
        name: any accepted spelling or a dtype key's enum member (``cfg.target.dtype``).
    Raises:
        ConfigError: an unknown spelling.
    """
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32,
            "fp8_e4m3": torch.float8_e4m3fn}[canonical_dtype(name)]


class Engine(str, Enum):
    hf = "hf"
    vllm = "vllm"


class FeatureMode(str, Enum):
    """Where the trainer's target features come from (docs/feature-modes.md)."""

    cache = "cache"  # committed cache shards written by +stage=cache
    online = "online"  # prefill actors stream into the trainers; nothing stored but checkpoints and metrics
    hybrid = "hybrid"  # epoch 0 streams while the actors commit the cache shards; later epochs read them


class DrafterArchitecture(str, Enum):
    dflash = "dflash"  # the DFlash block-parallel backbone (DSpark with a sequential head): training.drafter
    eagle3 = "eagle3"  # one decoder layer drafting autoregressively over 3 captured layers: training.eagle3


class SequentialHead(str, Enum):
    none = "none"  # DFlash: block-parallel only
    markov = "markov"
    gated = "gated"
    rnn = "rnn"
    control = "control"  # ablation: the Markov head's parameters fed the anchor + a slot vector


class Optimizer(str, Enum):
    """The train stage's optimizer (docs/training-recipe.md)."""

    adamw = "adamw"  # AdamW on every trainable parameter (the public recipes)
    muon = "muon"  # DeepSpeed's Muon on the 2-D weights, AdamW on the rest (training.engine.DeepSpeedEngine)


class DrafterInit(str, Enum):
    random = "random"  # Qwen3 init (the public recipes)
    target = "target"  # the backbone starts as the target's next layer (training.drafter.Drafter.init_from_target)
    pretrained = "pretrained"  # a published drafter's weights (DrafterSpec.pretrained_path; pipeline.drafters)


@dataclass
class TargetConfig:
    """The frozen target LLM.

    ``path``: a local Hugging Face model directory, ``embedded:tiny`` (the built-in demo target), or
    a hub id that is already in the local Hugging Face cache (nothing is ever downloaded).
    ``target_layer_ids``: strictly ascending; id k = output of decoder layer k, -1 = embedding
    output; the final layer is refused (HF returns it after the final norm).
    """

    path: str = "embedded:tiny"
    dtype: TargetDtype = TargetDtype.fp32  # fp32 | bf16 (aliases float32 | bfloat16): the dtype the target runs in
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1, 2])


@dataclass
class RenderConfig:
    """How chats are rendered with the target's own chat template (recorded in the fingerprint)."""

    system_prompt: SystemPromptPolicy = SystemPromptPolicy.keep
    default_system_prompt: str = ""
    # passed to the template when set (Qwen3: False = no thinking); the drafter's serving mode: recorded in
    # generate settings, the cache fingerprint, checkpoints and the export (docs/reasoning.md)
    enable_thinking: Optional[bool] = None


@dataclass
class DataConfig:
    """Chat inputs: JSONL or Parquet files (local paths, any fsspec URL, or ``embedded:...``)."""

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    max_length: int = 4096  # tokens per sample after rendering; longer samples are truncated
    min_loss_tokens: int = 14  # samples with fewer supervised tokens are dropped before prefill
    render: RenderConfig = field(default_factory=RenderConfig)


@dataclass
class GenerateConfig:
    """Regeneration of assistant turns by the target (public Qwen3-4B recipe values by default)."""

    enabled: bool = True
    engine: Engine = Engine.hf
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 4096  # per answer, reasoning + answer together
    seed: int = 0
    batch_size: int = 16  # prompts per HF generate call (one padded batch); vLLM takes a shard's round at once
    max_num_seqs: Optional[int] = None  # vLLM: requests running at once (None: vLLM's default)
    rows_per_shard: int = 256
    max_rows: Optional[int] = None
    shard_delay_s: float = 0.0  # artificial pause per shard, before its write (fault tests and benchmarks)


@dataclass
class CacheConfig:
    """Target prefill into the sharded Zarr cache (docs/design.md section 4)."""

    rows_per_shard: int = 256  # input rows per shard (kept samples may be fewer)
    feature_dtype: FeatureDtype = FeatureDtype.bf16  # bf16 (alias bfloat16) | fp8_e4m3
    compression: str = "none"  # none | zstd
    max_tokens_per_batch: int = 16384  # length-aware batching cap (padded tokens per prefill batch)
    num_workers: int = 1  # prefill actors
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0  # logical CPUs of each actor: its prefill and its overlapped shard write
    storage_budget_bytes: Optional[int] = None  # refuse to start when the estimate exceeds it
    max_rows: Optional[int] = None
    shard_delay_s: float = 0.0  # artificial pause per shard, in its prefill (fault tests and benchmarks)


CONFIDENCE_CALIBRATIONS = ("realised", "expected")  # DrafterSpec.confidence_calibration


def confidence_sampling(spec: "DrafterSpec", cfg: "RunConfig") -> tuple[float, float, int]:
    """The sampling setting ``(temperature, top_p, top_k)`` a drafter's confidence head is trained and
    calibrated for: ``spec.confidence_temperature`` / ``_top_p`` / ``_top_k``, or the generate stage's
    ``temperature`` / ``top_p`` / ``top_k`` (the answers the cache holds) where the temperature is null."""
    if spec.confidence_temperature is None:
        return float(cfg.generate.temperature), float(cfg.generate.top_p), max(int(cfg.generate.top_k), 0)
    return float(spec.confidence_temperature), float(spec.confidence_top_p), int(spec.confidence_top_k)


@dataclass
class DrafterSpec:
    """One drafter to train (docs/design.md section 2). ``head=none`` with ``markov_rank=0`` is DFlash;
    ``architecture: eagle3`` is EAGLE-3 (num_layers 1, head none, markov_rank 0, confidence_head false)."""

    architecture: DrafterArchitecture = DrafterArchitecture.dflash
    num_layers: int = 5
    block_size: int = 7
    sample_from_anchor: bool = True
    mask_token_id: int = 151669
    head: SequentialHead = SequentialHead.markov
    markov_rank: int = 256
    confidence_head: bool = True  # on [h_k ; W1[x_{k-1}]] when a sequential head exists, else [h_k]
    confidence_grad_to_backbone: bool = False
    # the serving setting (temperature, top-p, top-k) the confidence head is made for: its training label
    # c* (training.losses.confidence_labels; T 0 = greedy acceptance), calibrate's on-policy refit and the
    # realised acceptance STS fits on (the run config's value at calibrate time); null (default) = the
    # generate stage's setting (generate.temperature/top_p/top_k: Qwen3's 0.7 / 0.8 / 20), which the head
    # ranks decoding rounds best at (docs/confidence.md)
    confidence_temperature: Optional[float] = None
    confidence_top_p: float = 1.0
    confidence_top_k: int = 0
    # what calibrate fits STS and the global temperature on: realised (0/1 acceptance of the drafter's
    # own drafts on held-out blocks at confidence_temperature) | expected (teacher-forced c* at T = 1)
    confidence_calibration: str = "realised"
    draft_vocab_size: Optional[int] = None
    init: DrafterInit = DrafterInit.random
    # init: pretrained: an export to fine-tune (a folder, any fsspec URL) in any format export writes (native =
    # vLLM's, z-lab dflash's and SpecForge's layout; speculators); its layout must match this spec and the cache
    pretrained_path: Optional[str] = None


@dataclass
class TrainConfig:
    """Ray Train + DeepSpeed ZeRO training of every drafter in ``drafters`` on the same cache."""

    # No default drafter: a schema default would be merged back under a YAML's drafters, so that
    # ``~train.drafters.dspark`` would silently train the Qwen3-4B-sized default instead.
    drafters: dict[str, DrafterSpec] = field(default_factory=dict)
    num_workers: int = 2
    concurrent_drafters: int = 1  # drafters trained at the same time, each by its own num_workers workers
    cpus_per_worker: int = 1  # logical CPUs (and torch threads, on CPU) of each training worker
    use_gpu: bool = False
    zero_stage: int = 2
    precision: Precision = Precision.fp32  # fp32 | bf16 (aliases float32 | bfloat16)
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 6e-4  # AdamW's peak learning rate (with Muon: of the parameters Muon leaves to AdamW)
    muon_lr: float = 0.02  # Muon's peak learning rate (spectral norm per update), train.optimizer=muon only
    adam_beta2: float = 0.999  # AdamW (0.9, beta2); torch's default
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    epochs: int = 1
    max_steps: Optional[int] = None
    global_batch_samples: int = 64
    micro_batch_samples: int = 4
    num_anchors: int = 512
    loss_ce: float = 0.1
    loss_tv: float = 0.9
    loss_conf: float = 1.0
    decay_lambda: float = 4.0
    heldout_shards: int = 1  # the last non-empty shards: calibrate and the block-level evaluation
    validation_shards: int = 0  # the shards before them: held-out learning curves during training
    validate_every_steps: int = 50
    validation_samples: int = 256  # at most this many validation samples per evaluation
    checkpoint_every_steps: int = 200
    # committed checkpoints kept, the newest ones (rank 0 deletes older ones after each commit); None = all
    keep_checkpoints: Optional[int] = None
    max_failures: int = 2  # Ray Train restarts of a failed worker group (from the last checkpoint)
    # a preemption notice (a node drained for preemption: Ray Train's get_preemption_info) is looked for
    # every this many optimizer steps (a collective); a notice writes a checkpoint at once; 0 = never
    preemption_check_every_steps: int = 1
    max_preemption_failures: int = -1  # Ray Train restarts after preemptions, apart from max_failures; -1 = any
    seed: int = 0
    # cache | online | hybrid (docs/feature-modes.md); online and hybrid prefill with the cache
    # stage's actors (cache.num_workers, cache.gpus_per_worker) while the trainers run
    features: FeatureMode = FeatureMode.cache
    stream_memory_bytes: int = 256 * 2**20  # object-store bound of the online/hybrid stream (Ray Data)
    stream_cpus_per_worker: float = 1.0  # logical CPUs of each streaming prefill actor
    step_delay_s: float = 0.0  # artificial pause per optimizer step (back-pressure tests and benchmarks)
    # live metrics: at most one rewrite of metrics.jsonl / upload of TensorBoard events per this many
    # seconds on object storage (local run_dirs append every step); always at checkpoints and the end
    metrics_flush_seconds: float = 30.0
    # where rank 0's per-step metrics go (training.trackers): jsonl (required: resume and result.json read
    # it), tensorboard, wandb (WANDB_MODE / WANDB_DIR / WANDB_API_KEY as W&B reads them), mlflow
    # (MLFLOW_TRACKING_URI; default a file store under the local run_dir); wandb/mlflow: pip install -e '.[tracking]'
    report_to: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    tracker_project: str = "dspark"  # the W&B project / MLflow experiment


@dataclass
class CalibrateConfig:
    bins: int = 15
    grid_step: float = 0.01
    # at most this many held-out samples (the first ones, in the held-out shards' stored order); None = all
    max_samples: Optional[int] = None
    # the Ray task that runs the drafters asks for these (pipeline.stages.calibrate.run_task); gpus 0 = in the driver
    gpus: float = 0
    cpus: float = 1
    # on-policy refit of the confidence head (training.confidence_refit) before STS: the drafter decodes
    # the prompts of refit_prompts held-out samples with the target (past the STS and block-level samples
    # when the held-out shards hold enough: pipeline.stages.calibrate.prompt_start), at the head's
    # confidence_temperature setting (and greedily: refit_greedy below), and the head is refitted on the
    # realised acceptance of its own drafts; adopted only if it ranks held-out prompts' slots better (AUC)
    # than the trained head. 0 = off
    refit_prompts: int = 64
    refit_max_new_tokens: int = 64
    # the refit also decodes its prompts greedily (T = 0) and fits on the rows of both settings: one
    # exported head serves greedy and sampled requests (pipeline.stages.calibrate.refit_settings; doubles
    # the refit's decoding). false = the head's serving setting only
    refit_greedy: bool = True
    # the gate rounds: the drafter, with the head calibrate keeps, decodes the prompts of the next gate_prompts
    # held-out samples (after the refit's) at the head's setting (refit_max_new_tokens each); the evaluate
    # stage fits its estimators on these on-policy rounds at that setting and enables adaptive verification
    # at a concurrency only where it gained there (pipeline.inference.realised). 0 = off (teacher-forced blocks)
    gate_prompts: int = 64


@dataclass
class ExportConfig:
    fold_temperature_tolerance: float = 0.02
    format: str = "native"  # native (vLLM, z-lab dflash, SpecForge) | speculators (pipeline.stages.export_format)
    # the model card's licence (README.md metadata of each export, pipeline.model_card), e.g. apache-2.0 for a
    # drafter of Qwen3; null: the card says it is not set
    license: Optional[str] = None


@dataclass
class SamplingConfig:
    """One evaluate sampling setting (vLLM's order: temperature, then top-k, then top-p)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # tokens kept; 0 = off


@dataclass
class PromptSetConfig:
    """One named evaluation prompt set (``evaluate.prompt_sets.<task>``): a JSONL or Parquet file in a
    public benchmark's layout (:mod:`pipeline.chats.prompt_sets`)."""

    path: str = ""
    format: str = "chat"  # mt_bench | gsm8k | humaneval | math500 | mbpp | field | chat
    field: Optional[str] = None  # the prompt's column for format field (or to override a format's own)
    max_prompts: Optional[int] = None  # the first usable rows; null = evaluate.num_prompts
    match: Optional[dict[str, str]] = None  # {field: regex}: only rows whose fields match (re.search), e.g. {category: writing}


@dataclass
class EvaluateConfig:
    # the sampling settings every evaluate table is computed at; null = T=0, T=1 and the generate
    # stage's own setting (generate.temperature / top_p / top_k): evaluate_settings()
    sampling: Optional[list[SamplingConfig]] = None
    temperatures: Optional[list[float]] = None  # deprecated: plain temperatures, same as sampling without top-p/top-k
    max_new_tokens: int = 256
    num_prompts: int = 64
    # named prompt sets, each a task of its own in every decoding-loop table (per task and macro-averaged);
    # empty: the first num_prompts rows of data.eval_files, one task per file
    prompt_sets: dict[str, PromptSetConfig] = field(default_factory=dict)
    thresholds: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.5, 0.7])
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 128, 256, 512])
    # the scheduler verifies the best fixed block where the SPS curve's speed at R tokens per step is
    # under (1 + this) x its speed at R (1 + block size) (pipeline.inference.scheduler.adaptive_can_pay);
    # null = DSpark Algorithm 1 alone at every R
    scheduler_min_speedup: Optional[float] = 0.10
    sps_table: Optional[str] = None  # JSON SPS curve; profiled on this machine when unset
    block_samples: int = 256  # held-out cache samples of the paired block-level evaluation (0 = off)
    block_anchors: int = 64  # anchors per held-out sample there (blocks = samples x anchors at most)
    block_chunk: int = 16  # blocks whose [block_size, V] float32 distributions are held at once there
    seed: int = 0
    # the Ray task that runs the target and drafters asks for these (pipeline.stages.calibrate.run_task); gpus 0 = in the driver
    gpus: float = 0
    cpus: float = 1


@dataclass
class RayConfig:
    # the cluster to join: HOST:PORT, or auto (this machine's latest `ray start`); None: $RAY_ADDRESS if set
    # (ray job submit sets it), else a private local instance, whatever else runs (pipeline.cluster.ray_address)
    address: Optional[str] = None
    num_cpus: Optional[int] = None  # CPUs of a private instance (None: the machine's); ignored when joining
    # bytes of a private instance's object store (None: Ray's default, 30% of RAM; at least 75 MiB); ignored when joining
    object_store_memory: Optional[int] = None


@dataclass
class RunConfig:
    """Everything one invocation of ``python -m pipeline.run`` needs."""

    stage: Stage = Stage.all
    dry_run: bool = False  # validate, resolve the target, print the plan and config; run nothing
    run_dir: str = "runs/default"  # any fsspec URL; every stage reads and writes under it
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    storage: RetryPolicy = field(default_factory=RetryPolicy)  # object-storage retries (storage.RetryPolicy)


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def validate(cfg: RunConfig) -> RunConfig:
    """Range and consistency checks that types alone cannot express.

    Raises:
        ConfigError: naming the first offending key.
    """
    ids = list(cfg.target.target_layer_ids)
    _check(len(ids) > 0, "target.target_layer_ids", "must list at least one layer id")
    _check(all(b > a for a, b in zip(ids, ids[1:])), "target.target_layer_ids",
           f"must be strictly ascending (got {ids})")
    _check(ids[0] >= -1, "target.target_layer_ids", f"ids start at -1 (embedding output), got {ids[0]}")
    _check(cfg.data.max_length > 1, "data.max_length", f"must be > 1 (got {cfg.data.max_length})")
    _check(cfg.data.min_loss_tokens >= 1, "data.min_loss_tokens",
           f"must be >= 1 (got {cfg.data.min_loss_tokens})")
    _check(cfg.cache.rows_per_shard >= 1, "cache.rows_per_shard", "must be >= 1")
    _check(cfg.cache.shard_delay_s >= 0, "cache.shard_delay_s", "must be >= 0 seconds")
    _check(cfg.cache.cpus_per_worker > 0, "cache.cpus_per_worker", f"must be > 0 (got {cfg.cache.cpus_per_worker})")
    gen = cfg.generate
    _check(gen.rows_per_shard >= 1, "generate.rows_per_shard", "must be >= 1")
    _check(gen.shard_delay_s >= 0, "generate.shard_delay_s", "must be >= 0 seconds")
    _check(gen.temperature >= 0, "generate.temperature", f"must be >= 0, 0 = greedy (got {gen.temperature})")
    _check(0 < gen.top_p <= 1, "generate.top_p", f"must be in (0, 1], 1 disables it (got {gen.top_p})")
    _check(gen.max_new_tokens >= 1, "generate.max_new_tokens", f"must be >= 1 (got {gen.max_new_tokens})")
    _check(gen.max_num_seqs is None or gen.max_num_seqs >= 1, "generate.max_num_seqs",
           f"must be >= 1, or null for vLLM's default (got {gen.max_num_seqs})")
    _check(cfg.cache.compression in ("none", "zstd"), "cache.compression",
           f"must be none or zstd (got {cfg.cache.compression!r})")
    _check(cfg.cache.max_tokens_per_batch >= cfg.data.max_length, "cache.max_tokens_per_batch",
           f"must be >= data.max_length ({cfg.data.max_length}) so every sample fits a batch")
    _check(cfg.train.lr > 0, "train.lr", f"must be > 0 (got {cfg.train.lr})")
    _check(cfg.train.concurrent_drafters >= 1, "train.concurrent_drafters", "must be >= 1")
    _check(cfg.train.cpus_per_worker >= 1, "train.cpus_per_worker", "must be >= 1")
    _check(0 < cfg.train.adam_beta2 < 1, "train.adam_beta2", f"must be in (0, 1) (got {cfg.train.adam_beta2})")
    _check(0 <= cfg.train.warmup_ratio < 1, "train.warmup_ratio", "must be in [0, 1)")
    _check(cfg.train.zero_stage in (0, 1, 2, 3), "train.zero_stage", "must be 0, 1, 2 or 3")
    _check(cfg.train.optimizer != Optimizer.muon or cfg.train.zero_stage > 0, "train.optimizer",
           "muon is DeepSpeed's Muon: set train.zero_stage to 1, 2 or 3 (0 is the plain-DDP cross-check)")
    per_step = cfg.train.micro_batch_samples * cfg.train.num_workers
    _check(cfg.train.global_batch_samples % per_step == 0, "train.global_batch_samples",
           f"must be a multiple of micro_batch_samples x num_workers = {per_step} "
           f"(got {cfg.train.global_batch_samples})")
    _check(len(cfg.train.drafters) > 0, "train.drafters", "must name at least one drafter")
    for name, spec in cfg.train.drafters.items():
        key = f"train.drafters.{name}"
        _check(spec.block_size >= 1, f"{key}.block_size", f"must be >= 1 (got {spec.block_size})")
        _check(spec.num_layers >= 1, f"{key}.num_layers", "must be >= 1")
        has_rank = spec.markov_rank > 0
        _check(has_rank == (spec.head != SequentialHead.none), f"{key}.markov_rank",
               f"must be > 0 exactly when head != none (head={spec.head.value}, "
               f"markov_rank={spec.markov_rank}); markov_rank=0 means DFlash")
        if spec.architecture == DrafterArchitecture.eagle3:
            fields = (("num_layers", spec.num_layers, spec.num_layers == 1),
                      ("sample_from_anchor", spec.sample_from_anchor, spec.sample_from_anchor),
                      ("markov_rank", spec.markov_rank, spec.markov_rank == 0),
                      ("confidence_head", spec.confidence_head, not spec.confidence_head),
                      ("init", spec.init.value, spec.init != DrafterInit.target))
            wrong = {k: v for k, v, ok in fields if not ok}
            _check(not wrong, f"{key}.architecture",
                   f"eagle3 is one decoder layer without heads: set num_layers: 1, sample_from_anchor: true, head: none, "
                   f"markov_rank: 0, confidence_head: false and init random or pretrained (got {wrong})")
            _check(len(cfg.target.target_layer_ids) >= 3, f"{key}.architecture",
                   "eagle3 fuses a low, middle and high captured layer: target.target_layer_ids needs >= 3 ids "
                   f"(got {list(cfg.target.target_layer_ids)})")
        t_conf = spec.confidence_temperature
        _check(t_conf is None or 0 <= t_conf < float("inf"), f"{key}.confidence_temperature",
               f"must be a finite sampling temperature >= 0 (0 = greedy), or null for the generate stage's "
               f"setting (got {t_conf})")
        _check(0 < spec.confidence_top_p <= 1, f"{key}.confidence_top_p",
               f"must be in (0, 1], 1 disables it (got {spec.confidence_top_p})")
        _check(spec.confidence_top_k >= 0, f"{key}.confidence_top_k",
               f"must be >= 0, 0 disables it (got {spec.confidence_top_k})")
        _check(spec.confidence_calibration in CONFIDENCE_CALIBRATIONS, f"{key}.confidence_calibration",
               f"must be one of {list(CONFIDENCE_CALIBRATIONS)} (got {spec.confidence_calibration!r})")
    if cfg.train.features != FeatureMode.cache:
        mode = cfg.train.features.value
        _check(cfg.train.stream_memory_bytes >= 2**16, "train.stream_memory_bytes",
               f"must be >= 64 KiB (got {cfg.train.stream_memory_bytes})")
        _check(cfg.train.stream_cpus_per_worker >= 0, "train.stream_cpus_per_worker", "must be >= 0")
        for name, spec in cfg.train.drafters.items():
            _check(spec.draft_vocab_size is None, f"train.drafters.{name}.draft_vocab_size",
                   f"a reduced draft vocabulary is counted over the cache; with train.features={mode} "
                   "leave it unset or use train.features=cache")
    _check(cfg.train.step_delay_s >= 0, "train.step_delay_s", "must be >= 0 seconds")
    _check(cfg.train.preemption_check_every_steps >= 0, "train.preemption_check_every_steps",
           "must be >= 0 (0: no preemption checkpoints)")
    _check(cfg.train.metrics_flush_seconds >= 0, "train.metrics_flush_seconds", "must be >= 0 seconds")
    _check(cfg.train.validation_shards >= 0, "train.validation_shards", "must be >= 0 (0 = no learning curve)")
    _check(cfg.train.validate_every_steps >= 1, "train.validate_every_steps", "must be >= 1")
    _check(cfg.train.validation_samples >= 1, "train.validation_samples", "must be >= 1")
    _check(cfg.train.keep_checkpoints is None or cfg.train.keep_checkpoints >= 1, "train.keep_checkpoints",
           f"must be >= 1, the newest committed checkpoints to keep, or null to keep all "
           f"(got {cfg.train.keep_checkpoints})")
    for name, spec in cfg.train.drafters.items():
        pre = spec.init == DrafterInit.pretrained
        _check(pre == bool(spec.pretrained_path), f"train.drafters.{name}.pretrained_path",
               "is required with init: pretrained (an export folder to fine-tune)" if pre
               else f"is read only with init: pretrained (init is {spec.init.value})")
        _check(not pre or spec.draft_vocab_size is None, f"train.drafters.{name}.draft_vocab_size",
               "must be null with init: pretrained (a reduced vocabulary is built from this cache, not taken "
               "from the published drafter)")
    for task, ps in cfg.evaluate.prompt_sets.items():
        _check(bool(ps.path), f"evaluate.prompt_sets.{task}.path", "is required (a JSONL or Parquet file)")
        _check(ps.max_prompts is None or ps.max_prompts >= 1, f"evaluate.prompt_sets.{task}.max_prompts",
               "must be >= 1 (or null for evaluate.num_prompts)")
        try:
            from pipeline.chats.prompt_sets import row_mapper

            row_mapper(ps.format, ps.field, ps.match)
        except ConfigError as e:
            raise ConfigError(f"evaluate.prompt_sets.{task}.{e.args[0]}") from None
    from training.trackers import TRACKERS

    report = list(cfg.train.report_to)
    _check(all(r in TRACKERS for r in report), "train.report_to", f"unknown {[r for r in report if r not in TRACKERS]}; "
           f"use some of {list(TRACKERS)}")
    _check("jsonl" in report, "train.report_to", "must keep jsonl: metrics.jsonl is the run's own record (resume "
           "and result.json read it); add tensorboard, wandb or mlflow beside it")
    _check("mlflow" not in report or "://" not in cfg.run_dir or cfg.run_dir.startswith("file://")
           or bool(os.environ.get("MLFLOW_TRACKING_URI")), "train.report_to",
           "lists mlflow with run_dir on object storage: set MLFLOW_TRACKING_URI (a tracking server or database)")
    _check(cfg.evaluate.block_samples >= 0, "evaluate.block_samples", "must be >= 0 (0 = no block-level evaluation)")
    _check(cfg.evaluate.block_anchors >= 1, "evaluate.block_anchors", "must be >= 1")
    _check(cfg.storage.max_attempts >= 1, "storage.max_attempts", "must be >= 1 (1 = no retries)")
    _check(cfg.storage.body_attempts >= 1, "storage.body_attempts", "must be >= 1 (1 = no re-reads)")
    _check(min(cfg.storage.connect_timeout_s, cfg.storage.read_timeout_s) > 0, "storage.read_timeout_s",
           "storage.connect_timeout_s and storage.read_timeout_s must be > 0 seconds")
    _check(cfg.calibrate.bins >= 2, "calibrate.bins", "must be >= 2")
    _check(0 < cfg.calibrate.grid_step < 1, "calibrate.grid_step", "must be in (0, 1)")
    _check(cfg.calibrate.max_samples is None or cfg.calibrate.max_samples >= 1, "calibrate.max_samples",
           f"must be >= 1 held-out samples, or null to use all (got {cfg.calibrate.max_samples})")
    _check(cfg.calibrate.refit_prompts == 0 or cfg.calibrate.refit_prompts >= 4, "calibrate.refit_prompts",
           f"must be 0 (no on-policy refit) or >= 4 prompts (got {cfg.calibrate.refit_prompts})")
    _check(cfg.calibrate.gate_prompts >= 0, "calibrate.gate_prompts",
           f"must be >= 0 prompts (0 = no gate rounds; got {cfg.calibrate.gate_prompts})")
    _check(cfg.calibrate.refit_max_new_tokens >= 2, "calibrate.refit_max_new_tokens", "must be >= 2 tokens")
    _check(cfg.evaluate.sampling is None or cfg.evaluate.temperatures is None, "evaluate.temperatures",
           "is the deprecated form of evaluate.sampling: set only evaluate.sampling, e.g. "
           "evaluate.sampling='[{temperature: 0.7, top_p: 0.8, top_k: 20}]'")
    _check(all(t >= 0 for t in cfg.evaluate.temperatures or []), "evaluate.temperatures", "must be >= 0")
    _check(cfg.evaluate.scheduler_min_speedup is None or cfg.evaluate.scheduler_min_speedup >= 0,
           "evaluate.scheduler_min_speedup", "must be >= 0 (a fraction, 0.10 = 10%), or null for Algorithm 1 alone")
    try:
        settings = evaluate_settings(cfg)
    except ValueError as e:
        raise ConfigError(f"evaluate.sampling: {e}") from None
    _check(len(settings) >= 1, "evaluate.sampling", "must list at least one setting (or null for the defaults)")
    return cfg


def evaluate_settings(cfg: RunConfig) -> list:
    """The evaluate stage's sampling settings, in order, duplicates dropped: ``evaluate.sampling``;
    else the deprecated ``evaluate.temperatures`` (no top-p / top-k); else T = 0, T = 1 and the
    generate stage's own setting (the cached answers' distribution).

    Returns:
        list of :class:`training.spec_sampling.Sampling`.
    Raises:
        ValueError: a temperature, top_p or top_k out of range (the message names it).
    """
    from training.spec_sampling import Sampling

    ev, gen = cfg.evaluate, cfg.generate
    if ev.sampling is not None:
        settings = [Sampling(s.temperature, s.top_p, s.top_k) for s in ev.sampling]
    elif ev.temperatures is not None:
        settings = [Sampling(t) for t in ev.temperatures]
    else:
        settings = [Sampling(0.0), Sampling(1.0), Sampling(gen.temperature, gen.top_p, max(gen.top_k, 0))]
    return list(dict.fromkeys(settings))


def to_run_config(raw: DictConfig | dict[str, Any]) -> RunConfig:
    """Merge a raw (Hydra-composed) config onto the schema and validate it.

    Raises:
        ConfigError: one line naming the unknown key or the bad value.
    """
    try:
        schema = OmegaConf.structured(RunConfig)
        raw = OmegaConf.create(raw) if isinstance(raw, dict) else raw
        raw_plain = OmegaConf.to_container(raw, resolve=True)
        raw_plain.pop("hydra", None)
        merged = OmegaConf.merge(schema, raw_plain)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"{key}: {msg}") from None
    return _absolute_paths(validate(cfg))


def _absolute_paths(cfg: RunConfig) -> RunConfig:
    """Local relative paths (run_dir, data files, SPS table, a local target folder) made absolute
    against the directory the command was started in, before any Ray worker (whose working
    directory differs) sees them. A hub id (``Qwen/Qwen3-4B``) that is not a local path stays as is."""
    from pipeline.paths import absolute

    cfg.run_dir = absolute(cfg.run_dir)
    cfg.data.train_files = [absolute(f) for f in cfg.data.train_files]
    cfg.data.eval_files = [absolute(f) for f in cfg.data.eval_files]
    for ps in cfg.evaluate.prompt_sets.values():
        ps.path = absolute(ps.path)
    for spec in cfg.train.drafters.values():
        if spec.pretrained_path:
            spec.pretrained_path = absolute(spec.pretrained_path)
    if cfg.evaluate.sps_table:
        cfg.evaluate.sps_table = absolute(cfg.evaluate.sps_table)
    if os.path.exists(os.path.expanduser(cfg.target.path)):
        cfg.target.path = absolute(cfg.target.path)
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain JSON-able dict of a config (enums as their values)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
