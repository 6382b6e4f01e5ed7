"""Block construction, anchor sampling, collation and the block attention masks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from training.blocks import (IGNORE_LABEL, anchor_candidates, block_mask_mod, build_blocks,
                             collate_samples, dense_block_mask, flex_block_mask, reference_block_mask,
                             sample_anchors)

MASK = 999
# 16 tokens 100..115; supervised: 4..8 and 11..15
IDS16 = torch.arange(100, 116).unsqueeze(0)
LM16 = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.uint8)
ANCHORS = torch.tensor([[4, 7, 13, 0]])
KEEP = torch.tensor([[True, True, True, False]])
I = IGNORE_LABEL
LABELS = [[[105, 106, 107, 108], [108, I, I, I], [114, 115, I, I], [I, I, I, I]]]
VALID = [[[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]]
PREV = [[[104, 105, 106, 107], [107, MASK, MASK, MASK], [113, 114, MASK, MASK], [MASK] * 4]]
# last_hidden rows exist at t with loss_mask[t+1] = 1: t = 3..7 -> rows 0..4, t = 10..14 -> rows 5..9
ROWS = [[[1, 2, 3, 4], [4, -1, -1, -1], [8, 9, -1, -1], [-1] * 4]]


def _blocks(sample_from_anchor: bool):
    return build_blocks(IDS16, LM16, ANCHORS, KEEP, block_size=4, sample_from_anchor=sample_from_anchor,
                        mask_token_id=MASK)


def test_dspark_layout_16_tokens():
    b = _blocks(True)
    assert b.slots == 4
    assert b.positions.tolist() == [[[4, 5, 6, 7], [7, 8, 9, 10], [13, 14, 15, 16], [0, 1, 2, 3]]]
    assert b.input_ids.tolist() == [[[104, MASK, MASK, MASK], [107, MASK, MASK, MASK],
                                     [113, MASK, MASK, MASK], [MASK] * 4]]
    assert b.labels.tolist() == LABELS
    assert b.valid.int().tolist() == VALID
    assert b.prev_ids.tolist() == PREV
    assert b.target_rows.tolist() == ROWS


def test_dflash_layout_16_tokens():
    b = _blocks(False)
    assert b.slots == 5
    assert b.positions.tolist() == [[[4, 5, 6, 7, 8], [7, 8, 9, 10, 11], [13, 14, 15, 16, 17],
                                     [0, 1, 2, 3, 4]]]
    assert b.input_ids.tolist() == [[[104] + [MASK] * 4, [107] + [MASK] * 4, [113] + [MASK] * 4,
                                     [MASK] * 5]]
    # the drafted positions are a+1..a+gamma in both layouts, so labels / validity coincide
    assert b.labels.tolist() == LABELS
    assert b.valid.int().tolist() == VALID
    assert b.prev_ids.tolist() == PREV
    assert b.target_rows.tolist() == ROWS


def test_anchor_candidates_16_tokens():
    assert anchor_candidates(LM16).nonzero()[:, 1].tolist() == [4, 5, 6, 7, 11, 12, 13, 14]


def test_sample_anchors_subset_sorted_padded_and_reproducible():
    lm = torch.zeros(2, 16, dtype=torch.uint8)
    lm[0] = LM16[0]
    lm[1, 10:13] = 1  # candidates 10, 11
    a1, k1 = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    a2, k2 = sample_anchors(lm, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    assert a1.shape == (2, 5)
    assert k1.tolist() == [[True] * 5, [True, True, False, False, False]]
    kept0 = a1[0].tolist()
    assert kept0 == sorted(kept0) and len(set(kept0)) == 5
    assert set(kept0) <= {4, 5, 6, 7, 11, 12, 13, 14}
    assert a1[1].tolist() == [10, 11, 0, 0, 0]
    # a budget above the candidate count takes all candidates; N shrinks to the largest count
    a, k = sample_anchors(lm, 512, torch.Generator().manual_seed(0))
    assert a.tolist() == [[4, 5, 6, 7, 11, 12, 13, 14], [10, 11, 0, 0, 0, 0, 0, 0]]
    assert k.sum(1).tolist() == [8, 2]


def test_sample_anchors_without_candidates_gives_one_dummy():
    a, k = sample_anchors(torch.zeros(1, 6, dtype=torch.bool), 512)
    assert a.tolist() == [[0]] and k.tolist() == [[False]]
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(LM16, 0)


def test_build_blocks_rejects_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        build_blocks(IDS16, LM16, ANCHORS, KEEP, block_size=0, sample_from_anchor=True, mask_token_id=MASK)
    with pytest.raises(ValueError, match="kept anchors"):
        build_blocks(IDS16, LM16, torch.tensor([[15]]), torch.tensor([[True]]), block_size=2,
                     sample_from_anchor=True, mask_token_id=MASK)


def _sample(T, sup_from, H=3):
    lm = torch.zeros(T, dtype=torch.uint8)
    lm[sup_from:] = 1
    pos = torch.arange(T - 1)[lm[1:].bool()].float()  # a row "is" its position
    return dict(input_ids=torch.arange(T) + 10 * T, loss_mask=lm, features=torch.randn(T, 6),
                last_hidden=pos.unsqueeze(1).expand(-1, H).clone())


def test_collate_pads_and_target_rows_point_one_before_label():
    batch = collate_samples([_sample(12, 4), _sample(9, 2)])
    assert batch.input_ids.shape == (2, 12) and batch.lengths.tolist() == [12, 9]
    assert batch.row_offsets.tolist() == [0, 8]
    assert batch.loss_mask[1, 9:].tolist() == [False] * 3 and batch.input_ids[1, 9:].tolist() == [0] * 3
    anchors, keep = sample_anchors(batch.loss_mask, 512)
    b = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=3,
                     sample_from_anchor=True, mask_token_id=MASK)
    label_pos = anchors.unsqueeze(-1) + torch.arange(1, 4)
    got = batch.last_hidden[b.target_rows[b.valid], 0]
    assert torch.equal(got, (label_pos[b.valid] - 1).float())
    assert int(b.valid.sum()) == 7 * 3 - 3 + 6 * 3 - 3  # every block but the last 2 per sample is full


def test_collate_rejects_row_mismatch():
    s = _sample(8, 3)
    s["last_hidden"] = s["last_hidden"][:-1]
    with pytest.raises(ValueError, match=r"last_hidden has 4 rows but loss_mask\[1:\] has 5"):
        collate_samples([s])


def test_no_leak_mask_when_anchors_closer_than_block_size():
    # T = 6 context keys, anchors 2 and 3 (1 apart, gamma = 3): block 0 must not see position 2
    m = dense_block_mask(torch.tensor([[2, 3]]), 6, 3)[0, 0].int().tolist()
    c0, c1 = [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]
    own0, own1 = [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]
    assert m == [c0 + own0] * 3 + [c1 + own1] * 3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_and_flex_masks_equal_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    B, N, S, T = 2, 5, 4, 11
    anchors = torch.randint(0, T - 1, (B, N), generator=g)
    ref = reference_block_mask(anchors, T, S)
    assert torch.equal(dense_block_mask(anchors, T, S), ref)
    b = torch.arange(B).view(-1, 1, 1, 1)
    q, kv = torch.arange(N * S).view(1, 1, -1, 1), torch.arange(T + N * S).view(1, 1, 1, -1)
    assert torch.equal(block_mask_mod(anchors, T, S)(b, None, q, kv), ref)
    qs = torch.randn(B, 4, N * S, 8, generator=g)
    ks, vs = torch.randn(2, B, 2, T + N * S, 8, generator=g)
    want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=ref, enable_gqa=True)
    got = flex_attention(qs, ks, vs, block_mask=flex_block_mask(anchors, T, S), enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)
