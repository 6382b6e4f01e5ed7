"""Optional reduced draft vocabulary, as the EAGLE-3 reference implementation does (Li et al. 2025):
the drafter's output head covers only the ``draft_vocab_size`` most frequent supervised target tokens.

The mapping is stored the way vLLM and EAGLE-3 checkpoints store it: ``d2t`` [V_draft] int64
*offsets*, ``target_id = i + d2t[i]`` for draft id ``i``; draft ids are the selected target ids in
increasing order, so ``d2t`` is non-decreasing and >= 0. The drafter keeps ``d2t`` as a persistent
buffer and refuses a checkpoint whose ``d2t`` differs, so the vocabulary stays fixed across resume.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["count_supervised_tokens", "build_d2t", "draft_to_target_ids", "target_to_draft_ids"]


def count_supervised_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
                            ) -> torch.Tensor:
    """Frequency of each target token among supervised tokens (the tokens the drafter must draft).

    Args:
        samples: pairs ``(input_ids [T] int, loss_mask [T] bool/uint8)``. vocab_size: V.
    Returns:
        [V] int64 counts.
    Raises:
        ValueError: a token id outside ``[0, V)``.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        sup = ids.long()[mask.bool()]
        if sup.numel() and (int(sup.min()) < 0 or int(sup.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}); check the tokenizer / vocab_size")
        counts += torch.bincount(sup, minlength=vocab_size)
    return counts


def build_d2t(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """``d2t`` offsets of the ``draft_vocab_size`` most frequent tokens (ties: lower id first).

    Args:
        counts: [V] non-negative token counts. draft_vocab_size: 1 <= V_draft <= V.
    Returns:
        [V_draft] int64 with ``arange(V_draft) + d2t`` = the selected target ids, increasing.
    Raises:
        ValueError: ``draft_vocab_size`` out of range or counts not 1-D.
    """
    if counts.ndim != 1:
        raise ValueError(f"counts must be [V], got {tuple(counts.shape)}")
    V = counts.shape[0]
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in [1, {V}], got {draft_vocab_size}")
    order = torch.sort(-counts.long(), stable=True).indices[:draft_vocab_size]
    return order.sort().values - torch.arange(draft_vocab_size, device=counts.device)


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id: ``arange(V_draft) + d2t`` ([V_draft] int64)."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def target_to_draft_ids(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse map of ``draft_to_target`` [V_draft]: [V] int64 draft id of each target id, -1 where
    the token is not drafted."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_to_target.device)
    t2d[draft_to_target] = torch.arange(draft_to_target.shape[0], device=draft_to_target.device)
    return t2d
