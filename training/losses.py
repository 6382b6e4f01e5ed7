"""DSpark drafter loss and metrics, with chunked target distributions and global normalisation.

DSpark paper sec. 3.3 (training objective, eq. 12), per supervised predicting slot k (1-based):

    L = sum_k w_k [ a_CE * CE(p_d,k, x_k) + a_TV * ||p_d,k - p_t,k||_1 + a_conf * BCE(c_k, c*_k) ] / W
    w_k = exp(-(k - 1) / lambda)          (position decay, DFlash paper training loss; DSpark sec. 3.3)
    c*_k = clamp(1 - 0.5 ||p_d,k - p_t,k||_1, 0, 1), detached
    W = sum of w_k over every supervised slot on every rank (all-reduced)

``c*_k = sum_v min(p_d, p_t)`` is the probability that speculative sampling accepts the draft at k
given an accepted prefix (Leviathan et al. 2023, Theorem 3.5), hence the confidence target.
``p_t`` is recomputed from the cached final hidden state with the frozen target ``lm_head``; both
``p_d`` and ``p_t`` are computed ``chunk_size`` slots at a time under activation checkpointing, so
no tensor of size (supervised slots x V) is ever alive, in forward or backward.

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

__all__ = ["LossConfig", "SupervisedSlots", "LossOutput", "metrics_from_stats", "conditional_acceptance",
           "position_weights", "expected_tau", "drafter_loss"]


@dataclass
class LossConfig:
    """Loss weights (recipe defaults from ``docs/design.md`` sec. 2).

    Attributes:
        ce_weight: a_CE. tv_weight: a_TV. confidence_weight: a_conf (ignored without a confidence head).
        decay_lambda: lambda of ``w_k = exp(-(k-1)/lambda)`` in slots; ``inf`` disables the decay.
        chunk_size: supervised slots per chunk when computing ``p_d`` / ``p_t`` (memory ~ chunk x V).
    """

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    decay_lambda: float = 4.0
    chunk_size: int = 512

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


@dataclass
class LossOutput:
    """Result of :func:`drafter_loss`.

    Attributes:
        loss: scalar, this rank's share of the global loss (differentiable).
        c_star: [M] float32 detached ``c*`` of the local slots.
        metrics: detached global (all-reduced) values: ``loss``, ``ce``, ``tv``, ``confidence_bce``
            (each normalised by W), ``acceptance_per_position`` [gamma] (mean ``c*`` per slot, NaN
            where no slot), ``tau_expected``, ``confidence_error`` (mean ``|sigmoid(c) - c*|``, NaN
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


def _chunk_terms(h, u, th, lbl, has_lbl, lm_head, w2, target_lm_head, draft_ids):
    """CE and TV of one chunk: ``h`` [m, H], ``u`` [m, r] | None, ``th`` [m, H] -> ([m], [m]) float32."""
    logits = (h.to(lm_head.dtype) @ lm_head.t()).float()
    if u is not None:
        logits = logits + (u.to(w2.dtype) @ w2.t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(-1, lbl.clamp_min(0).unsqueeze(-1)).squeeze(-1) * has_lbl
    with torch.no_grad():
        p_t = torch.softmax((th.to(target_lm_head.dtype) @ target_lm_head.t()).float(), dim=-1)
        outside = torch.zeros_like(ce)
        if draft_ids is not None:
            p_t = p_t[:, draft_ids]
            outside = (1 - p_t.sum(-1)).clamp_min(0)
    tv = (logp.exp() - p_t).abs().sum(-1) + outside
    return ce, tv


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def drafter_loss(slots: SupervisedSlots, *, lm_head: torch.Tensor, target_lm_head: torch.Tensor,
                 markov_w2: torch.Tensor | None, draft_to_target: torch.Tensor | None,
                 config: LossConfig, group=None, reduce: bool = True) -> LossOutput:
    """The DSpark loss of this rank's supervised slots, normalised by the global weight sum.

    Formula and sources in the module docstring. With a reduced draft vocabulary (EAGLE-3 style),
    ``p_d`` lives on the draft ids: the TV distance adds the target mass outside them, and CE skips
    slots whose label is not a draft id (they still count in W).

    Args:
        slots: the drafter's supervised slots (see :class:`SupervisedSlots`).
        lm_head: [V_draft, H] the drafter's frozen output head. target_lm_head: [V, H] the target's.
        markov_w2: [V_draft, r] or None; required iff ``slots.bias_features`` is given.
        draft_to_target: [V_draft] int64 target id of each draft id, or None (full vocabulary).
        config: weights, lambda, chunk size. group: process group for the all-reduce (default world).
        reduce: all-reduce the statistics (training); False keeps them local, for callers that sum
            them over many batches first and reduce once (:func:`metrics_from_stats`).
    Returns:
        :class:`LossOutput`; with no supervised slot anywhere the loss is 0 with zero gradients.
    Raises:
        ValueError: inconsistent shapes or a missing ``markov_w2``.
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
    ce_parts, tv_parts = [], []
    use_ckpt = torch.is_grad_enabled()
    for lo in range(0, max(M, 1), config.chunk_size):
        sl = slice(lo, lo + config.chunk_size)
        u = None if slots.bias_features is None else slots.bias_features[sl]
        args = (slots.hidden[sl], u, slots.target_hidden[sl], labels[sl], has_lbl[sl], lm_head,
                markov_w2, target_lm_head, draft_to_target)
        ce, tv = checkpoint(_chunk_terms, *args, use_reentrant=False) if use_ckpt else _chunk_terms(*args)
        ce_parts.append(ce)
        tv_parts.append(tv)
    ce, tv = torch.cat(ce_parts), torch.cat(tv_parts)
    w = position_weights(slots.slot, config.decay_lambda)
    c_star = (1 - 0.5 * tv.detach()).clamp(0, 1)
    nums = [(w * ce).sum(), (w * tv).sum()]
    conf = slots.confidence_logits
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf.float(), c_star, reduction="none")
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
        err = (torch.sigmoid(conf.float()) - c_star).abs().sum() if conf is not None else c_star.new_zeros(())
        stats = torch.cat([torch.stack([w.sum(), *[n.detach() for n in nums], err, c_star.new_tensor(float(M)),
                                        tau_sum, has_block.sum().float()]),
                           grid.sum(0), grid_valid.sum(0).float()])
        if reduce:
            stats = _all_reduce(stats, group)
    W = stats[0]
    weights = (config.ce_weight, config.tv_weight, config.confidence_weight if conf is not None else 0.0)
    loss = sum(a * n for a, n in zip(weights, nums)) / W.clamp_min(1e-12)
    metrics = metrics_from_stats(stats, gamma, config, has_confidence=conf is not None)
    return LossOutput(loss=loss, c_star=c_star, metrics=metrics, stats=stats)
