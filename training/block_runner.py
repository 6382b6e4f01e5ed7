"""Drafters on held-out cache blocks: teacher-forced logits, then paired speculative sampling.

:func:`block_logits` lays out one drafter's blocks at given anchors and returns, per block and
predicting slot, the draft logits (backbone + sequential-head bias on the true previous token,
DSpark sec. 3.1) and the target logits (frozen ``lm_head`` on the cached final hidden state).
:func:`evaluate_blocks` runs every drafter on the same anchors (drawn once per batch, independent
of the drafters' layouts and block sizes) and hands the logits to
:func:`training.block_eval.speculative_outcomes` with the same uniforms, so the comparison is paired.

One of the evaluation modules, each for one question: this one runs drafters on cache blocks;
:mod:`training.block_eval` the paired statistics; :mod:`training.validation` the learning curves.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from training.blocks import build_blocks, collate_samples, sample_anchors
from training.block_eval import PairedTally, block_uniforms, speculative_outcomes

__all__ = ["block_logits", "evaluate_blocks"]

BLOCK_EVAL_SEED = 104729  # anchors and uniforms of the block-level evaluation


@torch.no_grad()
def block_logits(model, batch, anchors: torch.Tensor, keep: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Teacher-forced draft and target logits of ``model``'s blocks at ``anchors``.

    Args:
        model: a :class:`training.drafter.Drafter` (eval mode). batch: a
            :class:`training.blocks.DraftBatch`. anchors, keep: [B, N] from ``sample_anchors``.
    Returns:
        ``q_logits`` [B*N, gamma, V] float32 over the full target vocabulary (``-inf`` outside a
        reduced draft vocabulary), ``p_logits`` [B*N, gamma, V] float32, ``valid`` [B*N, gamma] bool
        (each block's supervised prefix; all False for dummy anchors), ``confidence`` [B*N, gamma]
        float32 confidence logits (0 where not valid) or None without a confidence head.
    """
    cfg = model.config
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=cfg.block_size,
                          sample_from_anchor=cfg.sample_from_anchor, mask_token_id=cfg.mask_token_id)
    slots = model(batch, blocks)
    logits = slots.hidden @ model.lm_head.weight.t()
    if slots.bias_features is not None:
        logits = logits + slots.bias_features @ model.markov_head.markov_w2.weight.t()
    V = model.target_lm_head_weight.shape[0]
    if model.draft_to_target is not None:
        full = logits.new_full((logits.shape[0], V), float("-inf"))
        logits = full.index_copy_(1, model.draft_to_target, logits)
    target = slots.target_hidden.float() @ model.target_lm_head_weight.float().t()
    n_blocks, gamma = slots.num_blocks, cfg.block_size
    q = torch.zeros(n_blocks, gamma, V)
    p = torch.zeros(n_blocks, gamma, V)
    valid = torch.zeros(n_blocks, gamma, dtype=torch.bool)
    q[slots.block, slots.slot] = logits.float()
    p[slots.block, slots.slot] = target
    valid[slots.block, slots.slot] = True
    conf = None
    if slots.confidence_logits is not None:
        conf = torch.zeros(n_blocks, gamma)
        conf[slots.block, slots.slot] = slots.confidence_logits.float()
    return q, p, valid, conf


@torch.no_grad()
def evaluate_blocks(drafters: Mapping[str, torch.nn.Module], batches: Iterable[Sequence[Mapping]], *,
                    temperatures: Sequence[float], num_anchors: int, seed: int = BLOCK_EVAL_SEED,
                    tally: PairedTally | None = None, records: dict | None = None) -> PairedTally:
    """Paired block-level speculative sampling of every drafter on the same held-out blocks.

    Args:
        drafters: name -> drafter (any layouts and block sizes; one target).
        batches: lists of cache sample mappings (``training.data.as_mapping``).
        temperatures: T values (0 = greedy). num_anchors: anchors per sample (distinct, uniform
            over positions whose token and next token are supervised, as in training).
        seed: anchors and uniforms are a pure function of ``(seed, batch index)``.
        tally: add to this tally (e.g. drafters of an fp8 cache, fed the same samples of that cache:
            the anchors depend only on the loss masks and the seed, so the blocks stay paired).
        records: if given, ``records[(name, T)]`` collects per-block realised outcomes for the
            calibration on realised acceptance (:class:`pipeline.inference.realised.Outcomes` fields): lists of
            ``z`` [n, gamma] confidence logits (drafters with a head), ``max_q`` [n, gamma] (largest
            draft probability, of ``softmax(q_logits / T)``, at T = 0 of ``softmax(q_logits)``),
            ``accepted`` [n], ``verified`` [n] (valid prefix length) and ``group`` [n] (batch index).
    Returns:
        a :class:`training.block_eval.PairedTally` (summarise it with
        :func:`training.block_eval.summarise`).
    """
    tally = PairedTally() if tally is None else tally
    max_gamma = max(m.config.block_size for m in drafters.values())
    for model in drafters.values():
        model.eval()
    for i, samples in enumerate(batches):
        batch = collate_samples(samples)
        anchors, keep = sample_anchors(batch.loss_mask, num_anchors, torch.Generator().manual_seed(seed + i))
        kept = keep.flatten()
        u_draw, u_accept = block_uniforms(seed, i, int(kept.sum()), max_gamma)
        for name, model in drafters.items():
            q, p, valid, conf = block_logits(model, batch, anchors, keep)
            q, p, valid = q[kept], p[kept], valid[kept]
            g = model.config.block_size
            for T in temperatures:
                out = speculative_outcomes(q, p, valid, u_draw[:, :g], u_accept[:, :g], T)
                tally.add(name, T, out)
                if records is not None and conf is not None:
                    rec = records.setdefault((name, float(T)), {k: [] for k in ("z", "max_q", "accepted",
                                                                                "verified", "group")})
                    rec["z"].append(conf[kept])
                    rec["max_q"].append(torch.softmax(q / (T if T > 0 else 1.0), dim=-1).amax(-1))
                    rec["accepted"].append(out["accepted"].cpu())
                    rec["verified"].append(valid.sum(-1))
                    rec["group"].append(torch.full((int(kept.sum()),), i, dtype=torch.long))
    return tally
