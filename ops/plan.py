"""``plan``: a roofline projection of the pipeline's stages on a cluster, from the model shapes (CPU only).

For each stage (``generate``, ``cache``, ``train``; ``evaluate`` is left out: it is a fixed, small
number of prompts, not a per-token cost of the corpus) this counts, per token and from the shapes
alone (the target's ``config.json`` and the run's config; no weights, no torch forward):

- FLOPs: ``2 N`` per token forward, ``6 N`` forward + backward (Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", sec. 2.1 / Table 1), plus the attention term
  ``4 * layers * q_dim * keys`` (``Q K^T`` and ``P V``; Kaplan's Table 1 counts the first,
  ``2 n_layer n_ctx d_attn``, and ``P V`` costs the same);
- bytes per resource: HBM, the host<->device link (PCIe), the node's network / storage link;
- object-storage requests (S3 PUT and GET/HEAD/LIST), from the cache layout's object sizes.

and turns them into seconds per 1e9 tokens on a :class:`Cluster`: each resource's time is its
work over its throughput (compute at the stage's MFU), the stage's time is the largest of them and
``bound`` names that resource (the roofline model: Williams, Waterman & Patterson 2009, "Roofline:
an insightful visual performance model", CACM 52(4)). Every stage is assumed to run on all the
cluster's GPUs, on full-length samples (``data.max_length`` tokens), each token kept: these are
upper bounds of the work, not measurements.

The cache's bytes per token come from the cache contract (:func:`cache_schema.estimate_cache_bytes`)
and its objects and requests from the request model of :mod:`ops.estimate` (``shard_objects``,
``sample_read_requests``, measured on S3 by ``bench/bench_scale.py --cost``), so one formula holds
the layout. The supervised fraction (the share of positions with a ``last_hidden`` row, i.e. of
supervised next tokens) is a parameter, default 1.0: an upper bound of the cache bytes and of the
training slots; a chat corpus whose prompts take a third of the tokens has about 0.67.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cache_schema import StorageConfig, estimate_cache_bytes
from ops.estimate import OPEN_PER_SHARD, WRITE_EXTRA_PER_SHARD, sample_read_requests, shard_objects
from ops.report import key_values, table
from pipeline.inference.roofline import ModelShape

STAGES = ("generate", "cache", "train")
RESOURCES = ("compute", "hbm", "pcie", "network", "s3_put", "s3_get")
BYTE_RESOURCES = ("hbm", "pcie", "network")
REQUEST_RESOURCES = ("s3_put", "s3_get")

# ---- constants counted from the code (not assumptions) -------------------------------------------
LOSS_CHUNK_SLOTS = 512  # training.losses.LossConfig.chunk_size: slots per checkpointed loss chunk
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization: the share of HBM it takes
PREFILL_H2D_BYTES = 8 + 8  # int64 input_ids + int64 attention_mask per token (TargetPrefill.__call__)
TRAIN_H2D_ID_BYTES = 8 + 1  # int64 input_ids + bool loss_mask per token (training.blocks.collate_samples)
ADAMW_BYTES_PER_PARAM = 30  # one AdamW step: fp32 master, m, v read + written (24), fp32 grad read (4), bf16 write (2)
ATTENTION_BWD_FACTOR = 2.5  # FlashAttention-2 backward: 5 matmuls (QK^T recomputed, dV, dP, dQ, dK) vs 2 forward
#   (Dao 2023, "FlashAttention-2", Algorithm 2), so forward + backward = 3.5 x forward.

# ---- estimates (documented assumptions of the byte counts, not of the hardware) --------------------
ATTN_QUERY_TILE = 128  # query rows per FlashAttention tile on Hopper: K/V are re-read once per tile of queries
LOSS_VOCAB_BYTES = 240  # HBM bytes per (slot, vocabulary entry) of one training step's loss chunk: the
#   unfused fp32 [slots, V] passes of training.losses._chunk_terms, counted op by op: forward ~92 (two bf16
#   logit matmul outputs cast to fp32, the Markov bias add, log_softmax, the target softmax, exp, minus,
#   abs, sum), its checkpoint recompute ~92 again, backward ~60-75 (the casts, exp, log_softmax and CE
#   gradients); rounded to 240. An estimate: a fused loss kernel would need a small fraction of it.

# ---- hardware figures and assumptions of the presets ------------------------------------------------
H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity, 989 dense
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 SXM datasheet: HBM3e 4.8 TB/s
H200_HBM_BYTES = 141e9  # NVIDIA H200 SXM datasheet: 141 GB HBM3e
PCIE5_X16_BYTES_PER_S = 55e9  # assumption: PCIe Gen5 x16 is 64 GB/s per direction raw, ~55e9 effective
NODE_NETWORK_BYTES_PER_S = 50e9  # assumption: one 400 Gb/s storage/front-end NIC per node = 50e9 B/s
S3_GET_PER_S = 5500  # AWS S3 docs ("Best practices design patterns: optimizing Amazon S3 performance"):
S3_PUT_PER_S = 3500  # at least 5,500 GET/HEAD and 3,500 PUT/COPY/POST/DELETE per second per prefix
# MFU assumptions (model FLOPs utilisation, the share of peak dense bf16 the stage's counted FLOPs reach):
MFU_PREFILL = 0.5  # assumption: large-batch forward-only prefill; PaLM trains at 46.2% MFU (Chowdhery et al. 2022,
#   Table 3) with a backward pass and an optimizer, a well-batched forward reaches about half of peak
MFU_DECODE = 0.5  # assumption: the compute ceiling of decode; decode is memory-bound at any realistic batch
MFU_TRAIN = 0.35  # assumption: a ~0.6B-parameter drafter whose FLOPs are half in vocabulary-wide loss matmuls
#   and flex attention: below the 40-46% of large dense training (PaLM 46.2%, Megatron-LM 40-50%)
MBU = 0.6  # assumption: achieved share of peak HBM bandwidth (model bandwidth utilisation, as defined in
#   Databricks 2023, "LLM Inference Performance Engineering: Best Practices", which reports figures near 0.6)


def _dtype_bytes(name: Any) -> int:
    """Bytes per element of a dtype name or enum (``bf16``/``bfloat16``: 2, ``fp32``/``float32``: 4)."""
    value = str(getattr(name, "value", name)).lower()
    sizes = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
    if value not in sizes:
        raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(sizes)}")
    return sizes[value]


def _check_positive(where: str, **values: float) -> None:
    bad = {k: v for k, v in values.items() if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))}
    if bad:
        raise ValueError(f"{where}: need positive finite values, got {bad}")


# ---- the cluster ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    """A cluster's throughputs (the roofline's ceilings) and the utilisation assumed of each stage.

    Attributes:
        name: preset name (``8xH200``). gpu: GPU model. gpus: GPU count (>= 1).
        gpus_per_node: GPUs per node (>= 1); nodes = ceil(gpus / gpus_per_node).
        peak_flops: peak dense bf16 FLOP/s per GPU. hbm_bytes_per_s: HBM bandwidth per GPU (B/s).
        hbm_bytes: HBM capacity per GPU (bytes; sizes the decode batch that fits its KV cache).
        h2d_bytes_per_s: host<->device bandwidth per GPU (B/s, per direction).
        network_bytes_per_s: network / object-storage throughput per node (B/s).
        s3_get_per_s, s3_put_per_s: object-storage request rates per prefix (requests/s).
        s3_prefixes: prefixes the requests spread over (default 1: a new bucket before S3 has
            partitioned it; S3 scales per prefix, so more prefixes divide the request time).
        mfu_generate, mfu_cache, mfu_train: MFU assumed of each stage (0 < mfu <= 1).
        mbu: achieved share of peak HBM bandwidth (0 < mbu <= 1).
    Raises:
        ValueError: a non-positive count or rate, or a utilisation outside (0, 1].
    """

    name: str
    gpu: str
    gpus: int
    gpus_per_node: int
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    h2d_bytes_per_s: float
    network_bytes_per_s: float
    s3_get_per_s: float = S3_GET_PER_S
    s3_put_per_s: float = S3_PUT_PER_S
    s3_prefixes: int = 1
    mfu_generate: float = MFU_DECODE
    mfu_cache: float = MFU_PREFILL
    mfu_train: float = MFU_TRAIN
    mbu: float = MBU

    def __post_init__(self) -> None:
        _check_positive(f"cluster {self.name}", gpus=self.gpus, gpus_per_node=self.gpus_per_node,
                        peak_flops=self.peak_flops, hbm_bytes_per_s=self.hbm_bytes_per_s, hbm_bytes=self.hbm_bytes,
                        h2d_bytes_per_s=self.h2d_bytes_per_s, network_bytes_per_s=self.network_bytes_per_s,
                        s3_get_per_s=self.s3_get_per_s, s3_put_per_s=self.s3_put_per_s,
                        s3_prefixes=self.s3_prefixes)
        for k in ("gpus", "gpus_per_node", "s3_prefixes"):
            if int(getattr(self, k)) != getattr(self, k):
                raise ValueError(f"cluster {self.name}: {k} must be an integer, got {getattr(self, k)}")
        for k in ("mfu_generate", "mfu_cache", "mfu_train", "mbu"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"cluster {self.name}: {k} must be in (0, 1], got {getattr(self, k)}")

    @property
    def nodes(self) -> int:
        """Nodes: ``ceil(gpus / gpus_per_node)``."""
        return math.ceil(self.gpus / self.gpus_per_node)

    def mfu(self, stage: str) -> float:
        """The MFU assumed of ``stage`` (one of :data:`STAGES`). Raises: ValueError for another stage."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}: expected one of {STAGES}")
        return getattr(self, f"mfu_{stage}")

    def throughput(self, stage: str) -> dict[str, float]:
        """Cluster-wide ceilings of ``stage`` per resource: FLOP/s (at the stage's MFU), B/s (HBM at
        the MBU, PCIe summed over GPUs, network over nodes) and requests/s (S3, over the prefixes)."""
        return {"compute": self.gpus * self.peak_flops * self.mfu(stage),
                "hbm": self.gpus * self.hbm_bytes_per_s * self.mbu,
                "pcie": self.gpus * self.h2d_bytes_per_s,
                "network": self.nodes * self.network_bytes_per_s,
                "s3_put": self.s3_prefixes * self.s3_put_per_s,
                "s3_get": self.s3_prefixes * self.s3_get_per_s}


H200_8 = Cluster(name="8xH200", gpu="H200 SXM", gpus=8, gpus_per_node=8, peak_flops=H200_BF16_DENSE_FLOPS,
                 hbm_bytes_per_s=H200_HBM_BYTES_PER_S, hbm_bytes=H200_HBM_BYTES,
                 h2d_bytes_per_s=PCIE5_X16_BYTES_PER_S, network_bytes_per_s=NODE_NETWORK_BYTES_PER_S)
"""One node of 8 x H200 SXM (figures and assumptions: the module constants)."""
H200_64 = replace(H200_8, name="64xH200", gpus=64)
"""Eight such nodes (64 GPUs)."""
CLUSTERS: dict[str, Cluster] = {c.name: c for c in (H200_8, H200_64)}


# ---- the shapes ---------------------------------------------------------------------------------------
# The target's shapes are :class:`pipeline.inference.roofline.ModelShape` (from its ``config.json``):
# parameter counts, ``q_dim`` / ``kv_dim``, KV bytes per token, ``bytes_per_param`` (the target's dtype).

@dataclass(frozen=True)
class DrafterRecipe:
    """One drafter of ``train.drafters`` (:class:`training.drafter.DrafterConfig`'s shape fields): its training
    recipe (block, head kind, draft vocabulary), not :class:`pipeline.inference.roofline.DrafterShape`'s
    inference-cost shape (a backbone :class:`ModelShape` and fused features).

    Attributes:
        name, num_layers, block_size gamma, sample_from_anchor (slots S = gamma, else gamma + 1),
        markov_rank r (0 = no sequential head), head (``markov``/``gated``/``rnn``/``control``),
        confidence_head, draft_vocab_size (None = the target's vocabulary).
    Raises:
        ValueError: a non-positive layer count or block size, a negative rank, an unknown head.
    """

    name: str
    num_layers: int
    block_size: int
    sample_from_anchor: bool = True
    markov_rank: int = 256
    head: str = "markov"
    confidence_head: bool = True
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        _check_positive(f"drafter {self.name}", num_layers=self.num_layers, block_size=self.block_size)
        if self.markov_rank < 0 or self.head not in ("markov", "gated", "rnn", "control"):
            raise ValueError(f"drafter {self.name}: markov_rank must be >= 0 and head one of markov, gated, rnn, "
                             f"control; got {self.markov_rank}, {self.head!r}")

    @property
    def slots(self) -> int:
        """Slots per block through the backbone: gamma (DSpark layout) or gamma + 1 (DFlash)."""
        return self.block_size if self.sample_from_anchor else self.block_size + 1


@dataclass(frozen=True)
class Recipe:
    """What the projection reads of a run: the shapes and the run's sizes.

    Attributes:
        target: the target's shapes (:class:`ModelShape`). captured_layers: L, ``len(target.target_layer_ids)``.
        drafters: the drafters trained. num_anchors: ``train.num_anchors`` per sample.
        max_length: ``data.max_length``, the tokens T of every sample (an upper bound).
        max_new_tokens: ``generate.max_new_tokens``. prompt_tokens: mean prompt tokens before an
            answer (not in the config; default 0). generate_batch: ``generate.batch_size`` (decode concurrency).
        cache_rows_per_shard: ``cache.rows_per_shard``. cache_batch_tokens: ``cache.max_tokens_per_batch``.
        feature_dtype: ``cache.feature_dtype``. storage: the cache's :class:`cache_schema.StorageConfig`.
        micro_batch_samples, global_batch_samples, epochs: ``train.*``.
        train_dtype_bytes: bytes per drafter weight (``train.precision``).
        supervised_fraction: share of positions with a supervised next token, in [0, 1] (default 1.0,
            an upper bound).
    Raises:
        ValueError: a size out of range.
    """

    target: ModelShape
    captured_layers: int
    drafters: tuple[DrafterRecipe, ...]
    num_anchors: int
    max_length: int
    max_new_tokens: int
    generate_batch: int
    cache_rows_per_shard: int
    cache_batch_tokens: int
    feature_dtype: str = "bf16"
    storage: StorageConfig = StorageConfig()
    micro_batch_samples: int = 4
    global_batch_samples: int = 64
    epochs: int = 1
    train_dtype_bytes: int = 2
    prompt_tokens: int = 0
    supervised_fraction: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("recipe", captured_layers=self.captured_layers, num_anchors=self.num_anchors,
                        max_length=self.max_length, max_new_tokens=self.max_new_tokens,
                        generate_batch=self.generate_batch, cache_rows_per_shard=self.cache_rows_per_shard,
                        cache_batch_tokens=self.cache_batch_tokens, micro_batch_samples=self.micro_batch_samples,
                        global_batch_samples=self.global_batch_samples, epochs=self.epochs,
                        train_dtype_bytes=self.train_dtype_bytes)
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if not 0.0 <= self.supervised_fraction <= 1.0:
            raise ValueError(f"supervised_fraction must be in [0, 1], got {self.supervised_fraction}")

    @classmethod
    def from_config(cls, cfg: Any, target_config: Mapping[str, Any], *, supervised_fraction: float = 1.0,
                    prompt_tokens: int = 0) -> Recipe:
        """From a :class:`pipeline.config.RunConfig` (or any object with its attributes) and the
        target's ``config.json`` dict.

        Raises:
            ValueError: unusable target config or sizes (:class:`ModelShape`, :class:`Recipe`).
        """
        # a Qwen3-family target: its q/k norms are counted whatever ``model_type`` says
        target = replace(ModelShape.from_config(target_config, bytes_per_param=_dtype_bytes(cfg.target.dtype)),
                         qk_norm=True)
        drafters = tuple(DrafterRecipe(name=name, num_layers=int(s.num_layers), block_size=int(s.block_size),
                                      sample_from_anchor=bool(s.sample_from_anchor), markov_rank=int(s.markov_rank),
                                      head=str(getattr(s.head, "value", s.head)),
                                      confidence_head=bool(s.confidence_head), draft_vocab_size=s.draft_vocab_size)
                         for name, s in cfg.train.drafters.items())
        t = cfg.train
        return cls(target=target, captured_layers=len(cfg.target.target_layer_ids), drafters=drafters,
                   num_anchors=int(t.num_anchors), max_length=int(cfg.data.max_length),
                   max_new_tokens=int(cfg.generate.max_new_tokens), generate_batch=int(cfg.generate.batch_size),
                   cache_rows_per_shard=int(cfg.cache.rows_per_shard),
                   cache_batch_tokens=int(cfg.cache.max_tokens_per_batch),
                   feature_dtype=str(getattr(cfg.cache.feature_dtype, "value", cfg.cache.feature_dtype)),
                   # as pipeline.stages.cache.storage_config: the default sizes, zstd level 3 when compressed
                   storage=StorageConfig(zstd_level=3 if cfg.cache.compression == "zstd" else None),
                   micro_batch_samples=int(t.micro_batch_samples), global_batch_samples=int(t.global_batch_samples),
                   epochs=int(t.epochs), train_dtype_bytes=_dtype_bytes(t.precision), prompt_tokens=prompt_tokens,
                   supervised_fraction=supervised_fraction)


def drafter_params(recipe: Recipe, drafter: DrafterRecipe) -> dict[str, int]:
    """Trainable parameters of a drafter by part, counted as :class:`training.drafter.Drafter` builds them:
    ``layers`` (``num_layers`` Qwen3 decoder layers of the target's shape), ``fc`` (``L H H``, no bias),
    ``norms`` (hidden_norm and norm, ``2 H``), ``markov_w1`` (``V r``, an embedding: no FLOPs),
    ``markov_w2`` (``V_draft r``), ``head_extra`` (gated: ``(H + r) r + r``; rnn: ``(2r + H) 3r + 3r``;
    control: ``gamma r``, a lookup), ``confidence`` (``H + r + 1``), and ``total``. The frozen
    ``embed_tokens`` / ``lm_head`` are not counted (no gradient, no optimizer state)."""
    t, r = recipe.target, drafter.markov_rank
    H, V = t.hidden_size, t.vocab_size
    Vd = drafter.draft_vocab_size or V
    head = drafter.head if r else "none"
    extra = {"gated": (H + r) * r + r, "rnn": (2 * r + H) * 3 * r + 3 * r,
             "control": drafter.block_size * r}.get(head, 0)
    parts = {"layers": drafter.num_layers * t.layer_params, "fc": recipe.captured_layers * H * H, "norms": 2 * H,
             "markov_w1": V * r, "markov_w2": Vd * r, "head_extra": extra,
             "confidence": (H + r + 1) if drafter.confidence_head else 0}
    parts["total"] = sum(parts.values())
    return parts


# ---- per-token counts of each stage -----------------------------------------------------------------------

def cache_bytes_per_token(recipe: Recipe) -> float:
    """Stored cache bytes per token (B/token): :func:`cache_schema.estimate_cache_bytes` at the recipe's
    hidden size, captured layers, feature dtype and supervised fraction (bf16: ``2 L H + f 2 H + 4 + 1``;
    the Qwen3-4B recipe at f = 1: 30,725).

    Raises:
        ValueError: from the cache contract (unknown feature dtype).
    """
    return estimate_cache_bytes(1, hidden_size=recipe.target.hidden_size, num_target_layers=recipe.captured_layers,
                                feature_dtype=recipe.feature_dtype,
                                supervised_fraction=recipe.supervised_fraction).bytes_per_token


def decode_batch(recipe: Recipe, cluster: Cluster) -> int:
    """Sequences decoded together per GPU: ``generate.batch_size``, capped by the KV cache that fits
    vLLM's share of HBM at the mean context (vLLM pages KV by tokens in use):
    ``floor((0.9 HBM - weight bytes) / (kv_bytes_per_token * mean context))``, at least 1."""
    t = recipe.target
    weights = t.param_count * t.bytes_per_param
    kv_room = VLLM_GPU_MEMORY_UTILIZATION * cluster.hbm_bytes - weights
    fits = math.floor(kv_room / (t.kv_bytes_per_token * _decode_context(recipe)))
    return max(1, min(recipe.generate_batch, fits))


def _decode_context(recipe: Recipe) -> float:
    return recipe.prompt_tokens + recipe.max_new_tokens / 2


def generate_per_token(recipe: Recipe, cluster: Cluster) -> dict[str, Any]:
    """Decode cost per generated token (the roofline of a decode step over a batch of B sequences).

    FLOPs/token = ``2 (N + V H)`` (Kaplan et al. 2020: 2 FLOPs per parameter per token, N the
    non-embedding parameters, ``V H`` the ``lm_head``) + ``4 layers q_dim c`` (attention over the mean
    context ``c = prompt_tokens + max_new_tokens / 2``).
    HBM bytes/token = weight bytes / B (every step reads the weights once for the whole batch;
    B = :func:`decode_batch`) + ``kv_bytes_per_token * c`` (the KV cache read at the mean context) +
    ``kv_bytes_per_token`` (the new token's KV written). Prompt prefill is left out (compute-bound,
    at most ``2 N`` per prompt token); the output text is a few bytes per token (no storage term).

    Returns:
        ``{"flops": FLOP/token, "bytes": {"hbm": B/token}, "requests": {}, "detail": {...}}``.
    """
    t = recipe.target
    c, B = _decode_context(recipe), decode_batch(recipe, cluster)
    weights = t.weight_bytes  # (N + V H) x bytes: every parameter but an untied input embedding
    flops = 2 * (t.non_embedding_params + t.vocab_size * t.hidden_size) + 4 * t.num_layers * t.q_dim * c
    hbm = weights / B + t.kv_bytes_per_token * (c + 1)
    return {"flops": flops, "bytes": {"hbm": hbm}, "requests": {},
            "detail": {"batch": B, "mean_context": c, "weight_bytes_read_per_step": weights,
                       "kv_bytes_per_token_of_context": t.kv_bytes_per_token}}


def cache_per_token(recipe: Recipe) -> dict[str, Any]:
    """Prefill (the cache stage) cost per token.

    FLOPs/token = ``2 N`` (Kaplan et al. 2020; only the base model runs, never the ``lm_head``:
    :class:`pipeline.target_model.prefill.TargetPrefill`) + ``4 layers q_dim (T + 1) / 2`` (causal
    attention: a token sees ``(T + 1) / 2`` keys on average, T = ``data.max_length``).
    HBM bytes/token (a lower bound: activations are not counted) = weight bytes /
    ``cache.max_tokens_per_batch`` + K/V re-read once per :data:`ATTN_QUERY_TILE` queries at the mean
    context + the captured ``(L + 1) H`` bf16 outputs written by the concatenation and read by the copy.
    PCIe bytes/token = ``2 (L + 1) H`` (features and the final hidden state of every position are
    copied to the host in bf16) + 16 (int64 ids and attention mask to the device); counted as one
    direction's sum, conservatively. Network bytes/token = :func:`cache_bytes_per_token` (written to storage).
    S3 PUT/token = objects of one shard group (:func:`ops.estimate.shard_objects`, at
    ``cache.rows_per_shard`` full-length samples) / its tokens; GET-class/token = the writer's other
    requests (:data:`ops.estimate.WRITE_EXTRA_PER_SHARD`) / its tokens.

    Returns:
        ``{"flops", "bytes": {"hbm", "pcie", "network"}, "requests": {"s3_put", "s3_get"}, "detail"}``.
    """
    t, L, T = recipe.target, recipe.captured_layers, recipe.max_length
    H, f = t.hidden_size, recipe.supervised_fraction
    keys = (T + 1) / 2
    flops = 2 * t.non_embedding_params + 4 * t.num_layers * t.q_dim * keys
    captured = (L + 1) * H * 2
    hbm = (t.non_embedding_params * t.bytes_per_param / recipe.cache_batch_tokens
           + t.kv_bytes_per_token * keys / ATTN_QUERY_TILE + 2 * captured)
    rows, tokens = recipe.cache_rows_per_shard, recipe.cache_rows_per_shard * T
    objects = shard_objects(rows, tokens, round(tokens * f), feature_width=L * H, hidden_size=H,
                            feature_dtype=recipe.feature_dtype, storage=recipe.storage)
    stored = cache_bytes_per_token(recipe)
    return {"flops": flops, "bytes": {"hbm": hbm, "pcie": captured + PREFILL_H2D_BYTES, "network": stored},
            "requests": {"s3_put": objects / tokens, "s3_get": WRITE_EXTRA_PER_SHARD / tokens},
            "detail": {"cache_bytes_per_token": stored, "objects_per_shard": objects, "tokens_per_shard": tokens,
                       "mean_keys": keys}}


def train_per_token(recipe: Recipe, drafter: DrafterRecipe) -> dict[str, Any]:
    """Drafter training cost per cache token read (one epoch's pass over a token).

    Slots per token: ``A S / T`` through the backbone and ``A gamma / T`` into the loss (A =
    ``min(num_anchors, f T - 1)`` anchors per sample of T tokens; every slot supervised: an upper bound).
    FLOPs/token (Kaplan et al. 2020: ``6 N`` forward + backward):

    - backbone ``6 P_layers`` per backbone slot, attention ``3.5 * 4 n q_dim (a + S)`` per backbone slot
      (keys before the anchor, mean ``a = T (1 - f/2)`` with the supervised span at the end, plus the
      block; 3.5: forward + FlashAttention-2's backward, :data:`ATTENTION_BWD_FACTOR`);
    - per token: context K/V injection ``6 n 2 H kv_dim``, ``fc`` ``4 L H H`` (no input gradient: the
      features are data);
    - per loss slot, the loss chunk running under activation checkpointing (its forward twice):
      drafter logits ``6 V_d H`` (forward, recompute, input gradient; the ``lm_head`` is frozen),
      target logits from ``last_hidden`` ``4 V H`` (forward and recompute, no gradient), Markov
      ``W2`` ``8 r V_d`` (twice forward, weight and input gradients), the head's extra projections
      ``6 P_extra`` and the confidence head ``6 (H + r)``.

    HBM bytes/token (a lower bound: backbone activations are not counted): trainable weights read twice
    and gradients written once per micro-batch (``3 P_train b / tokens per micro-batch``), one AdamW
    step per global batch (:data:`ADAMW_BYTES_PER_PARAM`), the frozen ``lm_head`` read 5 times per
    :data:`LOSS_CHUNK_SLOTS` slots, the loss's fp32 vocabulary tensors (:data:`LOSS_VOCAB_BYTES` per
    slot and vocabulary entry) and the batch written by the copy and read by ``fc``.
    PCIe bytes/token = the batch copied to the GPU: bf16 features ``2 L H``, ``last_hidden`` ``2 H f``,
    int64 ids and bool mask (9). Network bytes/token = :func:`cache_bytes_per_token` (read from storage).
    S3 GET/token = (:data:`ops.estimate.OPEN_PER_SHARD` per shard + ``rows_per_shard`` x
    :func:`ops.estimate.sample_read_requests`) / tokens per shard. The ZeRO-2 gradient reduce-scatter
    and parameter all-gather (``4 P_train`` bytes per step) run on the GPU fabric, not the storage NIC:
    reported in ``detail`` only.

    Returns:
        ``{"flops", "bytes": {"hbm", "pcie", "network"}, "requests": {"s3_get"}, "detail"}``.
    """
    t, L, T, f = recipe.target, recipe.captured_layers, recipe.max_length, recipe.supervised_fraction
    H, V, n, r, S = t.hidden_size, t.vocab_size, drafter.num_layers, drafter.markov_rank, drafter.slots
    Vd = drafter.draft_vocab_size or V
    params = drafter_params(recipe, drafter)
    anchors = max(0.0, min(recipe.num_anchors, f * T - 1))
    backbone_slots, loss_slots = anchors * S / T, anchors * drafter.block_size / T
    mean_anchor = T * (1 - f / 2)
    per_backbone_slot = (6 * params["layers"]
                         + (1 + ATTENTION_BWD_FACTOR) * 4 * n * t.q_dim * (mean_anchor + S))
    extra_matmul = params["head_extra"] if drafter.head in ("gated", "rnn") else 0
    per_loss_slot = (6 * Vd * H + 4 * V * H + (8 * r * Vd if r else 0) + 6 * extra_matmul
                     + (6 * (H + r) if drafter.confidence_head else 0))
    per_context_token = 6 * n * 2 * H * t.kv_dim + 4 * L * H * H
    flops = backbone_slots * per_backbone_slot + per_context_token + loss_slots * per_loss_slot
    b = recipe.train_dtype_bytes
    trainable = params["total"]
    h2d = 2 * L * H + 2 * H * f + TRAIN_H2D_ID_BYTES
    hbm = (3 * trainable * b / (recipe.micro_batch_samples * T)
           + ADAMW_BYTES_PER_PARAM * trainable / (recipe.global_batch_samples * T)
           + loss_slots * (5 * Vd * H * b / LOSS_CHUNK_SLOTS + LOSS_VOCAB_BYTES * Vd)
           + 2 * h2d)
    rows, tokens = recipe.cache_rows_per_shard, recipe.cache_rows_per_shard * T
    gets = OPEN_PER_SHARD + rows * sample_read_requests(T, f * T, feature_width=L * H, hidden_size=H,
                                                        feature_dtype=recipe.feature_dtype,
                                                        chunk_bytes=recipe.storage.chunk_bytes)
    stored = cache_bytes_per_token(recipe)
    return {"flops": flops, "bytes": {"hbm": hbm, "pcie": h2d, "network": stored},
            "requests": {"s3_get": gets / tokens},
            "detail": {"trainable_params": trainable, "backbone_slots_per_token": backbone_slots,
                       "loss_slots_per_token": loss_slots, "flops_backbone": backbone_slots * per_backbone_slot,
                       "flops_context": per_context_token, "flops_loss": loss_slots * per_loss_slot,
                       "gets_per_shard": gets,
                       "zero2_fabric_bytes_per_token": 4 * trainable * b / (recipe.global_batch_samples * T)}}


# ---- the projection ------------------------------------------------------------------------------------

def stage_seconds(stage: str, counts: Mapping[str, Any], cluster: Cluster, tokens: float = 1e9) -> dict[str, float]:
    """Seconds each resource needs for ``tokens`` tokens of ``stage``: work per token x tokens over the
    cluster's ceiling (:meth:`Cluster.throughput`); resources the stage does not use are left out.

    Raises:
        ValueError: unknown stage, or ``tokens`` not positive.
    """
    _check_positive("stage_seconds", tokens=tokens)
    ceiling = cluster.throughput(stage)
    work = {"compute": counts["flops"], **counts["bytes"], **counts["requests"]}
    return {k: work[k] * tokens / ceiling[k] for k in RESOURCES if k in work}


def _row(stage: str, counts: dict[str, Any], cluster: Cluster, tokens: float, passes: float) -> dict[str, Any]:
    seconds = stage_seconds(stage, counts, cluster, 1e9)
    bound = max(seconds, key=seconds.get)
    return {"flops_per_token": counts["flops"], "bytes_per_token": counts["bytes"],
            "requests_per_token": counts["requests"], "s_per_resource": seconds,
            "s_per_1e9_tokens": seconds[bound], "bound": bound, "passes": passes,
            "hours": seconds[bound] * tokens / 1e9 * passes / 3600, "detail": counts["detail"]}


def project(cfg_like: Any, cluster: Cluster, tokens: float = 1e9, *, target_config: Mapping[str, Any] | None = None,
            supervised_fraction: float = 1.0) -> dict[str, dict[str, Any]]:
    """Per stage, the counted work per token and the roofline time on ``cluster``.

    Args:
        cfg_like: a :class:`Recipe`, or a run config (:class:`pipeline.config.RunConfig`) with
            ``target_config`` (the target's ``config.json`` dict) and ``supervised_fraction``.
        cluster: the :class:`Cluster`. tokens: corpus tokens (> 0) for ``hours``.
    Returns:
        ``{stage: {"flops_per_token": FLOP, "bytes_per_token": {resource: B}, "requests_per_token":
        {resource: requests}, "s_per_resource": {resource: s per 1e9 tokens}, "s_per_1e9_tokens": the
        largest, "bound": its resource, "passes": token passes per corpus token, "hours": s_per_1e9_tokens
        x tokens / 1e9 x passes / 3600, "detail": {...}}}``. Stages: ``generate`` (passes = the
        supervised fraction: it writes the answers), ``cache`` (1) and ``train`` (``epochs``; one
        ``train:<name>`` per drafter when there are several).
    Raises:
        ValueError: a config without ``target_config``, unusable sizes, or ``tokens`` not positive.
    """
    _check_positive("project", tokens=tokens)
    if isinstance(cfg_like, Recipe):
        recipe = cfg_like
    elif target_config is None:
        raise ValueError("project() of a run config needs target_config (the target's config.json as a dict)")
    else:
        recipe = Recipe.from_config(cfg_like, target_config, supervised_fraction=supervised_fraction)
    out = {"generate": _row("generate", generate_per_token(recipe, cluster), cluster, tokens,
                            recipe.supervised_fraction),
           "cache": _row("cache", cache_per_token(recipe), cluster, tokens, 1)}
    for d in recipe.drafters:
        name = "train" if len(recipe.drafters) == 1 else f"train:{d.name}"
        out[name] = _row("train", train_per_token(recipe, d), cluster, tokens, recipe.epochs)
    return out


def plan(recipe: Recipe, clusters: Sequence[Cluster], tokens: float = 1e9) -> dict[str, Any]:
    """The ``ops plan`` payload: the recipe's counted sizes and :func:`project` on each cluster.

    Raises:
        ValueError: no cluster, or as :func:`project`.
    """
    if not clusters:
        raise ValueError("plan() needs at least one cluster")
    t = recipe.target
    # the payload's target keys stay the config's names (tie_word_embeddings, dtype_bytes)
    target = {"hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads,
              "num_kv_heads": t.num_kv_heads, "head_dim": t.head_dim, "intermediate_size": t.intermediate_size,
              "vocab_size": t.vocab_size, "tie_word_embeddings": t.tie_embeddings,
              "attention_bias": t.attention_bias, "dtype_bytes": t.bytes_per_param}
    return {"tokens": tokens, "supervised_fraction": recipe.supervised_fraction,
            "recipe": {**asdict(recipe), "target": target},
            "model": {"target_non_embedding_params": t.non_embedding_params,
                      "target_params": t.param_count,
                      "drafter_params": {d.name: drafter_params(recipe, d) for d in recipe.drafters},
                      "cache_bytes_per_token": cache_bytes_per_token(recipe)},
            "clusters": {c.name: {"cluster": {**asdict(c), "nodes": c.nodes}, "stages": project(recipe, c, tokens)}
                         for c in clusters}}


def read_target_config(target_path: str, target_config: str | None) -> tuple[dict[str, Any], str]:
    """``(config.json dict, where it was read)``: the file ``target_config`` when given, else
    ``<target_path>/config.json`` when ``target_path`` is a local folder holding one.

    Raises:
        UsageError: neither is available, or the file is not a JSON object.
    """
    from ops.common import UsageError

    if target_config:
        path = Path(target_config)
    elif Path(target_path).is_dir() and (Path(target_path) / "config.json").is_file():
        path = Path(target_path) / "config.json"
    else:
        raise UsageError(f"target.path {target_path!r} is not a local folder with a config.json: give the "
                         "target's config with --target-config FILE (its Hugging Face config.json; no weights "
                         "are needed)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read the target config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"the target config {path} is not a JSON object")
    return data, str(path)


def plan_from_config(config: str, overrides: Sequence[str], *, clusters: Sequence[str] = (),
                     tokens: float = 1e9, target_config: str | None = None,
                     supervised_fraction: float = 1.0, s3_prefixes: int | None = None) -> tuple[dict[str, Any], int]:
    """``ops plan``: load the run's config as ``pipeline.run`` does and :func:`plan` it.

    Args:
        config: the run's YAML; overrides: ``key=value`` as on the pipeline CLI.
        clusters: preset names of :data:`CLUSTERS` (default: all). tokens: corpus tokens (> 0).
        target_config: the target's ``config.json`` (default: ``target.path``/config.json).
        supervised_fraction: in [0, 1] (default 1.0, an upper bound).
        s3_prefixes: S3 prefixes the requests spread over (default: the presets' 1).
    Returns:
        (payload, 0).
    Raises:
        UsageError: no target config, an unknown cluster, or sizes out of range.
        ConfigError: a bad config or override.
    """
    from ops.common import UsageError
    from pipeline.run import load_config

    unknown = [c for c in clusters if c not in CLUSTERS]
    if unknown:
        raise UsageError(f"unknown cluster {unknown}: expected {sorted(CLUSTERS)}")
    cfg = load_config(config, overrides)
    shape, source = read_target_config(cfg.target.path, target_config)
    try:
        recipe = Recipe.from_config(cfg, shape, supervised_fraction=supervised_fraction)
        chosen = [CLUSTERS[c] for c in (clusters or CLUSTERS)]
        if s3_prefixes is not None:
            chosen = [replace(c, s3_prefixes=s3_prefixes) for c in chosen]
        payload = plan(recipe, chosen, tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    payload.update(config=str(config), target=cfg.target.path, target_config=source,
                   features=str(getattr(cfg.train.features, "value", cfg.train.features)))
    return payload, 0


# ---- the human view ------------------------------------------------------------------------------------

def _g(x: float) -> str:
    return "-" if x is None else f"{x:.3g}"


def _s(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def render_plan(payload: Mapping[str, Any]) -> str:
    """The human view of :func:`plan`: per cluster, one row per stage (FLOPs/token, bytes/token per
    resource, S3 requests/token, seconds per 1e9 tokens, token passes, hours for the payload's tokens,
    the bound), then the seconds of every resource."""
    m = payload["model"]
    lines = [key_values([
        ("target", f"{payload.get('target', '-')} ({m['target_params']:,} parameters, "
                   f"{m['target_non_embedding_params']:,} non-embedding)"),
        *((f"drafter {k}", f"{v['total']:,} trainable parameters") for k, v in m["drafter_params"].items()),
        ("cache bytes/token", f"{m['cache_bytes_per_token']:,.1f} (supervised fraction "
                              f"{payload['supervised_fraction']:g}; cache_schema.estimate_cache_bytes)"),
        ("tokens", f"{payload['tokens']:.4g} (hours = s/1e9 x tokens/1e9 x passes)")])]
    for name, c in payload["clusters"].items():
        cl, stages = c["cluster"], c["stages"]
        lines += ["", f"{name}: {cl['gpus']} x {cl['gpu']} on {cl['nodes']} node(s); "
                      f"MFU generate {cl['mfu_generate']:g} / cache {cl['mfu_cache']:g} / train {cl['mfu_train']:g}, "
                      f"MBU {cl['mbu']:g}, S3 prefixes {cl['s3_prefixes']}",
                  table([{"stage": s, "FLOPs/token": _g(v["flops_per_token"]),
                          **{f"{k} B/token": _g(v["bytes_per_token"].get(k)) for k in BYTE_RESOURCES},
                          "S3 req/token": _g(sum(v["requests_per_token"].values()) or None),
                          "s/1e9 tokens": _s(v["s_per_1e9_tokens"]), "passes": f"{v['passes']:g}",
                          "hours": f"{v['hours']:.3g}", "bound": v["bound"]} for s, v in stages.items()],
                        ["stage", "FLOPs/token", *(f"{k} B/token" for k in BYTE_RESOURCES), "S3 req/token",
                         "s/1e9 tokens", "passes", "hours", "bound"]),
                  "seconds per 1e9 tokens by resource:",
                  table([{"stage": s, **{k: (_s(v["s_per_resource"][k]) if k in v["s_per_resource"] else "-")
                                         for k in RESOURCES}} for s, v in stages.items()], ["stage", *RESOURCES])]
    return "\n".join(lines)
