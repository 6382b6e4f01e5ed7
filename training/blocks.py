"""Training batch construction for the drafter: collation, anchor sampling, blocks, attention masks.

Terms (``docs/design.md`` section 2): an **anchor** ``a`` is a position whose token is known to
the drafter (the last verified token at inference); a **block** of ``gamma`` (block size) draft
tokens predicts positions ``a+1 .. a+gamma``. The block layout is a config value:

- ``sample_from_anchor=True`` (DSpark paper sec. 3.1 / DeepSpec): ``S = gamma`` slots
  ``[anchor, mask x (gamma-1)]`` at positions ``a .. a+gamma-1``; slot ``k`` predicts token ``a+k+1``.
- ``sample_from_anchor=False`` (DFlash, arXiv:2602.06036, method): ``S = gamma + 1`` slots
  ``[anchor, mask x gamma]`` at positions ``a .. a+gamma``; slot ``j >= 1`` predicts its own position ``a+j``.

In both layouts the drafted tokens are ``a+1 .. a+gamma``, so labels and the valid mask are indexed by
the **predicting slot** ``k = 0 .. gamma-1`` (the paper's 1-based position ``k+1``). A predicting
slot is supervised iff its label position is inside the sample and ``loss_mask[a+1 .. a+k+1]`` are
all 1 (a contiguous valid prefix: a draft after an unsupervised token is never verified).

Attention rule (DFlash paper, training: blocks at random anchors): the queries of a block see
context positions strictly before its anchor, all slots of their own block (bidirectionally) and
nothing of any other block, even when blocks overlap in the sequence.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["DraftBatch", "Blocks", "collate_samples", "anchor_candidates", "sample_anchors",
           "build_blocks", "block_mask_mod", "dense_block_mask", "flex_block_mask",
           "reference_block_mask", "static_shape", "IGNORE_LABEL", "FLEX_TILE", "MIN_CONTEXT_BUCKET"]

IGNORE_LABEL = -100
"""Label value at unsupervised predicting slots (same convention as ``F.cross_entropy``)."""


@dataclass
class DraftBatch:
    """A padded training batch of cached target samples.

    Attributes:
        input_ids: [B, T] int64 token ids, 0 after each sample's end.
        loss_mask: [B, T] bool, True where the token is supervised; False on padding.
        features: [B, T, L*H] target hidden states at ``target_layer_ids`` (cache dtype, e.g. bf16).
        last_hidden: [R, H] the samples' ``last_hidden`` rows concatenated in batch order (sample b's
            rows start at ``row_offsets[b]``); row j of a sample is the target's final hidden state at
            the j-th position t with ``loss_mask[t+1] == 1``.
        row_offsets: [B] int64 first row of each sample in ``last_hidden``.
        lengths: [B] int64 sample lengths in tokens.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    row_offsets: torch.Tensor
    lengths: torch.Tensor


def collate_samples(samples: Sequence[Mapping[str, torch.Tensor]]) -> DraftBatch:
    """Pad a list of cache samples (the cache contract) into one :class:`DraftBatch`.

    Args:
        samples: each with ``input_ids`` [T] int, ``loss_mask`` [T] uint8/bool, ``features``
            [T, L*H] and ``last_hidden`` [T_sup, H] where ``T_sup = loss_mask[1:].sum()``.
    Returns:
        the padded batch (see :class:`DraftBatch`); padding is token 0 with loss_mask False.
    Raises:
        ValueError: empty list, a missing key, inconsistent lengths, or a ``last_hidden`` row count
            that does not match ``loss_mask[1:].sum()`` (the cache shard and the loss mask disagree).
    """
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    keys = ("input_ids", "loss_mask", "features", "last_hidden")
    for i, s in enumerate(samples):
        missing = [k for k in keys if k not in s]
        if missing:
            raise ValueError(f"sample {i} lacks {missing}: pass cache samples with keys {list(keys)}")
        T = s["input_ids"].shape[0]
        if s["loss_mask"].shape != (T,) or s["features"].shape[0] != T:
            raise ValueError(f"sample {i}: input_ids [{T}], loss_mask {tuple(s['loss_mask'].shape)} and "
                             f"features {tuple(s['features'].shape)} must share the token dimension")
        n_sup = int(s["loss_mask"][1:].bool().sum())
        if s["last_hidden"].shape[0] != n_sup:
            raise ValueError(f"sample {i}: last_hidden has {s['last_hidden'].shape[0]} rows but "
                             f"loss_mask[1:] has {n_sup} supervised tokens; re-read the shard or rebuild "
                             "it with the current cache writer")
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.long)
    B, T = len(samples), int(lengths.max())
    first = samples[0]
    input_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    features = first["features"].new_zeros(B, T, first["features"].shape[1])
    for b, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        input_ids[b, :n] = s["input_ids"].long()
        loss_mask[b, :n] = s["loss_mask"].bool()
        features[b, :n] = s["features"]
    rows = torch.tensor([s["last_hidden"].shape[0] for s in samples], dtype=torch.long)
    row_offsets = torch.cumsum(rows, 0) - rows
    last_hidden = torch.cat([s["last_hidden"] for s in samples], dim=0)
    return DraftBatch(input_ids, loss_mask, features, last_hidden, row_offsets, lengths)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions that may be anchors: ``loss_mask[a] and loss_mask[a+1]`` (DSpark sec. 3.3, training).

    Args:
        loss_mask: [B, T] bool/uint8.
    Returns:
        [B, T] bool; the last position is never a candidate (it has no next token).
    """
    m = loss_mask.bool()
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``num_anchors`` distinct anchors per sample, uniformly among the candidates.

    The anchor count is ``N = max(1, min(num_anchors, largest candidate count in the batch))``;
    samples with fewer candidates are padded with dummy anchors (position 0, ``keep=False``) that
    the valid mask removes from every loss term.

    Args:
        loss_mask: [B, T] bool/uint8. num_anchors: the per-sample budget (recipe: 512).
        generator: a ``torch.Generator`` on ``loss_mask``'s device, for reproducible draws.
    Returns:
        anchors [B, N] int64 (increasing among kept entries, 0 for dummies) and keep [B, N] bool.
    Raises:
        ValueError: ``num_anchors < 1`` or ``loss_mask`` not [B >= 1, T >= 2].
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if loss_mask.ndim != 2 or loss_mask.shape[0] < 1 or loss_mask.shape[1] < 2:
        raise ValueError(f"loss_mask must be [B >= 1, T >= 2], got {tuple(loss_mask.shape)}")
    cand = anchor_candidates(loss_mask)
    B, T = cand.shape
    counts = cand.sum(dim=1)
    N = max(1, min(num_anchors, int(counts.max())))
    scores = torch.rand(B, T, generator=generator, device=cand.device)
    scores = torch.where(cand, scores, torch.full_like(scores, 2.0))
    chosen = scores.argsort(dim=1)[:, :N]
    keep = torch.arange(N, device=cand.device).unsqueeze(0) < counts.clamp(max=N).unsqueeze(1)
    big = torch.full_like(chosen, T + 1)
    anchors = torch.where(keep, chosen, big).sort(dim=1).values
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


@dataclass
class Blocks:
    """Draft blocks of one batch. B samples, N anchors, S slots, gamma predicting slots.

    Attributes:
        anchors: [B, N] int64 anchor positions (0 for dummies). keep: [B, N] bool, False for dummies.
        positions: [B, N, S] int64 RoPE positions ``anchor + slot``.
        input_ids: [B, N, S] int64 ``[anchor token, mask, ...]`` (all mask for a dummy block).
        labels: [B, N, gamma] int64 target id of the token each predicting slot drafts;
            ``IGNORE_LABEL`` where not valid.
        valid: [B, N, gamma] bool, the contiguous supervised prefix of each block.
        prev_ids: [B, N, gamma] int64 teacher-forced ``x_{k-1}`` for the sequential head (the anchor
            token for k = 0, then the true previous tokens); ``mask_token_id`` where not valid.
        target_rows: [B, N, gamma] int64 row of ``DraftBatch.last_hidden`` holding the target's final
            hidden state one position before the label (so ``softmax(lm_head(row))`` is ``p_t``);
            -1 where not valid.
        sample_from_anchor: the layout (see module docstring).
    """

    anchors: torch.Tensor
    keep: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    prev_ids: torch.Tensor
    target_rows: torch.Tensor
    sample_from_anchor: bool

    @property
    def slots(self) -> int:
        """Slots per block S (gamma or gamma + 1)."""
        return self.positions.shape[-1]


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 keep: torch.Tensor, *, block_size: int, sample_from_anchor: bool, mask_token_id: int
                 ) -> Blocks:
    """Lay out draft blocks, labels, the valid prefix mask and target rows for given anchors.

    Args:
        input_ids: [B, T] int. loss_mask: [B, T] bool/uint8 (False on padding).
        anchors: [B, N] int64 positions; keep: [B, N] bool (False = dummy anchor).
        block_size: gamma >= 1. sample_from_anchor: the layout. mask_token_id: the mask token id.
    Returns:
        :class:`Blocks`. Row numbering of ``target_rows`` follows :func:`collate_samples`
        (samples' ``last_hidden`` concatenated in batch order).
    Raises:
        ValueError: ``block_size < 1``, mismatched shapes, or a kept anchor outside ``[0, T-1)``.
    """
    if block_size < 1:
        raise ValueError(f"block_size (gamma) must be >= 1, got {block_size}")
    if input_ids.shape != loss_mask.shape or anchors.shape != keep.shape or anchors.shape[0] != input_ids.shape[0]:
        raise ValueError(f"shapes: input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)}, "
                         f"anchors {tuple(anchors.shape)}, keep {tuple(keep.shape)} must agree on [B, T] / [B, N]")
    B, T = input_ids.shape
    dev = input_ids.device
    if bool(((anchors < 0) | (anchors >= T - 1))[keep].any()):
        raise ValueError(f"kept anchors must lie in [0, {T - 1}) so that a next token exists")
    ids = input_ids.long()
    m = loss_mask.bool()
    S = block_size if sample_from_anchor else block_size + 1
    positions = anchors.unsqueeze(-1) + torch.arange(S, device=dev)
    anchor_tok = ids.gather(1, anchors)
    slot_ids = torch.full((B, anchors.shape[1], S), mask_token_id, dtype=torch.long, device=dev)
    slot_ids[:, :, 0] = torch.where(keep, anchor_tok, torch.full_like(anchor_tok, mask_token_id))
    label_pos = anchors.unsqueeze(-1) + torch.arange(1, block_size + 1, device=dev)
    safe = label_pos.clamp(max=T - 1).flatten(1)
    sup = m.gather(1, safe).view_as(label_pos) & (label_pos < T) & keep.unsqueeze(-1)
    valid = sup.long().cumprod(dim=-1).bool()
    labels = torch.where(valid, ids.gather(1, safe).view_as(label_pos), IGNORE_LABEL)
    prev_pos = (label_pos - 1).clamp(max=T - 1).flatten(1)
    prev = ids.gather(1, prev_pos).view_as(label_pos)
    prev_ids = torch.where(valid, prev, mask_token_id)
    # row of position t in its sample's last_hidden = (# of t' <= t with loss_mask[t'+1]) - 1
    nxt = torch.zeros_like(m, dtype=torch.long)
    nxt[:, :-1] = m[:, 1:].long()
    row_in_sample = nxt.cumsum(dim=1) - 1
    n_rows = nxt.sum(dim=1)
    offsets = torch.cumsum(n_rows, 0) - n_rows
    rows = row_in_sample.gather(1, prev_pos).view_as(label_pos) + offsets.view(B, 1, 1)
    target_rows = torch.where(valid, rows, -1)
    return Blocks(anchors, keep, positions, slot_ids, labels, valid, prev_ids, target_rows,
                  sample_from_anchor)


def block_mask_mod(anchors: torch.Tensor, context_len: int, slots: int
                   ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The attention rule as a flex-attention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Keys are ``[context (context_len) ; blocks (N * slots)]``, queries are the ``N * slots`` block
    slots. Query ``q`` of block ``n = q // slots`` sees context key ``kv < anchors[b, n]`` and block
    key ``kv`` iff ``(kv - context_len) // slots == n`` (DFlash paper, training mask). The function
    is elementwise, so it also evaluates on broadcast index tensors.
    """
    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // slots
        is_ctx = kv_idx < context_len
        same_block = (kv_idx - context_len) // slots == n
        return (is_ctx & (kv_idx < anchors[b, n])) | (~is_ctx & same_block)
    return mask_mod


def dense_block_mask(anchors: torch.Tensor, context_len: int, slots: int) -> torch.Tensor:
    """Dense boolean SDPA mask of :func:`block_mask_mod` (True = may attend).

    Args:
        anchors: [B, N] int64. context_len: T (keys before the blocks). slots: S per block.
    Returns:
        [B, 1, N*S, T + N*S] bool, broadcastable over heads for ``F.scaled_dot_product_attention``.
        Every row has at least its own block's slots, so no row is fully masked.
    """
    B, N = anchors.shape
    dev = anchors.device
    q = torch.arange(N * slots, device=dev).view(1, 1, -1, 1)
    kv = torch.arange(context_len + N * slots, device=dev).view(1, 1, 1, -1)
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    return block_mask_mod(anchors, context_len, slots)(b, None, q, kv)


FLEX_TILE = 128
"""Query and key tile of the flex-attention block mask (torch's default sparse block size)."""

MIN_CONTEXT_BUCKET = 512
"""Smallest padded context length of :func:`static_shape` (tokens)."""


def static_shape(context_len: int, num_blocks: int, num_anchors: int) -> tuple[int, int]:
    """The padded ``(T, N)`` a compiled flex-attention forward runs at, so that one compiled graph
    serves every micro-batch of a context bucket.

    ``T`` goes up to the next power of two, at least :data:`MIN_CONTEXT_BUCKET` (4 buckets up to the
    recipe's 4,096 tokens); ``N`` goes up to the configured ``num_anchors`` (the most
    :func:`sample_anchors` draws), or stays ``num_blocks`` when that is larger. Padded context
    positions are never attended (every anchor lies inside the sample) and padded blocks are
    dummies that attend only to their own slots and supervise nothing, so the loss and gradients
    are those of the unpadded shapes.

    Args:
        context_len: T of the batch (>= 1). num_blocks: N of the blocks (>= 1).
        num_anchors: the drafter's configured anchors per sample (:attr:`DrafterConfig.num_anchors`).
    Returns:
        ``(T_pad, N_pad)`` with ``T_pad >= context_len`` and ``N_pad >= num_blocks``.
    Raises:
        ValueError: a length below 1.
    """
    if min(context_len, num_blocks, num_anchors) < 1:
        raise ValueError(f"context_len, num_blocks and num_anchors must be >= 1, got {context_len}, "
                         f"{num_blocks}, {num_anchors}")
    return max(MIN_CONTEXT_BUCKET, 1 << (context_len - 1).bit_length()), max(num_blocks, num_anchors)


@functools.lru_cache(maxsize=32)
def _slot_tiles(context_len: int, num_blocks: int, slots: int, tile: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shape-only half of :func:`flex_block_mask`: which (query tile, key tile) pairs of the
    block-slot keys hold any / only visible entries ([Qt, Kt] bool each), built once per shape.

    Query tile ``i`` holds blocks ``n_lo .. n_hi`` (rows ``q // slots``), key tile ``j`` the block
    keys of blocks ``m_lo .. m_hi`` (``(kv - T) // slots``); a slot sees its own block only, so the
    pair has a visible entry iff the ranges overlap, and is full iff both are the same single block
    and both tiles are whole (torch pads a ragged last tile with masked entries).
    """
    Q, KV = num_blocks * slots, context_len + num_blocks * slots
    q0 = torch.arange(0, Q, tile, device=device)
    q1 = (q0 + tile).clamp(max=Q)
    k0 = torch.arange(0, KV, tile, device=device)
    k1 = (k0 + tile).clamp(max=KV)
    n_lo, n_hi = (q0 // slots)[:, None], ((q1 - 1) // slots)[:, None]
    m_lo, m_hi = (k0.clamp(min=context_len) - context_len) // slots, (k1 - 1 - context_len) // slots
    has_slots = k1 > context_len
    any_ = has_slots & (m_lo <= n_hi) & (n_lo <= m_hi)
    full = (any_ & (k0 >= context_len) & (n_lo == n_hi) & (m_lo == m_hi) & (m_lo == n_lo)
            & (q1 - q0 == tile)[:, None] & (k1 - k0 == tile))
    return any_, full


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, Qt, Kt] bool tile grid as flex's ``(num_blocks [B, 1, Qt], indices [B, 1, Qt, Kt])``
    int32, the listed key tiles first in increasing order (the layout ``create_block_mask`` makes)."""
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.unsqueeze(1), idx.unsqueeze(1)


def flex_block_mask(anchors: torch.Tensor, context_len: int, slots: int, tile: int = FLEX_TILE) -> BlockMask:
    """Flex-attention ``BlockMask`` of :func:`block_mask_mod` on ``anchors``' device (for GPU training),
    built from the anchors with tensor ops in O(B x Q/tile x KV/tile), not by evaluating the rule on
    every (query, key) pair as ``create_block_mask`` does (O(B x Q x KV): 4 s and +1 GB on a
    2-core CPU at the recipe's B = 4, 3,584 slots, 7,680 keys; this build: 0.05 s,
    ``bench/bench_attention.py``).

    A query tile sees a context key tile iff the tile starts before the largest anchor of the tile's
    blocks, and all of it iff it ends at or before the smallest; the block-slot tiles depend only
    on the shape (:func:`_slot_tiles`, cached). Partial tiles are evaluated with the rule itself,
    full tiles skip it. Equal to ``create_block_mask(block_mask_mod(...), B, None, N*S, T+N*S,
    BLOCK_SIZE=tile)`` tile for tile (``tests/unit/training/test_gpu_path_attention.py``).

    Args:
        anchors: [B, N] int64 anchor positions. context_len: T (keys before the blocks).
        slots: S per block. tile: query / key tile of the mask (flex's kernels expect 128).
    Returns:
        a ``BlockMask`` for queries [B, H, N*S] and keys [B, H, T + N*S] (shared over heads).
    """
    B, N = anchors.shape
    Q, KV = N * slots, context_len + N * slots
    slot_any, slot_full = _slot_tiles(context_len, N, slots, tile, anchors.device)
    Qt = slot_any.shape[0]
    # per query tile, the smallest / largest anchor of its rows; a ragged last tile gets 0s, which
    # keeps it from being full, as torch's padding of that tile with masked rows does
    rows = torch.nn.functional.pad(anchors.repeat_interleave(slots, dim=1), (0, Qt * tile - Q)).view(B, Qt, tile)
    lo, hi = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True).clamp(max=context_len)
    k0 = torch.arange(0, KV, tile, device=anchors.device)
    full = ((k0 + tile) <= lo.clamp(max=context_len)) | slot_full
    partial = ((k0 < hi) | slot_any) & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=tile,
                                    mask_mod=block_mask_mod(anchors, context_len, slots), seq_lengths=(Q, KV))


def reference_block_mask(anchors: torch.Tensor, context_len: int, slots: int) -> torch.Tensor:
    """Brute-force loop version of the attention rule, written independently for tests.

    Returns:
        [B, 1, N*S, T + N*S] bool, equal to :func:`dense_block_mask`.
    """
    B, N = anchors.shape
    out = torch.zeros(B, 1, N * slots, context_len + N * slots, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            a = int(anchors[b, n])
            for s in range(slots):
                q = n * slots + s
                for t in range(min(a, context_len)):
                    out[b, 0, q, t] = True
                for s2 in range(slots):
                    out[b, 0, q, context_len + n * slots + s2] = True
    return out
