"""The DSpark drafter: DFlash block-diffusion backbone + sequential head + confidence head.

Backbone (DFlash, arXiv:2602.06036, method: context features and KV injection; docs/design.md sec. 2):
the target's hidden states at ``target_layer_ids`` are fused once,
``ctx = RMSNorm_hidden(fc([h_l1 ; ... ; h_lL]))`` (``fc`` without bias). Each of the ``n`` Qwen3
decoder layers takes queries from the block slots only; its keys/values are the layer's own
``k_proj``/``v_proj`` over ``[ctx ; block]`` (KV injection), with qk-norm and RoPE at context
positions ``0 .. L-1`` and block positions ``anchor + 0 ..``. A final ``norm`` and the frozen target
``lm_head`` give the base logits; the input embedding is the frozen target ``embed_tokens``.
Heads and formulas: :mod:`training.heads`; loss: :mod:`training.losses`; blocks and masks:
:mod:`training.blocks`. Parameter names follow vLLM's ``Qwen3DSparkModel`` checkpoint layout.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3DecoderLayer, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, rotate_half)

from training.blocks import (Blocks, DraftBatch, build_blocks, dense_block_mask, flex_block_mask,
                             sample_anchors, static_shape)
from training.draft_vocab import draft_to_target_ids
from training.heads import HEAD_TYPES, ConfidenceHead, build_sequential_head, sample_sequential
from training.losses import LossConfig, LossOutput, SupervisedSlots, drafter_loss
from training.spec_sampling import Sampling

__all__ = ["DrafterConfig", "DraftContext", "DraftResult", "Drafter", "new_drafter", "check_target_fit",
           "draft_layer_config", "resolve_attention", "compiled_flex_attention",
           "FLEX_GRAPH_LIMIT", "FROZEN_STATE"]

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")
INIT_MODES = ("random", "target", "pretrained")
ARCHITECTURES = ("dflash", "eagle3")
FROZEN_STATE = ("embed_tokens.weight", "lm_head.weight", "target_lm_head", "d2t")
"""State-dict entries a drafter takes from the target (or fixes before training): never trained, never loaded
from a published drafter (:meth:`Drafter.load_pretrained`)."""


@dataclass
class DrafterConfig:
    """Drafter architecture and training-time block settings (reference recipe in docs/design.md sec. 2).

    Attributes:
        target_layer_ids: ascending target layers whose outputs are the context features
            (-1 = embedding output; never the final layer).
        mask_token_id: token id of the mask slots (Qwen3 recipe: 151669).
        architecture: ``"dflash"`` (the DFlash block-parallel backbone, :class:`Drafter`; DSpark with a
            sequential head) or ``"eagle3"`` (:class:`training.eagle3.Eagle3Drafter`: one decoder layer
            drafting autoregressively over three of the captured layers, :attr:`eagle3_layer_ids`; it
            needs ``num_layers=1``, ``sample_from_anchor``, no sequential or confidence head, and
            ``init`` random or pretrained).
        num_layers: draft decoder layers n. block_size: gamma (drafted tokens per block).
        sample_from_anchor: block layout, True = DSpark ``[anchor, mask x (gamma-1)]``, False =
            DFlash ``[anchor, mask x gamma]`` (see :mod:`training.blocks`). Never inferred.
        markov_rank: r of the sequential head; 0 = no head (DFlash).
        head_type: ``"markov"`` (vanilla), ``"gated"``, ``"rnn"`` or ``"control"`` (the ablation:
            anchor + slot vector instead of the previous token, :class:`training.heads.ControlHead`).
        confidence_head: add the confidence head.
        confidence_grad_to_backbone: let the confidence loss push gradient into the backbone and the
            Markov embedding (default False: only the confidence head learns from it).
        confidence_temperature, confidence_top_p, confidence_top_k: the sampling setting (T >= 0,
            top-p in (0, 1], top-k >= 0; :class:`training.spec_sampling.Sampling`) of the confidence
            head's label ``c*`` (:func:`training.losses.confidence_labels`; T = 0: greedy acceptance;
            (1, 1, 0): the TV term's ``c*``), the serving setting the head is to rank. A training-time
            choice: recorded, not compared.
        num_anchors: anchors sampled per sample in training. draft_vocab_size: reduced output
            vocabulary (EAGLE-3 style) or None for the full target vocabulary.
        attention: ``"sdpa"`` (dense mask), ``"flex"`` (BlockMask; compiled on CUDA at padded static
            shapes, :func:`training.blocks.static_shape`; on CPU eager and forward-only, as torch has
            no CPU flex backward) or ``"auto"`` (flex on CUDA, else sdpa).
        init: how a fresh drafter starts: ``"random"`` (Qwen3 init, the public recipes),
            ``"target"`` (:meth:`Drafter.init_from_target`) or ``"pretrained"`` (the trainable weights
            of ``init_path``, :meth:`Drafter.load_pretrained`). Recorded; a training-time choice that
            changes no layout, so later stages do not compare it.
        init_path: with ``init="pretrained"``: a safetensors file of the drafter's own parameter
            names (the train stage writes it from a published drafter:
            :func:`pipeline.drafters.prepare_pretrained`).
    """

    target_layer_ids: Sequence[int]
    mask_token_id: int
    architecture: str = "dflash"
    num_layers: int = 5
    block_size: int = 7
    sample_from_anchor: bool = True
    markov_rank: int = 256
    head_type: str = "markov"
    confidence_head: bool = True
    confidence_grad_to_backbone: bool = False
    confidence_temperature: float = 1.0
    confidence_top_p: float = 1.0
    confidence_top_k: int = 0
    num_anchors: int = 512
    draft_vocab_size: int | None = None
    attention: str = "auto"
    init: str = "random"
    init_path: str | None = None

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        ids = self.target_layer_ids
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ValueError(f"target_layer_ids must be non-empty, strictly ascending and >= -1, got {ids}")
        try:
            self.confidence_sampling  # noqa: B018 -- validates the setting
        except ValueError as e:
            raise ValueError(f"confidence_temperature / confidence_top_p / confidence_top_k: {e}") from None
        for name in ("num_layers", "block_size", "num_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = DFlash), got {self.markov_rank}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {sorted(HEAD_TYPES)}, got {self.head_type!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.init not in INIT_MODES:
            raise ValueError(f"init must be one of {INIT_MODES}, got {self.init!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.architecture == "eagle3":
            wrong = {k: v for k, v in (("num_layers", self.num_layers), ("sample_from_anchor", self.sample_from_anchor),
                                       ("markov_rank", self.markov_rank), ("confidence_head", self.confidence_head))
                     if v != {"num_layers": 1, "sample_from_anchor": True, "markov_rank": 0,
                              "confidence_head": False}[k]}
            if wrong or len(self.target_layer_ids) < 3 or self.init == "target":
                raise ValueError("an eagle3 drafter is one decoder layer over three captured layers, without heads: it "
                                 "needs num_layers=1, sample_from_anchor=true, markov_rank=0 (head: none), "
                                 "confidence_head=false, at least 3 target_layer_ids and init random or pretrained; got "
                                 f"{wrong or ''} target_layer_ids={self.target_layer_ids} init={self.init!r}")
        if (self.init == "pretrained") != (self.init_path is not None):
            raise ValueError("init 'pretrained' needs init_path (and only it takes one), got "
                             f"init={self.init!r}, init_path={self.init_path!r}")

    @property
    def confidence_sampling(self) -> Sampling:
        """The confidence label's sampling setting. Raises ValueError (naming the value) if out of range."""
        return Sampling(self.confidence_temperature, self.confidence_top_p, self.confidence_top_k)

    @property
    def eagle3_layer_ids(self) -> tuple[int, int, int]:
        """The low, middle and high captured layers an eagle3 drafter fuses (EAGLE-3, Li et al. 2025,
        sec. 3: low-, mid- and high-level features): the first, middle and last of ``target_layer_ids``."""
        ids = self.target_layer_ids
        return ids[0], ids[len(ids) // 2], ids[-1]

    @property
    def slots(self) -> int:
        """Slots per block S: gamma (DSpark layout) or gamma + 1 (DFlash layout)."""
        return self.block_size if self.sample_from_anchor else self.block_size + 1


@functools.cache
def resolve_attention(attention: str, device_type: str) -> str:
    """The attention kernel of a training forward (masked block attention) for a
    :attr:`DrafterConfig.attention` on a device type: ``"flex"`` or ``"sdpa"``.

    ``"auto"`` is flex on CUDA and sdpa elsewhere; ``"flex"`` is flex everywhere; ``"sdpa"`` is sdpa
    on every device but CUDA. There it is refused: with a boolean mask and ``enable_gqa`` torch's
    sdpa can only take its math kernel on CUDA, which materialises fp32 scores
    ``[B, heads, N*S, T + N*S]`` per layer (about 14 GB at B = 4, 32 heads, 3,584 block slots and
    7,680 keys), where flex attention runs the same rule as a fused, block-sparse kernel. Inference
    (:meth:`Drafter.draft_block`) attends without a mask and is not concerned.

    Args:
        attention: ``"auto"``, ``"sdpa"`` or ``"flex"``. device_type: ``torch.device.type`` of the
            forward's tensors (``"cuda"``, ``"cpu"``, ...).
    Returns:
        ``"flex"`` or ``"sdpa"``.
    Raises:
        ValueError: ``attention="sdpa"`` on ``"cuda"`` (use flex attention:
            ``DrafterConfig.attention="flex"``, or ``"auto"``, which takes flex on CUDA), or an
            unknown ``attention``.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if attention == "sdpa" and device_type == "cuda":
        raise ValueError("attention='sdpa' on CUDA: with the boolean block mask sdpa can only take its math "
                         "kernel there, whose fp32 scores [B, heads, N*S, T+N*S] are ~14 GB per layer at the "
                         "recipe's shape; use flex attention: DrafterConfig.attention='flex' (or 'auto', "
                         "flex on CUDA)")
    if attention == "auto":
        return "flex" if device_type == "cuda" else "sdpa"
    return attention


@dataclass
class DraftContext:
    """Cached context keys/values for inference, one entry per draft layer.

    Attributes:
        keys, values: per layer [1, n_kv_heads, L, head_dim] (keys after k_norm and RoPE).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """Context positions L covered (the next anchor sits at position L)."""
        return self.keys[0].shape[2]


@dataclass
class DraftResult:
    """One drafted block.

    Attributes:
        tokens: [gamma] int64 target ids. q: [gamma, V] float32 exact draft distribution of each slot
            (after temperature, zero outside a reduced draft vocabulary; one-hot at T = 0).
        confidence_logits: [gamma] float32 or None (no confidence head); ``c_k = sigmoid``.
        max_q: [gamma] float32, the largest draft probability of each slot (the feature of the max-q
            acceptance estimator, :mod:`training.maxq`): of ``q`` at T > 0, of ``softmax`` of the
            unscaled logits at T = 0 (where ``q`` is one-hot).
        confidence_input: [gamma, D] the confidence head's input ``[h_k ; W1[x_{k-1}]]`` of each slot
            (``x_{k-1}`` the drafted token), in the drafter's dtype, or None (no head): what the on-policy
            refit of the head fits on (:mod:`training.confidence_refit`).
    """

    tokens: torch.Tensor
    q: torch.Tensor
    confidence_logits: torch.Tensor | None
    max_q: torch.Tensor | None = None
    confidence_input: torch.Tensor | None = None


def draft_layer_config(target_config: Qwen3Config, num_layers: int) -> Qwen3Config:
    """The target's config with ``num_layers`` full-attention layers: the draft decoder layers' config."""
    layer_cfg = target_config.to_dict()
    layer_cfg.pop("layer_types", None)
    layer_cfg.update(num_hidden_layers=num_layers, use_sliding_window=False)
    return Qwen3Config(**layer_cfg)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021, eq. 34; HF rotate-half layout): x [B, h, L, d], cos/sin [B, L, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


FLEX_GRAPH_LIMIT = 32
"""Compiled flex-attention graphs allowed per process: a graph per padded shape (4 context buckets
up to 4,096 tokens) and grad mode (training, validation) leaves room for other micro-batch sizes.
Past it the call raises instead of falling back to eager flex, which materialises the scores."""


@functools.cache
def _compiled_flex(backend: str):
    """Flex attention compiled once per process and backend, with static shapes (one graph per shape)."""
    return torch.compile(flex_attention, backend=backend, dynamic=False)


def compiled_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                            scale: float, backend: str = "inductor") -> torch.Tensor:
    """Compiled flex attention (GQA) of q [B, h, Q, d] over k/v [B, h_kv, K, d] -> [B, h, Q, d].

    Shapes are static (``dynamic=False``): the caller pads them to a few buckets
    (:func:`training.blocks.static_shape`), so each bucket compiles once.

    Raises:
        torch._dynamo.exc.FailOnRecompileLimitHit: more than :data:`FLEX_GRAPH_LIMIT` graphs (shapes
            are not bucketed); dynamo's default would silently run eager flex, whose materialised
            scores are ~14 GB per layer at the recipe's shape.
    """
    with torch._dynamo.config.patch(recompile_limit=FLEX_GRAPH_LIMIT, fail_on_recompile_limit_hit=True):
        return _compiled_flex(backend)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _attend(q, k, v, mask, scale):
    """Attention of q [B, h, Q, d] over k/v [B, h_kv, K, d] with a dense bool mask, a BlockMask or None."""
    if isinstance(mask, BlockMask):
        if q.is_cuda:
            return compiled_flex_attention(q, k, v, mask, scale)
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def check_target_fit(config: DrafterConfig, target_config: Qwen3Config, embed_weight: torch.Tensor,
                     lm_head_weight: torch.Tensor) -> None:
    """Raise ValueError if a drafter config or the frozen weights do not fit the target: a captured layer
    past ``num_hidden_layers - 2`` (the last layer is returned after the final norm), a mask token outside
    the vocabulary, or ``embed_weight`` / ``lm_head_weight`` not ``[V, H]`` of ``target_config``."""
    V, H = target_config.vocab_size, target_config.hidden_size
    n_target = target_config.num_hidden_layers
    if config.target_layer_ids[-1] > n_target - 2:
        raise ValueError(f"target_layer_ids {config.target_layer_ids} must be <= {n_target - 2}: the "
                         f"last of the target's {n_target} layers is returned after the final norm")
    if not 0 <= config.mask_token_id < V:
        raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target vocabulary [0, {V})")
    for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
        if tuple(w.shape) != (V, H):
            raise ValueError(f"{name} is {tuple(w.shape)}, the target config says [{V}, {H}]")


def new_drafter(config: DrafterConfig, target_config: Qwen3Config, embed_weight: torch.Tensor,
                lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None) -> "Drafter":
    """A freshly initialised drafter of ``config.architecture``: :class:`Drafter` (``"dflash"``: DFlash, and
    DSpark with its heads) or :class:`training.eagle3.Eagle3Drafter` (``"eagle3"``); arguments and errors as
    :class:`Drafter`'s."""
    if config.architecture == "eagle3":
        from training.eagle3 import Eagle3Drafter

        return Eagle3Drafter(config, target_config, embed_weight, lm_head_weight, d2t)
    return Drafter(config, target_config, embed_weight, lm_head_weight, d2t)


class Drafter(nn.Module):
    """DSpark/DFlash drafter on a Qwen3 target.

    Args:
        config: :class:`DrafterConfig`.
        target_config: the target's ``Qwen3Config`` (width, heads, RoPE, eps, vocabulary, depth).
        embed_weight: [V, H] the target's ``embed_tokens.weight`` (kept frozen, storage shared).
        lm_head_weight: [V, H] the target's ``lm_head.weight`` (kept frozen).
        d2t: [V_draft] int64 draft-to-target offsets (:mod:`training.draft_vocab`), required iff
            ``config.draft_vocab_size`` is set; persisted in the state dict and checked on load.
    Raises:
        ValueError: a target layer id out of range, a mask token outside the vocabulary, weight
            shapes that do not match the target config, or a missing / mis-sized ``d2t``.
    """

    def __init__(self, config: DrafterConfig, target_config: Qwen3Config, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, d2t: torch.Tensor | None = None):
        super().__init__()
        if config.architecture != "dflash":
            raise ValueError(f"Drafter builds the DFlash backbone; architecture {config.architecture!r} is built by "
                             "training.drafter.new_drafter")
        check_target_fit(config, target_config, embed_weight, lm_head_weight)
        V, H = target_config.vocab_size, target_config.hidden_size
        self.config = config
        self.layer_config = draft_layer_config(target_config, config.num_layers)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=target_config.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(self.layer_config, i) for i in range(config.num_layers))
        self.norm = Qwen3RMSNorm(H, eps=target_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.layer_config)
        Vd = self._init_vocab(config, embed_weight, lm_head_weight, d2t)
        self.markov_head = build_sequential_head(config.head_type, vocab_size=V, draft_vocab_size=Vd,
                                                 rank=config.markov_rank, hidden_size=H,
                                                 slots=config.block_size)
        self.confidence_head = ConfidenceHead(H + config.markov_rank) if config.confidence_head else None
        self._init_trainable(target_config.initializer_range)
        self.register_load_state_dict_pre_hook(self._check_d2t)

    def _init_vocab(self, config: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                    d2t: torch.Tensor | None) -> int:
        """The frozen vocabulary modules: ``embed_tokens`` (the target's), ``lm_head`` (the target's rows of
        the draft vocabulary), and with a reduced draft vocabulary ``d2t`` / ``draft_ids`` / the full
        ``target_lm_head``. Returns the draft vocabulary size. Raises ValueError for a missing or
        mis-sized ``d2t``."""
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.detach(), freeze=True)
        if config.draft_vocab_size is not None:
            if d2t is None or tuple(d2t.shape) != (config.draft_vocab_size,):
                raise ValueError(f"draft_vocab_size={config.draft_vocab_size} needs d2t of that length "
                                 "(training.draft_vocab.build_d2t, or the one stored in the checkpoint)")
            self.register_buffer("d2t", d2t.detach().long().clone())
            draft_ids = draft_to_target_ids(self.d2t)
            self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)
            self.target_lm_head = nn.Parameter(lm_head_weight.detach(), requires_grad=False)
            lm_head_weight = lm_head_weight.detach()[draft_ids]
        elif d2t is not None:
            raise ValueError("d2t given but config.draft_vocab_size is None: set draft_vocab_size = len(d2t)")
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach(), requires_grad=False)
        return lm_head_weight.shape[0]

    def _init_trainable(self, std: float) -> None:
        """Linear/embedding weights ~ N(0, std), biases 0, norms 1 (Qwen3 init); ``markov_w2 = 0`` so
        the drafter starts as plain DFlash (zero Markov bias) and the head grows from there."""
        for mod in self.modules():
            if mod is self.embed_tokens or mod is self.lm_head:
                continue
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=std)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
        if self.markov_head is not None:
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    @property
    def init_layer(self) -> int:
        """The target layer ``init: target`` copies: the one that reads the last captured feature
        (``target_layer_ids[-1] + 1``)."""
        return self.config.target_layer_ids[-1] + 1

    def load_pretrained(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Start from a published drafter's weights (``init="pretrained"``).

        Args:
            state: tensors by this drafter's parameter names (the frozen ``embed_tokens`` /
                ``lm_head`` / ``target_lm_head`` and ``d2t`` are the target's and not read).
        Returns:
            the trainable parameters ``state`` does not hold, left as initialised (e.g. a confidence
            head that a DFlash export drops).
        Raises:
            ValueError: a tensor this drafter has no parameter for, or one of another shape.
        """
        own = {k: v for k, v in self.state_dict().items() if k not in FROZEN_STATE}
        unknown = sorted(set(state) - set(own) - set(FROZEN_STATE))
        shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
                  if k in state and state[k].shape != v.shape]
        if unknown or shapes:
            raise ValueError(f"the pretrained drafter does not fit this one: no parameter for {unknown}; "
                             f"other shapes: {shapes}")
        with torch.no_grad():
            for k, v in own.items():
                if k in state:
                    v.copy_(state[k].to(v.dtype))
        return sorted(k for k in own if k not in state)

    @torch.no_grad()
    def init_from_target(self, layer_state: dict[str, torch.Tensor], final_norm: torch.Tensor) -> None:
        """Start the backbone as the target's next layer over its last captured feature.

        ``fc`` selects the last target layer's feature block (``[0 ... 0 I]``), ``hidden_norm`` is
        the copied layer's input norm, every draft layer is a copy of target layer
        :attr:`init_layer` and the final norm is the target's: at step 0 the context keys and values
        of every draft layer are exactly those that layer computes in the target. This project's
        choice for small-scale recipes (docs/training-recipe.md: it lifts the held-out curve of the
        demo's drafters by about a fifth at equal steps); the DFlash paper initialises at random.

        Args:
            layer_state: one target decoder layer's tensors by name inside the layer
                (:func:`training.target_weights.load_layer_init`). final_norm: ``[H]``.
        Raises:
            RuntimeError: the tensors do not fit a draft layer (missing, unexpected or mis-shaped).
        """
        H = self.fc.out_features
        self.fc.weight.zero_()
        self.fc.weight[:, -H:] = torch.eye(H, dtype=self.fc.weight.dtype)
        self.hidden_norm.weight.copy_(layer_state["input_layernorm.weight"])
        for layer in self.layers:
            layer.load_state_dict({k: v.to(self.fc.weight.dtype) for k, v in layer_state.items()}, strict=True)
        self.norm.weight.copy_(final_norm)

    def _check_d2t(self, module, state_dict, prefix, *args) -> None:
        key = prefix + "d2t"
        mine = getattr(self, "d2t", None)
        theirs = state_dict.get(key)
        if mine is not None and theirs is not None and not torch.equal(mine.cpu(), theirs.cpu().long()):
            raise ValueError("the checkpoint's d2t differs from this drafter's: the draft vocabulary must stay "
                             "fixed across resume; build the Drafter with d2t=state_dict['d2t']")

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[V_draft] int64 target id of each draft id, or None for the full vocabulary."""
        return getattr(self, "draft_ids", None)

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (behind ``.to(device)``, ``.bfloat16()``, ...) keeping a tied target's frozen
        ``lm_head.weight`` / ``target_lm_head`` on the storage of ``embed_tokens.weight``: moved one by one,
        two parameters sharing a storage would become two copies (0.78 GB more per GPU at V = 151,936,
        H = 2,560 in bf16). The shared parameters are emptied before the move and pointed back after, so
        not even a transient second copy is made."""
        embed = self.embed_tokens.weight
        tied = [p for p in (self.lm_head.weight, getattr(self, "target_lm_head", None))
                if p is not None and p is not embed and p.data_ptr() == embed.data_ptr() and p.shape == embed.shape]
        for p in tied:
            p.data = p.data.new_empty(0)
        try:
            return super()._apply(fn, recurse)
        finally:
            for p in tied:
                p.data = self.embed_tokens.weight.data

    @property
    def target_lm_head_weight(self) -> torch.Tensor:
        """[V, H] the target's full ``lm_head`` (used for ``p_t``)."""
        return self.target_lm_head if self.draft_to_target is not None else self.lm_head.weight

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters for the optimizer: everything but the frozen ``embed_tokens`` / ``lm_head``."""
        return [p for p in self.parameters() if p.requires_grad]

    def muon_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters Muon updates (``train.optimizer=muon``,
        :class:`training.engine.DeepSpeedEngine`): the backbone's hidden matrices, the 2-D weights
        of ``fc`` and of the decoder ``layers`` (attention and MLP projections).

        Muon orthogonalises the update of a matrix mapping dense activations to dense activations
        (Jordan et al. 2024, "Muon: an optimizer for hidden layers": embeddings, classifier heads
        and gains / biases take AdamW). ``fc`` is such a matrix: it maps the target's dense hidden
        features [L*H] to the backbone's width, and every context token updates all of it (an
        embedding maps one-hot token ids; only the rows of drawn tokens get a gradient). The heads
        take AdamW: the Markov embedding ``markov_w1`` (and the control head's ``slot_embed``)
        are embeddings, the Markov ``markov_w2`` [V_draft, r] and the confidence ``proj``
        [1, H + r] are output projections into logits, and the gated / RNN heads' small gate
        projections sit on those heads, outside the backbone. Norm gains are 1-D: AdamW.
        """
        backbone = [self.fc, self.layers]
        return [p for m in backbone for p in m.parameters() if p.requires_grad and p.ndim == 2]

    # -- backbone -------------------------------------------------------------------------------
    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``ctx = hidden_norm(fc(features))``: [B, L, n_ids*H] -> [B, L, H] (DFlash paper, feature fusion)."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(f"features have width {features.shape[-1]}, expected {self.fc.in_features} "
                             f"= {len(self.config.target_layer_ids)} target layers x hidden size")
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    @staticmethod
    def _context_kv(layer, ctx, cos, sin):
        """KV injection: the layer's own k/v projections of ctx [B, L, H] -> k, v [B, h_kv, L, d]."""
        attn = layer.self_attn
        B, L, _ = ctx.shape
        k = attn.k_norm(attn.k_proj(ctx).view(B, L, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(ctx).view(B, L, -1, attn.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    @staticmethod
    def _block_layer(layer, x, ctx_k, ctx_v, cos, sin, mask):
        """One Qwen3 decoder layer over block slots x [B, Q, H], keys/values ``[ctx ; block]``."""
        attn = layer.self_attn
        B, Q, _ = x.shape
        h = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(B, Q, -1, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(B, Q, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(h).view(B, Q, -1, attn.head_dim).transpose(1, 2)
        o = _attend(_rope(q, cos, sin), torch.cat([ctx_k, _rope(k, cos, sin)], 2),
                    torch.cat([ctx_v, v], 2), mask, attn.scaling)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.fc.weight.dtype)

    def confidence(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits [..., gamma] float32 on ``[h_k ; W1[x_{k-1}]]`` (DSpark sec. 3.2.1) from the
        slots' backbone output ``h`` [..., gamma, H] and the ``x_{k-1}`` they follow ``prev_ids`` [..., gamma];
        None without a confidence head."""
        if self.confidence_head is None:
            return None
        e = self.markov_head.embed(prev_ids) if self.markov_head is not None else None
        if not self.config.confidence_grad_to_backbone:
            h, e = h.detach(), (None if e is None else e.detach())
        return self.confidence_head(h, e)

    # -- training -------------------------------------------------------------------------------
    def make_blocks(self, batch: DraftBatch, generator: torch.Generator | None = None) -> Blocks:
        """Sample anchors (``config.num_anchors``) and lay out blocks for ``batch`` (:mod:`training.blocks`)."""
        anchors, keep = sample_anchors(batch.loss_mask, self.config.num_anchors, generator)
        return build_blocks(batch.input_ids, batch.loss_mask, anchors, keep,
                            block_size=self.config.block_size,
                            sample_from_anchor=self.config.sample_from_anchor,
                            mask_token_id=self.config.mask_token_id)

    def forward(self, batch: DraftBatch, blocks: Blocks, static_shapes: bool | None = None) -> SupervisedSlots:
        """Training forward over all blocks of a batch (teacher forcing for the sequential head).

        With ``static_shapes`` the backbone runs at :func:`training.blocks.static_shape`'s padded
        ``(T, N)``: zero context features after position T (never attended: every anchor lies
        before T) and dummy blocks (anchor 0, mask tokens) that attend only to their own slots and
        are cut off before the heads, so the supervised slots, the loss and the gradients are those
        of the unpadded shapes (``tests/unit/training/test_gpu_path_attention.py``).

        Args:
            batch: padded cache samples [B, T]. blocks: from :meth:`make_blocks` or ``build_blocks``
                with this config's layout and block size.
            static_shapes: pad to static shapes; None (default) = exactly when the attention is the
                compiled flex kernel (flex on CUDA), where every new shape is a new compiled graph.
        Returns:
            the M supervised slots (:class:`training.losses.SupervisedSlots`).
        Raises:
            ValueError: blocks built with another layout / block size, features of the wrong width,
                or ``config.attention="sdpa"`` on CUDA (:func:`resolve_attention`; raised before any
                layer runs).
        """
        cfg = self.config
        B, T = batch.input_ids.shape
        N, S, gamma = blocks.anchors.shape[1], blocks.slots, cfg.block_size
        if blocks.sample_from_anchor != cfg.sample_from_anchor or blocks.labels.shape[-1] != gamma:
            raise ValueError("blocks were built with another layout or block size than this drafter's config")
        # the kernel, where the weights are: once per forward (before any compute), not per layer
        device = self.fc.weight.device
        use_flex = resolve_attention(cfg.attention, device.type) == "flex"
        if static_shapes is None:
            static_shapes = use_flex and device.type == "cuda"
        Tp, Np = static_shape(T, N, cfg.num_anchors) if static_shapes else (T, N)
        ctx = F.pad(self._fuse(batch.features), (0, 0, 0, Tp - T))
        cos_c, sin_c = self.rotary_emb(ctx, torch.arange(Tp, device=ctx.device).expand(B, Tp))
        pad_n = (0, 0, 0, Np - N)
        x = self._embed(F.pad(blocks.input_ids, pad_n, value=cfg.mask_token_id).view(B, Np * S))
        cos_q, sin_q = self.rotary_emb(x, F.pad(blocks.positions, pad_n).view(B, Np * S))
        mask = (flex_block_mask if use_flex else dense_block_mask)(F.pad(blocks.anchors, (0, Np - N)), Tp, S)
        for layer in self.layers:
            ck, cv = self._context_kv(layer, ctx, cos_c, sin_c)
            x = self._block_layer(layer, x, ck, cv, cos_q, sin_q, mask)
        h = self.norm(x).view(B, Np, S, -1)[:, :N, S - gamma:]
        u = None if self.markov_head is None else self.markov_head.features(blocks.prev_ids, h)
        conf = self.confidence(h, blocks.prev_ids)
        b, n, k = blocks.valid.nonzero(as_tuple=True)
        return SupervisedSlots(
            hidden=h[b, n, k], bias_features=None if u is None else u[b, n, k],
            confidence_logits=None if conf is None else conf[b, n, k], labels=blocks.labels[b, n, k],
            slot=k, block=b * N + n, target_hidden=batch.last_hidden[blocks.target_rows[b, n, k]],
            num_blocks=B * N, block_size=gamma, prev_ids=blocks.prev_ids[b, n, k])

    def loss(self, slots: SupervisedSlots, config: LossConfig, group=None, reduce: bool = True) -> LossOutput:
        """:func:`training.losses.drafter_loss` with this drafter's frozen heads and Markov ``W2`` (the
        confidence label at ``config.confidence_sampling``)."""
        w2 = None if self.markov_head is None else self.markov_head.markov_w2.weight
        return drafter_loss(slots, lm_head=self.lm_head.weight, target_lm_head=self.target_lm_head_weight,
                            markov_w2=w2, draft_to_target=self.draft_to_target, config=config, group=group,
                            reduce=reduce, confidence_sampling=self.config.confidence_sampling)

    # -- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_context(self, features: torch.Tensor, context: DraftContext | None = None,
                       tokens: Sequence[int] | torch.Tensor = ()) -> DraftContext:
        """Append target features of the next positions to an inference context (or start one).

        Args:
            features: [n, n_ids*H] target features of positions ``L .. L+n-1`` (L = current length).
            context: the context so far, or None to start at position 0.
            tokens: not read (the next tokens an EAGLE-3 context needs,
                :meth:`training.eagle3.Eagle3Drafter.encode_context`; the decoding loop passes them to any drafter).
        Returns:
            a new :class:`DraftContext` of length L + n.
        """
        start = 0 if context is None else context.length
        ctx = self._fuse(features.unsqueeze(0))
        pos = torch.arange(start, start + features.shape[0], device=ctx.device).unsqueeze(0)
        cos, sin = self.rotary_emb(ctx, pos)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            k, v = self._context_kv(layer, ctx, cos, sin)
            if context is not None:
                k, v = torch.cat([context.keys[i], k], 2), torch.cat([context.values[i], v], 2)
            keys.append(k)
            values.append(v)
        return DraftContext(keys, values)

    @torch.no_grad()
    def draft_block(self, context: DraftContext, anchor_token: int | torch.Tensor, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> DraftResult:
        """Draft one block after ``context`` with the anchor token at position ``context.length``.

        One parallel backbone pass over ``[anchor, mask, ...]``, then the sequential head samples slot
        by slot (DSpark sec. 3.1): ``q_k = softmax((U_k + B_k(x_<k)) / T)``, ``x_k ~ q_k``.

        Args:
            context: cached context (positions ``0 .. L-1``). anchor_token: target id at position L.
            temperature: T >= 0 (0 = greedy, one-hot q). generator: on the model's device.
        Returns:
            :class:`DraftResult` with gamma tokens, q [gamma, V] and confidence logits.
        """
        cfg = self.config
        S, gamma, L = cfg.slots, cfg.block_size, context.length
        dev = self.fc.weight.device
        anchor = torch.as_tensor(anchor_token, device=dev).long().view(1)
        ids = torch.full((1, S), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        x = self._embed(ids)
        cos, sin = self.rotary_emb(x, torch.arange(L, L + S, device=dev).unsqueeze(0))
        for i, layer in enumerate(self.layers):
            x = self._block_layer(layer, x, context.keys[i], context.values[i], cos, sin, None)
        h = self.norm(x)[:, S - gamma:]
        base = h.to(self.lm_head.weight.dtype) @ self.lm_head.weight.t()
        tokens, q, prev = sample_sequential(base, h, anchor, self.markov_head, temperature, generator,
                                            self.draft_to_target)
        conf = self.confidence(h, prev)
        max_q = q.amax(-1) if temperature > 0 else self._unscaled_max_q(base, h, prev)
        if self.draft_to_target is not None:
            full = q.new_zeros(1, gamma, self.embed_tokens.num_embeddings)
            q = full.index_copy_(2, self.draft_to_target, q)
        head_in = None
        if conf is not None:
            head_in = h[0] if self.markov_head is None else torch.cat([h[0], self.markov_head.embed(prev[0]).to(h.dtype)], -1)
        return DraftResult(tokens[0], q[0], None if conf is None else conf[0], max_q[0].float(), head_in)

    def _unscaled_max_q(self, base: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``max softmax(U_k + B_k(x_<k))`` per slot [1, gamma]: the head's biases replayed on the drawn
        ``x_<k`` (``prev`` [1, gamma] target ids), as :func:`training.heads.sample_sequential` built them."""
        logits = base.float()
        if self.markov_head is not None:
            state, biases = None, []
            for k in range(base.shape[1]):
                u, state = self.markov_head.step(state, prev[:, k], h[:, k])
                biases.append(self.markov_head.bias(u).float())
            logits = logits + torch.stack(biases, 1)
        return torch.softmax(logits, dim=-1).amax(-1)
