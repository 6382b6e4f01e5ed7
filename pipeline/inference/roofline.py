"""Roofline model of a speculative-decoding step on one accelerator: a stand-in for a measured SPS curve.

A kernel takes ``max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s)`` (the roofline model,
Williams, Waterman & Patterson, CACM 52(4), 2009). Each forward here is one such kernel (compute
and memory traffic fully overlap: a lower bound on its time; a roofline per operator, GEMMs and
attention apart, is 20-27% slower for Qwen3-4B at R = 256-512, context 1024) plus a fixed overhead.
FLOPs per token are ``2 x matmul parameters`` (Kaplan et al. 2020, sec. 2.1, ``C_forward ~ 2N``)
plus attention's ``4 x layers x heads x head_dim x context`` (``Q K^T`` and ``A V``, 2 FLOPs per
multiply-add each; Hoffmann et al. 2022, app. F). Bytes are the weights, read once per forward,
plus every request's KV cache: ``2 (K, V) x layers x kv_heads x head_dim x 2 bytes`` (bf16) per
context token. Activations, logits and the new KV written are left out: for Qwen3-4B they are
~5 MB per token un-fused (~1,600 FLOP/byte, far above the ~155 FLOP/byte ridge of :data:`H200`),
under ~10% of the weights' bytes below the ridge and never the binding term above it. Every
:data:`H200` constant beyond the datasheet is an assumption: use a measured curve
(:mod:`pipeline.inference.sps`) where a GPU is at hand.

A speculative step is one draft forward (:func:`draft_step_seconds`, paid whatever the verified
length) plus one verify forward (:func:`verify_step_seconds`); :func:`sps_curves` gives one curve
per concurrency R for the scheduler simulation (``pipeline.inference.scheduler.simulate`` takes the
mapping), :func:`qwen3_4b_h200_curves` the product's target (Qwen3-4B, the shipped
``pipeline/target_model/shapes/qwen3_4b.json``) and drafter (5 layers, 5 fused features, Markov rank
256, a confidence head: conf/qwen3_4b.yaml) on one H200.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import inf
from numbers import Integral, Real

from pipeline.inference.scheduler import SPSCurve

__all__ = ["Accelerator", "H200", "ModelShape", "DrafterShape", "Regime", "verify_step_seconds",
           "draft_step_seconds", "sps_curve", "sps_curves", "qwen3_4b_h200_curves", "regime", "ROOFLINE_CONTEXT"]

ROOFLINE_CONTEXT = 1024
"""Default cached tokens per request of the H200 model: the largest power of two at which R = 512
requests fit one H200 (8 GB of weights + 512 x 1,032 x 147,456 B = 78 GB of KV cache < 141 GB; at
2,048 tokens R = 512 needs 164 GB). At longer contexts the KV reads keep the verify step
memory-bound up to larger R, so adaptive verification starts to pay later."""


def _size(name: str, value, minimum: int = 1, what: str = "") -> int:
    """``value`` as an int >= minimum, else ValueError naming the argument and the fix."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{what}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Accelerator:
    """One accelerator as the roofline sees it.

    Attributes:
        name: label. peak_flops: dense bf16 FLOP/s. hbm_bandwidth: bytes/s. hbm_bytes: capacity
        (bytes; only reported by :func:`regime`). compute_efficiency, bandwidth_efficiency:
        achievable fractions of each peak, in (0, 1]. step_overhead_s: seconds added to every
        forward (kernel launches, sampling, scheduling); a speculative step pays it twice.
    Raises:
        ValueError: a peak or capacity <= 0, an efficiency outside (0, 1], an overhead < 0.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    hbm_bytes: float = inf

    def __post_init__(self):
        positive, fraction = (lambda v: v > 0), (lambda v: 0 < v <= 1)
        frac = "a fraction of the peak in (0, 1]"
        for key, ok, rule in (("peak_flops", positive, "> 0 FLOP/s"), ("hbm_bandwidth", positive, "> 0 bytes/s"),
                              ("hbm_bytes", positive, "> 0 bytes"), ("compute_efficiency", fraction, frac),
                              ("bandwidth_efficiency", fraction, frac),
                              ("step_overhead_s", lambda v: 0 <= v < inf, ">= 0 seconds")):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, Real) or not ok(v):  # NaN fails ok(v)
                raise ValueError(f"{key} must be {rule}, got {v!r}")

    flops = property(lambda self: self.peak_flops * self.compute_efficiency, doc="Achieved FLOP/s.")
    bandwidth = property(lambda self: self.hbm_bandwidth * self.bandwidth_efficiency, doc="Achieved bytes/s.")


H200 = Accelerator(
    name="H200 SXM",
    peak_flops=989e12,         # NVIDIA H200 datasheet: 1,979 TFLOPS bf16 "with sparsity"; dense is half
    hbm_bandwidth=4.8e12,      # NVIDIA H200 datasheet: 4.8 TB/s HBM3e
    compute_efficiency=0.6,    # ASSUMPTION: large bf16 GEMMs reach ~60% of dense peak (MFU-like)
    bandwidth_efficiency=0.8,  # ASSUMPTION: streaming weight / KV reads reach ~80% of peak HBM bandwidth
    step_overhead_s=200e-6,    # ASSUMPTION: 200 us per forward (graph launch, sampling, scheduler)
    hbm_bytes=141e9,           # NVIDIA H200 datasheet: 141 GB
)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama / Qwen3 layout: GQA attention, gated MLP); sizes in elements,
    ``qk_norm``: Qwen3's per-head q/k RMSNorm, ``bytes_per_param``: bytes per element of the weights
    and of the KV cache (2 = bf16), ``attention_bias``: q, k, v, o biases (``attention_bias`` of the
    HF config; off in Qwen3).

    Raises:
        ValueError: a size < 1, or num_heads not a multiple of num_kv_heads.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qk_norm: bool = False
    bytes_per_param: int = 2
    attention_bias: bool = False

    def __post_init__(self):
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "bytes_per_param"):
            _size(key, getattr(self, key), what=" (fix the model config)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads} "
                             "(fix the model config)")

    @classmethod
    def from_config(cls, config: dict, *, bytes_per_param: int = 2) -> "ModelShape":
        """Shape from a HF ``config.json`` dict (``head_dim`` defaults to hidden / heads,
        ``num_key_value_heads`` to the heads, ``tie_word_embeddings`` and ``attention_bias`` to False
        as in ``Qwen3Config``; ``qk_norm`` when ``model_type`` starts with ``qwen3``).

        Raises:
            ValueError: a required key missing (pass the model's own config.json) or a size < 1.
        """
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if missing := [k for k in need if k not in config]:
            raise ValueError(f"config lacks {missing}: pass the target's HF config.json as a dict")
        H, heads = _size("hidden_size", config["hidden_size"]), _size("num_attention_heads",
                                                                     config["num_attention_heads"])
        return cls(H, config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or H // heads, config["intermediate_size"], config["vocab_size"],
                   bool(config.get("tie_word_embeddings", False)),
                   str(config.get("model_type", "")).startswith("qwen3"), bytes_per_param,
                   bool(config.get("attention_bias", False)))

    @property
    def q_dim(self) -> int:
        """``num_heads * head_dim``, the width of the queries (and of attention's output)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """``num_kv_heads * head_dim``, the width of the keys and of the values."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """One layer's matmul weights: q, k, v, o ``H hd (2 heads + 2 kv)`` + gate, up, down ``3 H I``."""
        H, hd = self.hidden_size, self.head_dim
        return H * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * H * self.intermediate_size

    @property
    def layer_params(self) -> int:
        """One layer's parameters: matmuls, two RMSNorms ``2 H``, q/k norms ``2 hd`` (when ``qk_norm``)
        and the q, k, v, o biases ``q_dim + 2 kv_dim + H`` (when ``attention_bias``)."""
        bias = (self.q_dim + 2 * self.kv_dim + self.hidden_size) * self.attention_bias
        return self.layer_matmul_params + 2 * self.hidden_size + 2 * self.head_dim * self.qk_norm + bias

    @property
    def matmul_params(self) -> int:
        """Parameters in a matmul for every token: the layers' + the vocabulary projection ``V H``."""
        return self.num_layers * self.layer_matmul_params + self.vocab_size * self.hidden_size

    @property
    def non_embedding_params(self) -> int:
        """Kaplan's N: ``num_layers * layer_params`` + the final norm ``H`` (no embedding, no head)."""
        return self.num_layers * self.layer_params + self.hidden_size

    @property
    def embedding_params(self) -> int:
        """``V H`` for the embedding, twice when the head is not tied to it."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def param_count(self) -> int:
        """All parameters: embedding ``V H``, layers, final norm ``H``, an untied head ``V H``."""
        return self.embedding_params + self.non_embedding_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads: all parameters but an untied input embedding (a gather
        of a few rows) x bytes_per_param."""
        gathered = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return (self.param_count - gathered) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per context token: ``2 x layers x kv_heads x head_dim x bytes_per_param``."""
        return 2 * self.num_layers * self.kv_dim * self.bytes_per_param

    def flops_per_token(self, context: int) -> int:
        """Forward FLOPs of one token over ``context`` cached tokens:
        ``2 matmul_params + 4 layers heads head_dim context`` (Kaplan 2020 sec. 2.1; Hoffmann 2022 app. F).

        Raises:
            ValueError: context < 0.
        """
        c = _size("context", context, 0, " (cached tokens)")
        return 2 * self.matmul_params + 4 * self.num_layers * self.num_heads * self.head_dim * c


@dataclass(frozen=True)
class DrafterShape:
    """The DSpark drafter: ``backbone`` (its decoder layers at the target's width; the target's
    ``lm_head`` is read again), ``fc`` fusing ``num_features`` target features ``[F H -> H]``, a Markov
    head of rank r (``W1 [V, r]`` gathered, ``W2 [V, r]`` applied per slot; r = 0: DFlash) and a
    confidence head ``[H + r -> 1]``."""

    backbone: ModelShape
    num_features: int
    markov_rank: int
    confidence_head: bool = True

    @classmethod
    def from_target(cls, target: ModelShape, *, num_layers: int = 5, num_features: int = 5,
                    markov_rank: int = 256, confidence_head: bool = True) -> "DrafterShape":
        """Drafter at the target's width (defaults: the Qwen3-4B recipe of conf/qwen3_4b.yaml).

        Raises:
            ValueError: num_layers or num_features < 1, markov_rank < 0.
        """
        layers = _size("num_layers", num_layers, what=" (draft decoder layers)")
        return cls(replace(target, num_layers=layers, tie_embeddings=True),
                   _size("num_features", num_features, what=" (fused target layers)"),
                   _size("markov_rank", markov_rank, 0, " (0 = DFlash, no Markov head)"), confidence_head)


@dataclass(frozen=True)
class Regime:
    """A verify step's roofline regime: bound ``"memory"`` or ``"compute"``; compute_s, memory_s
    (seconds); ridge_tokens (tokens per step where they are equal) and ridge_tokens_per_request;
    fits: target weights + KV of ``context + l`` tokens per request fit in ``acc.hbm_bytes``."""

    bound: str
    compute_s: float
    memory_s: float
    ridge_tokens: float
    ridge_tokens_per_request: float
    fits: bool


def regime(target: ModelShape, acc: Accelerator, batch_requests: int, tokens_per_request: int,
           context: int) -> Regime:
    """Whether verifying l tokens for each of R requests is memory- or compute-bound, and the ridge.

    compute_s = R l flops_per_token(context) / acc.flops; memory_s = M / acc.bandwidth with
    M = weight_bytes + R context kv_bytes_per_token (bytes), which does not grow with l. The step
    turns compute-bound past ``T* = M acc.flops / (acc.bandwidth flops_per_token(context))`` tokens
    per step (the roofline ridge, Williams et al. 2009): below it extra verified tokens are nearly
    free, above it every wasted token costs its FLOPs (where adaptive verification pays).

    Raises:
        ValueError: R or l < 1, context < 0.
    """
    R = _size("batch_requests", batch_requests, what=" (requests in the batch)")
    l = _size("tokens_per_request", tokens_per_request, what=" (1 + drafts verified)")
    per_token = target.flops_per_token(context)
    mem_bytes = target.weight_bytes + R * context * target.kv_bytes_per_token
    compute, memory = R * l * per_token / acc.flops, mem_bytes / acc.bandwidth
    ridge = mem_bytes * acc.flops / (acc.bandwidth * per_token)
    fits = target.weight_bytes + R * (context + l) * target.kv_bytes_per_token <= acc.hbm_bytes
    return Regime("compute" if compute > memory else "memory", compute, memory, ridge, ridge / R, fits)


def verify_step_seconds(target: ModelShape, acc: Accelerator, batch_requests: int, tokens_per_request: int,
                        context: int) -> float:
    """Seconds of one target forward over R requests x l tokens, each on a KV cache of ``context``
    tokens: ``max(compute_s, memory_s) + acc.step_overhead_s`` (terms as :func:`regime`).

    Raises:
        ValueError: R or l < 1, context < 0.
    """
    g = regime(target, acc, batch_requests, tokens_per_request, context)
    return max(g.compute_s, g.memory_s) + acc.step_overhead_s


def draft_step_seconds(drafter: DrafterShape, acc: Accelerator, batch_requests: int, block_size: int,
                       context: int) -> float:
    """Seconds of one drafter forward drafting R blocks of S = ``block_size`` slots over ``context``.

    Parallel part, one roofline. FLOPs: ``R S (2 n layer_matmul_params + 4 n heads hd context +
    2 V H (lm_head) + 2 (H + r + 1) (confidence))`` plus, for the ``S + 1`` new context tokens per
    request (at most the anchor and S accepted drafts), ``2 F H^2`` (fc) ``+ 4 n H kv hd`` (their K, V).
    Bytes: ``(n layer_params + F H^2 + V H + H + (H + r + 1)) x bytes_per_param`` weights +
    ``R context`` x the drafter's kv_bytes_per_token. Sequential part, S rooflines, one per slot:
    the Markov bias ``W2 u`` (``2 R r V`` FLOPs; ``V r x bytes_per_param`` weights, read each slot).
    Plus ``acc.step_overhead_s``.

    Raises:
        ValueError: R or block_size < 1, context < 0.
    """
    R = _size("batch_requests", batch_requests, what=" (requests in the batch)")
    S = _size("block_size", block_size, what=" (drafted slots per block)")
    c = _size("context", context, 0, " (cached tokens)")
    b, F, r = drafter.backbone, drafter.num_features, drafter.markov_rank
    H, V, n = b.hidden_size, b.vocab_size, b.num_layers
    conf = (H + r + 1) * drafter.confidence_head
    per_slot = 2 * n * b.layer_matmul_params + 4 * n * b.num_heads * b.head_dim * c + 2 * V * H + 2 * conf
    per_new_ctx = 2 * F * H * H + 4 * n * H * b.num_kv_heads * b.head_dim
    flops = R * S * per_slot + R * (S + 1) * per_new_ctx
    weights = (n * b.layer_params + F * H * H + V * H + H + conf) * b.bytes_per_param
    parallel = max(flops / acc.flops, (weights + R * c * b.kv_bytes_per_token) / acc.bandwidth)
    markov = max(2 * R * r * V / acc.flops, V * r * b.bytes_per_param / acc.bandwidth) if r else 0.0
    return parallel + S * markov + acc.step_overhead_s


def sps_curve(target: ModelShape, drafter: DrafterShape, acc: Accelerator, batch_requests: int,
              max_tokens: int, context: int, block_size: int | None = None) -> SPSCurve:
    """Speculative steps per second at R requests, as the scheduler consumes it: an :class:`SPSCurve`
    over B = R x l total tokens per verify step (the scheduler's ``B = sum_r (1 + l_r)``), l =
    1..max_tokens tokens per request, SPS(B) = 1 / (draft_step_seconds + verify_step_seconds).

    Unlike :func:`pipeline.inference.sps.profile_sps` (the target forward alone) each step includes
    the draft forward, paid at every l (the block is drafted before l is chosen); ``block_size``
    defaults to ``max(max_tokens - 1, 1)`` (the largest l verifies the whole block). The curve
    holds for this R only: one curve per R, simulated with ``concurrency=(R,)``.

    Raises:
        ValueError: R, max_tokens or block_size < 1, context < 0.
    """
    R = _size("batch_requests", batch_requests, what=" (requests in the batch)")
    L = _size("max_tokens", max_tokens, what=" (tokens verified per request)")
    draft = draft_step_seconds(drafter, acc, R, max(L - 1, 1) if block_size is None else block_size, context)
    steps = [1.0 / (draft + verify_step_seconds(target, acc, R, l, context)) for l in range(1, L + 1)]
    return SPSCurve([R * l for l in range(1, L + 1)], steps)


def sps_curves(target: ModelShape, drafter: DrafterShape, acc: Accelerator, concurrency, block_size: int,
               context: int) -> dict[int, SPSCurve]:
    """One :func:`sps_curve` per concurrency R, l = 1..block_size + 1 tokens verified per request,
    drafting ``block_size`` slots: ``{R: SPSCurve}``, the form the scheduler simulation takes.

    Raises:
        ValueError: an R or block_size < 1, context < 0.
    """
    return {int(R): sps_curve(target, drafter, acc, R, block_size + 1, context, block_size) for R in concurrency}


def qwen3_4b_h200_curves(concurrency, block_size: int = 7, context: int = ROOFLINE_CONTEXT) -> dict[int, SPSCurve]:
    """:func:`sps_curves` of Qwen3-4B (its published config, shipped at
    ``pipeline/target_model/shapes/qwen3_4b.json``) verifying the conf/qwen3_4b.yaml drafter
    (:meth:`DrafterShape.from_target` defaults) on one :data:`H200`, at ``context`` cached tokens.

    Raises:
        ValueError: an R or block_size < 1, context < 0.
    """
    import json
    from importlib.resources import files

    config = json.loads(files("pipeline.target_model").joinpath("shapes/qwen3_4b.json").read_text())
    target = ModelShape.from_config(config)
    return sps_curves(target, DrafterShape.from_target(target), H200, concurrency, block_size, context)
