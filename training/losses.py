"""DSpark drafter loss and metrics, with chunked target distributions and global normalisation.

DSpark paper sec. 3.3 (training objective, eq. 12), per supervised predicting slot k (1-based):

    L = sum_k w_k [ a_CE * CE(p_d,k, x_k) + a_TV * ||p_d,k - p_t,k||_1 + a_conf * BCE(c_k, c*_k) ] / W
    w_k = exp(-(k - 1) / lambda)          (position decay, DFlash paper training loss; DSpark sec. 3.3)
    c*_k = clamp(1 - 0.5 ||p_d,k - p_t,k||_1, 0, 1), detached
    W = sum of w_k over every supervised slot on every rank (all-reduced)

``c*_k = sum_v min(p_d, p_t)`` is the probability that speculative sampling accepts the draft at k
given an accepted prefix (Leviathan et al. 2023, Theorem 3.5), hence the confidence target. That
probability depends on the serving engine's sampling setting s (temperature, top-p, top-k): with
``confidence_sampling=s`` other than plain T = 1 the head's label is ``c*_k(s) = sum_v min(p_d^s, p_t^s)``
with both distributions taken at s by :func:`training.spec_sampling.temperature_probs` (T = 0:
``1[argmax p_d = argmax p_t]``, the greedy acceptance indicator; :func:`confidence_labels`), computed without gradient
in its own chunk loop (one more pair of vocabulary projections in the forward, none in the backward);
the CE and TV terms and ``c*`` of the metrics stay at T = 1.
``p_t`` is recomputed from the cached final hidden state with the frozen target ``lm_head``; both
``p_d`` and ``p_t`` are computed ``chunk_size`` slots at a time, so no tensor of size
(supervised slots x V) is ever alive, in forward or backward. Two ways to get the gradient
(``LossConfig.fused``):

- fused (default): the loss is linear in the per-slot CE and TV, so the forward computes, chunk by
  chunk, the closed-form gradient of ``a_CE w ce + a_TV w tv`` (divided by the global W, all-reduced
  before the chunk loop) with respect to the logits ``z = lm_head h + W2 u`` of each slot,

      d ce / d z = p_d - onehot(x)                      (zero for a slot without a label)
      d tv / d z = p_d * (s - <s, p_d>),   s = sign(p_d - p_t)

  (softmax Jacobian ``d p_v / d z_j = p_v (delta_vj - p_j)`` applied to ``-log p_x`` and to
  ``sum_v |p_v - t_v|``; ``sign(0) = 0`` as torch's ``abs``; the target mass outside a reduced draft
  vocabulary is a constant), and turns it at once into the gradients of ``hidden`` (``G lm_head``),
  of the Markov features ``u`` (``G W2``) and of ``W2`` (``G^T u``); the backward only scales them by
  the incoming gradient, so it does no vocabulary projection at all;
- checkpointed (``fused=False``): each chunk under activation checkpointing, whose backward
  recomputes both vocabulary projections and back-propagates through the softmax by autograd.

Because W is global, the returned ``loss`` is this rank's share: summed over ranks it equals the
loss of one rank holding all slots, whatever the world size. Engines that *average* gradients over
ranks (DDP, DeepSpeed) must back-propagate ``loss * world_size``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from training.blocks import IGNORE_LABEL
from training.draft_vocab import target_to_draft_ids
from training.spec_sampling import Sampling, temperature_probs

__all__ = ["LossConfig", "SupervisedSlots", "LossOutput", "metrics_from_stats", "conditional_acceptance",
           "confidence_labels", "position_weights", "expected_tau", "drafter_loss"]


@dataclass
class LossConfig:
    """Loss weights (recipe defaults from ``docs/design.md`` sec. 2).

    Attributes:
        ce_weight: a_CE. tv_weight: a_TV. confidence_weight: a_conf (ignored without a confidence head).
        decay_lambda: lambda of ``w_k = exp(-(k-1)/lambda)`` in slots; ``inf`` disables the decay.
        chunk_size: supervised slots per chunk when computing ``p_d`` / ``p_t`` (memory ~ chunk x V).
        fused: compute the logit gradients in the forward, in closed form (module docstring; needs
            frozen ``lm_head`` / ``target_lm_head``); False = the checkpointed autograd path.
    """

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    decay_lambda: float = 4.0
    chunk_size: int = 512
    fused: bool = True

    def __post_init__(self):
        if min(self.ce_weight, self.tv_weight, self.confidence_weight) < 0:
            raise ValueError("loss weights a_CE, a_TV, a_conf must be >= 0")
        if not self.decay_lambda > 0:
            raise ValueError(f"decay_lambda must be > 0 (inf = no decay), got {self.decay_lambda}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")


@dataclass
class SupervisedSlots:
    """What the drafter hands to the loss: its M supervised predicting slots, flattened.

    Attributes:
        hidden: [M, H] backbone output after the final norm (input of ``lm_head``).
        bias_features: [M, r] sequential-head features ``u_k`` (bias ``W2 u_k``) or None (DFlash).
        confidence_logits: [M] float32 or None (no confidence head).
        labels: [M] int64 target ids of the drafted tokens.
        slot: [M] int64 0-based predicting slot (``k - 1``).
        block: [M] int64 flat block index in ``[0, num_blocks)``.
        target_hidden: [M, H] the target's final hidden state one position before each label.
        num_blocks: blocks in the batch (B * N). block_size: gamma.
        prev_ids: [M] int64 the teacher-forced ``x_{k-1}`` each slot's head was fed (the anchor at the
            first predicting slot), or None; the block-level evaluation redraws later slots from it.
    """

    hidden: torch.Tensor
    bias_features: torch.Tensor | None
    confidence_logits: torch.Tensor | None
    labels: torch.Tensor
    slot: torch.Tensor
    block: torch.Tensor
    target_hidden: torch.Tensor
    num_blocks: int
    block_size: int
    prev_ids: torch.Tensor | None = None


@dataclass
class LossOutput:
    """Result of :func:`drafter_loss`.

    Attributes:
        loss: scalar, this rank's share of the global loss (differentiable).
        c_star: [M] float32 detached ``c*`` of the local slots.
        metrics: detached global (all-reduced) values: ``loss``, ``ce``, ``tv``, ``confidence_bce``
            (each normalised by W), ``acceptance_per_position`` [gamma] (mean ``c*`` per slot, NaN
            where no slot), ``tau_expected``, ``confidence_error`` (mean ``|sigmoid(c) - label|``, the head's label, NaN
            without a head), ``supervised_slots``, ``weight_sum`` (W).
        stats: the summed statistics behind ``metrics`` (see :func:`metrics_from_stats`).
    """

    loss: torch.Tensor
    c_star: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: torch.Tensor | None = None


def metrics_from_stats(stats: torch.Tensor, gamma: int, config: LossConfig, *, has_confidence: bool
                       ) -> dict[str, torch.Tensor]:
    """The metrics of :class:`LossOutput` from summed statistics (one batch, or many added up).

    Args:
        stats: [8 + 2 gamma] float32: ``W``, the weighted sums of CE, TV and BCE, the summed
            ``|sigmoid(c) - c*|``, supervised slots, the summed block ``tau_expected``, blocks, then
            per slot the summed ``c*`` and the slot counts (``LossOutput.stats``).
        gamma: block size. config: the loss weights. has_confidence: a confidence head exists.
    Returns:
        the ``metrics`` dict documented in :class:`LossOutput`.
    """
    Wc = stats[0].clamp_min(1e-12)
    weights = (config.ce_weight, config.tv_weight, config.confidence_weight if has_confidence else 0.0)
    n_slots = stats[5]
    return {
        "loss": sum(a * n for a, n in zip(weights, stats[1:4])) / Wc,
        "ce": stats[1] / Wc, "tv": stats[2] / Wc, "confidence_bce": stats[3] / Wc,
        "acceptance_per_position": stats[8:8 + gamma] / stats[8 + gamma:],
        "tau_expected": stats[6] / stats[7],
        "confidence_error": stats[4] / n_slots if has_confidence else stats[4] * float("nan"),
        "supervised_slots": n_slots, "weight_sum": stats[0],
    }


def conditional_acceptance(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """``c* = clamp(1 - 0.5 ||p_d - p_t||_1, 0, 1)`` over the last dim (DSpark sec. 3.3; Leviathan
    et al. 2023 Thm. 3.5: the acceptance probability of one speculative-sampling step).

    Args:
        p_draft, p_target: [..., V] probability vectors.
    Returns:
        [...] float32 in [0, 1].
    """
    return (1 - 0.5 * (p_draft.float() - p_target.float()).abs().sum(-1)).clamp(0, 1)


@torch.no_grad()
def confidence_labels(hidden: torch.Tensor, u: torch.Tensor | None, target_hidden: torch.Tensor, *,
                      lm_head: torch.Tensor, markov_w2: torch.Tensor | None, target_lm_head: torch.Tensor,
                      draft_to_target: torch.Tensor | None, sampling: float | Sampling, chunk_size: int
                      ) -> torch.Tensor:
    """The confidence head's label at a sampling setting: ``c*_k = sum_v min(p_d^s, p_t^s)``, the
    probability that speculative sampling at setting s accepts the draft at k given an accepted prefix
    (Leviathan et al. 2023, Thm. 3.5; T = 0: ``1[argmax p_d = argmax p_t]``, first index on ties).

    ``p^s`` is :func:`training.spec_sampling.temperature_probs` of the logits at s (temperature, then
    top-k / top-p as vLLM; the decoding loop's one sampling function); with a reduced draft vocabulary the target's distribution is taken over
    the full vocabulary and read on the draft ids (mass outside them is never accepted). Computed
    ``chunk_size`` slots at a time without gradient.

    Args:
        hidden: [M, H] drafter slots after the final norm. u: [M, r] Markov features or None.
        target_hidden: [M, H] the target's final hidden state before each label.
        lm_head: [V_draft, H]. markov_w2: [V_draft, r] or None (with ``u``). target_lm_head: [V, H].
        draft_to_target: [V_draft] int64 or None. sampling: a temperature T >= 0 or a
            :class:`training.spec_sampling.Sampling`. chunk_size: slots per chunk >= 1.
    Returns:
        [M] float32 in [0, 1] (detached).
    Raises:
        ValueError: T negative or not finite (as ``temperature_probs``).
    """
    out = []
    for lo in range(0, hidden.shape[0], chunk_size):
        sl = slice(lo, lo + chunk_size)
        zd = _draft_logits(hidden[sl], None if u is None else u[sl], lm_head, markov_w2)
        zt = target_hidden[sl].to(target_lm_head.dtype) @ target_lm_head.t()
        p_t = temperature_probs(zt.to(zd.dtype), sampling)
        if draft_to_target is not None:
            p_t = p_t[:, draft_to_target]
        out.append(torch.minimum(temperature_probs(zd, sampling), p_t).sum(-1).float().clamp(0, 1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def position_weights(slot: torch.Tensor, decay_lambda: float) -> torch.Tensor:
    """``w_k = exp(-(k-1)/lambda)`` for 0-based slots ``k-1`` (DSpark sec. 3.3). Returns float32."""
    if math.isinf(decay_lambda):
        return torch.ones(slot.shape, dtype=torch.float32, device=slot.device)
    return torch.exp(-slot.float() / decay_lambda)


def expected_tau(c_star: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Expected acceptance length of blocks: ``tau = 1 + sum_j prod_{i<=j} c*_i`` (DSpark sec. 3.2:
    the survival ``a_j = prod_{i<=j} c_i`` summed over positions; the leading 1 is the bonus token),
    summing over each block's valid prefix only.

    Args:
        c_star: [..., gamma] in [0, 1]. valid: [..., gamma] bool, a prefix mask.
    Returns:
        [...] float32.
    """
    return 1 + (c_star.float() * valid).cumprod(dim=-1).sum(dim=-1)


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the training dtypes (bf16, fp16, fp32); float64 heads (tests) stay float64."""
    return torch.promote_types(dtype, torch.float32)


def _draft_logits(h, u, lm_head, w2):
    """``z = lm_head h (+ W2 u)`` of a chunk: ``h`` [m, H], ``u`` [m, r] | None -> [m, V_draft],
    projections in the weights' dtype, sum in :func:`_softmax_dtype`."""
    dt = _softmax_dtype(lm_head.dtype)
    logits = (h.to(lm_head.dtype) @ lm_head.t()).to(dt)
    if u is not None:
        logits = logits + (u.to(w2.dtype) @ w2.t()).to(dt)
    return logits


@torch.no_grad()
def _target_probs(th, target_lm_head, draft_ids):
    """``p_t`` of a chunk ``th`` [m, H] on the draft ids ([m, V_draft]) and the target mass outside them
    ([m], zeros for the full vocabulary)."""
    logits = th.to(target_lm_head.dtype) @ target_lm_head.t()
    p_t = torch.softmax(logits.to(_softmax_dtype(target_lm_head.dtype)), dim=-1)
    if draft_ids is None:
        return p_t, p_t.new_zeros(p_t.shape[0])
    p_t = p_t[:, draft_ids]
    return p_t, (1 - p_t.sum(-1)).clamp_min(0)


def _chunk_terms(h, u, th, lbl, has_lbl, lm_head, w2, target_lm_head, draft_ids):
    """CE and TV of one chunk by autograd: ``h`` [m, H], ``u`` [m, r] | None, ``th`` [m, H] -> ([m], [m])."""
    logp = torch.log_softmax(_draft_logits(h, u, lm_head, w2), dim=-1)
    ce = -logp.gather(-1, lbl.clamp_min(0).unsqueeze(-1)).squeeze(-1) * has_lbl
    p_t, outside = _target_probs(th, target_lm_head, draft_ids)
    tv = (logp.exp() - p_t).abs().sum(-1) + outside
    return ce, tv


def _checkpointed_terms(hidden, u, th, labels, has_lbl, lm_head, w2, target_lm_head, draft_ids, chunk_size):
    """Per-slot CE and TV ([M], [M]) chunk by chunk, under activation checkpointing when grad is on."""
    ce_parts, tv_parts = [], []
    use_ckpt = torch.is_grad_enabled()
    for lo in range(0, max(hidden.shape[0], 1), chunk_size):
        sl = slice(lo, lo + chunk_size)
        args = (hidden[sl], None if u is None else u[sl], th[sl], labels[sl], has_lbl[sl], lm_head, w2,
                target_lm_head, draft_ids)
        ce, tv = checkpoint(_chunk_terms, *args, use_reentrant=False) if use_ckpt else _chunk_terms(*args)
        ce_parts.append(ce)
        tv_parts.append(tv)
    return torch.cat(ce_parts), torch.cat(tv_parts)


def _fused_chunk(h, u, th, lbl, has_lbl, k_ce, k_tv, lm_head, w2, target_lm_head, draft_ids):
    """CE, TV and the logit gradient of one chunk.

    Args:
        h [m, H], u [m, r] | None, th [m, H], lbl [m] draft ids (clamped >= 0 here), has_lbl [m] 0/1;
        k_ce, k_tv: [m] coefficients of ``ce`` and ``tv`` in the loss (``a w / W``; ``k_ce = 0``
        where the slot has no label).
    Returns:
        ce [m], tv [m] and ``G = d(sum k_ce ce + k_tv tv) / dz`` [m, V_draft] in :func:`_softmax_dtype`:
        ``G = p (k_tv (s - <s, p>) + k_ce) - k_ce onehot(lbl)`` (module docstring), built in place
        in the buffer of ``s`` (``p`` reuses the log-softmax's, ``p - p_t`` the target's).
    """
    logp = torch.log_softmax(_draft_logits(h, u, lm_head, w2), dim=-1)
    lbl = lbl.clamp_min(0).unsqueeze(-1)
    ce = -logp.gather(-1, lbl).squeeze(-1) * has_lbl
    p = logp.exp_()
    p_t, outside = _target_probs(th, target_lm_head, draft_ids)
    d = p_t.neg_().add_(p)  # p - p_t
    s = d.sign()
    # plain sums (pairwise): CPU vector_norm / einsum accumulate 151,936 terms at ~1e-4 relative error
    tv = d.abs_().sum(-1) + outside
    s_dot_p = torch.mul(s, p, out=d).sum(-1)
    del d
    k_ce, k_tv = k_ce.to(p.dtype).unsqueeze(-1), k_tv.to(p.dtype).unsqueeze(-1)
    G = s.sub_(s_dot_p.unsqueeze(-1)).mul_(k_tv).add_(k_ce).mul_(p)
    return ce, tv, G.scatter_add_(-1, lbl, -k_ce)


class _FusedTerms(torch.autograd.Function):
    """``sum_m k_ce,m ce_m + k_tv,m tv_m`` whose forward also computes the gradients w.r.t. ``hidden``,
    ``u`` and ``W2`` (one chunk of slots at a time) and whose backward only scales them.

    forward(hidden [M, H], u [M, r] | None, w2 [V_draft, r] | None, th [M, H], labels [M] draft ids,
    has_lbl [M], k_ce [M], k_tv [M], lm_head [V_draft, H], target_lm_head [V, H], draft_ids [V_draft] | None,
    chunk_size) -> (scalar, ce [M], tv [M]); ``ce``/``tv`` are detached, in :func:`_softmax_dtype`.
    ``lm_head`` and ``target_lm_head`` get no gradient (frozen). ``d W2`` is accumulated over chunks in
    float32 (:func:`_softmax_dtype`) and cast to ``W2``'s dtype in backward.
    """

    @staticmethod
    def forward(ctx, hidden, u, w2, th, labels, has_lbl, k_ce, k_tv, lm_head, target_lm_head, draft_ids,
                chunk_size):
        need_h, need_u, need_w2 = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None
        g_u = torch.empty_like(u) if need_u else None
        g_w2 = torch.zeros(w2.shape, dtype=_softmax_dtype(w2.dtype), device=w2.device) if need_w2 else None
        ce_parts, tv_parts = [], []
        for lo in range(0, max(hidden.shape[0], 1), chunk_size):
            sl = slice(lo, lo + chunk_size)
            uc = None if u is None else u[sl]
            ce, tv, G = _fused_chunk(hidden[sl], uc, th[sl], labels[sl], has_lbl[sl], k_ce[sl], k_tv[sl],
                                     lm_head, w2, target_lm_head, draft_ids)
            ce_parts.append(ce)
            tv_parts.append(tv)
            if need_h:
                g_h[sl] = G.to(lm_head.dtype) @ lm_head
            if need_u or need_w2:
                Gw = G.to(w2.dtype)
                if need_u:
                    g_u[sl] = Gw @ w2
                if need_w2:
                    g_w2 += Gw.t() @ uc.to(w2.dtype)
            del G
        ce, tv = torch.cat(ce_parts), torch.cat(tv_parts)
        ctx.w2_dtype = None if w2 is None else w2.dtype
        ctx.save_for_backward(g_h, g_u, g_w2)
        ctx.mark_non_differentiable(ce, tv)
        return (k_ce.to(ce.dtype) * ce + k_tv.to(tv.dtype) * tv).sum(), ce, tv

    @staticmethod
    def backward(ctx, grad, _ce, _tv):
        g_h, g_u, g_w2 = ctx.saved_tensors
        return _scaled(g_h, grad), _scaled(g_u, grad), _scaled(g_w2, grad, ctx.w2_dtype), *[None] * 9


def _scaled(g, grad, dtype=None):
    """``g * grad`` computed in float32 (at least; ``grad``, e.g. world / accumulation under DeepSpeed, is
    no bf16 number) and returned in ``dtype`` (default ``g``'s); None stays None."""
    if g is None:
        return None
    return (g.to(_softmax_dtype(g.dtype)) * grad).to(dtype or g.dtype)


def _needs_grad(*tensors) -> bool:
    """Whether autograd is on and one of ``tensors`` (None allowed) requires a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def drafter_loss(slots: SupervisedSlots, *, lm_head: torch.Tensor, target_lm_head: torch.Tensor,
                 markov_w2: torch.Tensor | None, draft_to_target: torch.Tensor | None,
                 config: LossConfig, group=None, reduce: bool = True,
                 confidence_sampling: float | Sampling = 1.0) -> LossOutput:
    """The DSpark loss of this rank's supervised slots, normalised by the global weight sum.

    Formula and sources in the module docstring. With a reduced draft vocabulary (EAGLE-3 style),
    ``p_d`` lives on the draft ids: the TV distance adds the target mass outside them, and CE skips
    slots whose label is not a draft id (they still count in W).

    Args:
        slots: the drafter's supervised slots (see :class:`SupervisedSlots`).
        lm_head: [V_draft, H] the drafter's frozen output head. target_lm_head: [V, H] the target's.
        markov_w2: [V_draft, r] or None; required iff ``slots.bias_features`` is given.
        draft_to_target: [V_draft] int64 target id of each draft id, or None (full vocabulary).
        config: weights, lambda, chunk size, fused or checkpointed gradient. group: process group for
            the all-reduces (default world).
        reduce: all-reduce the statistics (training; the fused path with gradients also all-reduces W
            alone before its chunk loop); False keeps them local, for callers that sum them over many
            batches first and reduce once (:func:`metrics_from_stats`).
        confidence_sampling: the sampling setting (a temperature or a
            :class:`training.spec_sampling.Sampling` with top-p / top-k) of the confidence head's label
            (:func:`confidence_labels`); 1.0 (default) is the TV term's own ``c*``. ``LossOutput.c_star``
            and the ``acceptance`` / ``tau`` metrics stay at T = 1.
    Returns:
        :class:`LossOutput`; with no supervised slot anywhere the loss is 0 with zero gradients.
        Without autograd (``torch.no_grad`` or no input requiring grad) both paths compute the same
        plain chunked forward.
    Raises:
        ValueError: inconsistent shapes, a missing ``markov_w2``, or (fused) an ``lm_head`` /
            ``target_lm_head`` that requires grad.
    """
    M = slots.labels.shape[0]
    if (slots.bias_features is None) != (markov_w2 is None):
        raise ValueError("pass markov_w2 exactly when the slots carry bias_features (a sequential head)")
    for name in ("hidden", "target_hidden", "slot", "block"):
        if getattr(slots, name).shape[0] != M:
            raise ValueError(f"slots.{name} has {getattr(slots, name).shape[0]} rows, labels has {M}")
    dev = slots.hidden.device
    labels, has_lbl = slots.labels, (slots.labels != IGNORE_LABEL).float()
    if draft_to_target is not None:
        labels = target_to_draft_ids(draft_to_target, target_lm_head.shape[0])[labels.clamp_min(0)]
        has_lbl = has_lbl * (labels >= 0).float()
    w = position_weights(slots.slot, config.decay_lambda)
    fused_loss = None
    if config.fused and _needs_grad(slots.hidden, slots.bias_features, markov_w2):
        if lm_head.requires_grad or target_lm_head.requires_grad:
            raise ValueError("the fused loss gives lm_head / target_lm_head no gradient: freeze them "
                             "(requires_grad=False) or set LossConfig(fused=False)")
        W = w.sum()
        W = (_all_reduce(W.clone(), group) if reduce else W).clamp_min(1e-12).to(_softmax_dtype(lm_head.dtype))
        w_over_W = w.to(W.dtype) / W
        fused_loss, ce, tv = _FusedTerms.apply(
            slots.hidden, slots.bias_features, markov_w2, slots.target_hidden, labels, has_lbl,
            config.ce_weight * w_over_W * has_lbl, config.tv_weight * w_over_W, lm_head, target_lm_head,
            draft_to_target, config.chunk_size)
    else:
        ce, tv = _checkpointed_terms(slots.hidden, slots.bias_features, slots.target_hidden, labels, has_lbl,
                                     lm_head, markov_w2, target_lm_head, draft_to_target, config.chunk_size)
    c_star = (1 - 0.5 * tv.detach().float()).clamp(0, 1)
    nums = [(w * ce).sum(), (w * tv).sum()]
    conf = slots.confidence_logits
    if conf is not None:
        label = c_star if Sampling.of(confidence_sampling) == 1.0 else confidence_labels(
            slots.hidden, slots.bias_features, slots.target_hidden, lm_head=lm_head, markov_w2=markov_w2,
            target_lm_head=target_lm_head, draft_to_target=draft_to_target, sampling=confidence_sampling,
            chunk_size=config.chunk_size)
        bce = F.binary_cross_entropy_with_logits(conf.float(), label, reduction="none")
        nums.append((w * bce).sum())
    else:
        nums.append(ce.new_zeros(()))
    gamma = slots.block_size
    with torch.no_grad():
        grid = torch.zeros(slots.num_blocks, gamma, device=dev)
        grid_valid = torch.zeros(slots.num_blocks, gamma, dtype=torch.bool, device=dev)
        grid[slots.block, slots.slot] = c_star
        grid_valid[slots.block, slots.slot] = True
        has_block = grid_valid.any(-1)
        tau_sum = expected_tau(grid, grid_valid)[has_block].sum()
        err = (torch.sigmoid(conf.float()) - label).abs().sum() if conf is not None else c_star.new_zeros(())
        stats = torch.cat([torch.stack([w.sum(), *[n.detach() for n in nums], err, c_star.new_tensor(float(M)),
                                        tau_sum, has_block.sum().float()]),
                           grid.sum(0), grid_valid.sum(0).float()])
        if reduce:
            stats = _all_reduce(stats, group)
    W = stats[0]
    weights = (config.ce_weight, config.tv_weight, config.confidence_weight if conf is not None else 0.0)
    if fused_loss is None:
        loss = sum(a * n for a, n in zip(weights, nums)) / W.clamp_min(1e-12)
    else:
        loss = fused_loss + weights[2] * nums[2] / W.clamp_min(1e-12)
    metrics = metrics_from_stats(stats, gamma, config, has_confidence=conf is not None)
    return LossOutput(loss=loss, c_star=c_star, metrics=metrics, stats=stats)
