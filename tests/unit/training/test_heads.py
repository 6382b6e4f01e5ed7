"""Sequential heads (Markov, gated, RNN), the confidence head and slot-by-slot sampling."""
from __future__ import annotations

import pytest
import torch

from training.spec_sampling import temperature_probs
from training.heads import (ConfidenceHead, ControlHead, GatedMarkovHead, MarkovHead, RNNHead,
                            build_sequential_head, sample_sequential)

V, VD, R, H, S = 40, 40, 6, 8, 5


def _head(cls, vd=VD, seed=0):
    torch.manual_seed(seed)
    head = cls(V, vd, R, H, S)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 1.0)
    return head


def test_markov_sampling_q_is_softmax_of_base_plus_bias_of_sampled_prefix():
    head = _head(MarkovHead)
    g = torch.Generator().manual_seed(5)
    base, hidden = torch.randn(3, S, V, generator=g), torch.randn(3, S, H, generator=g)
    anchor = torch.tensor([1, 2, 3])
    tokens, q, prev = sample_sequential(base, hidden, anchor, head, 0.7, torch.Generator().manual_seed(9))
    assert tokens.shape == (3, S) and q.shape == (3, S, V)
    assert torch.equal(prev[:, 0], anchor) and torch.equal(prev[:, 1:], tokens[:, :-1])
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    for b in range(3):
        x_prev = int(anchor[b])
        for k in range(S):
            want = torch.softmax((base[b, k] + w2 @ w1[x_prev]) / 0.7, dim=-1)
            assert torch.allclose(q[b, k], want, atol=1e-6)
            assert q[b, k, tokens[b, k]] > 0
            x_prev = int(tokens[b, k])
    again = sample_sequential(base, hidden, anchor, head, 0.7, torch.Generator().manual_seed(9))[0]
    assert torch.equal(again, tokens)


def test_control_head_uses_anchor_and_slot_vector_never_the_previous_token():
    """``u_k = W1[x_0] + e_k`` (reference formula), in teacher forcing and in slot-by-slot sampling."""
    head = _head(ControlHead)
    markov = _head(MarkovHead)
    assert sum(p.numel() for p in head.parameters()) == sum(p.numel() for p in markov.parameters()) + S * R
    g = torch.Generator().manual_seed(3)
    base, hidden = torch.randn(2, S, V, generator=g), torch.randn(2, S, H, generator=g)
    anchor = torch.tensor([4, 9])
    tokens, q, prev = sample_sequential(base, hidden, anchor, head, 0.9, torch.Generator().manual_seed(6))
    w1, w2, e = head.markov_w1.weight, head.markov_w2.weight, head.slot_embed.weight
    for b in range(2):
        for k in range(S):
            want = torch.softmax((base[b, k] + w2 @ (w1[anchor[b]] + e[k])) / 0.9, dim=-1)
            assert torch.allclose(q[b, k], want, atol=1e-6)
    other = prev.clone()
    other[:, 1:] = (other[:, 1:] + 1) % V  # change every previous token but the anchor
    assert torch.equal(head.features(prev, hidden), head.features(other, hidden))
    assert torch.allclose(head.features(prev, hidden)[1, 3], w1[9] + e[3])
    with pytest.raises(ValueError, match="block size"):
        ControlHead(V, VD, R, H, 0)


@pytest.mark.parametrize("cls", [MarkovHead, GatedMarkovHead, RNNHead, ControlHead])
def test_sampling_q_matches_teacher_forced_training_logits(cls):
    """Inference (slot by slot) and training (teacher forcing on the same prefix) give the same q."""
    head = _head(cls)
    g = torch.Generator().manual_seed(1)
    base, hidden = torch.randn(2, S, V, generator=g), torch.randn(2, S, H, generator=g)
    anchor = torch.tensor([7, 8])
    tokens, q, prev = sample_sequential(base, hidden, anchor, head, 1.3, torch.Generator().manual_seed(2))
    train_logits = base + head.bias(head.features(prev, hidden))
    assert torch.allclose(q, torch.softmax(train_logits / 1.3, dim=-1), atol=1e-6)


def test_greedy_gives_one_hot_argmax_chain():
    head = _head(GatedMarkovHead)
    g = torch.Generator().manual_seed(4)
    base, hidden = torch.randn(1, S, V, generator=g), torch.randn(1, S, H, generator=g)
    tokens, q, _ = sample_sequential(base, hidden, torch.tensor([0]), head, 0.0, None)
    assert torch.equal(q.sum(-1), torch.ones(1, S)) and torch.equal(q.max(-1).values, torch.ones(1, S))
    prev = 0
    for k in range(S):
        u, _ = head.step(None, torch.tensor([prev]), hidden[:, k])
        want = int((base[0, k] + head.bias(u)[0]).argmax())
        assert int(tokens[0, k]) == want
        prev = want


def test_no_head_slots_are_independent():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, S, V, generator=g)
    _, q, _ = sample_sequential(base, torch.zeros(1, S, H), torch.tensor([0]), None, 2.0, g)
    assert torch.allclose(q, torch.softmax(base / 2.0, -1), atol=1e-6)


def test_reduced_vocab_feeds_target_ids_to_w1():
    head = _head(MarkovHead, vd=4)
    draft_to_target = torch.tensor([3, 10, 11, 30])
    g = torch.Generator().manual_seed(3)
    base, hidden = torch.randn(1, S, 4, generator=g), torch.randn(1, S, H, generator=g)
    tokens, q, prev = sample_sequential(base, hidden, torch.tensor([5]), head, 1.0, g, draft_to_target)
    assert set(tokens.flatten().tolist()) <= {3, 10, 11, 30}
    assert q.shape == (1, S, 4) and torch.equal(prev[0, 1:], tokens[0, :-1])
    want = torch.softmax(base[0, 1] + head.markov_w2.weight @ head.markov_w1.weight[int(tokens[0, 0])], -1)
    assert torch.allclose(q[0, 1], want, atol=1e-6)


def test_rnn_state_carries_the_prefix_and_markov_does_not():
    hidden = torch.randn(1, S, H)
    prev = torch.randint(0, V, (1, S))
    changed = prev.clone()
    changed[0, 2] = (prev[0, 2] + 1) % V
    for cls, later_changes in ((MarkovHead, False), (GatedMarkovHead, False), (RNNHead, True)):
        head = _head(cls)
        a, b = head.features(prev, hidden), head.features(changed, hidden)
        assert torch.equal(a[0, :2], b[0, :2])
        assert not torch.allclose(a[0, 2], b[0, 2])
        assert (not torch.allclose(a[0, 3:], b[0, 3:])) == later_changes


def test_heads_have_vllm_names_and_shapes():
    head = build_sequential_head("markov", vocab_size=V, draft_vocab_size=VD - 8, rank=R, hidden_size=H)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == {
        "markov_w1.weight": (V, R), "markov_w2.weight": (VD - 8, R)}
    assert build_sequential_head("rnn", vocab_size=V, draft_vocab_size=V, rank=0, hidden_size=H) is None
    assert isinstance(build_sequential_head("gated", vocab_size=V, draft_vocab_size=V, rank=2, hidden_size=H),
                      GatedMarkovHead)
    with pytest.raises(ValueError, match="head_type"):
        build_sequential_head("lstm", vocab_size=V, draft_vocab_size=V, rank=2, hidden_size=H)
    with pytest.raises(ValueError, match="markov_rank"):
        build_sequential_head("markov", vocab_size=V, draft_vocab_size=V, rank=-1, hidden_size=H)


def test_confidence_head_is_one_linear_layer():
    head = ConfidenceHead(3 + 2)
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.0]]))
        head.proj.bias.fill_(0.25)
    logit = head(torch.tensor([[2.0, 1.0, 2.0]]), torch.tensor([[0.5, 9.0]]))
    assert logit.dtype == torch.float32 and logit.tolist() == [2.0 - 1.0 + 1.0 + 1.0 + 0.25]
    no_markov = ConfidenceHead(3)
    assert no_markov(torch.zeros(4, 7, 3), None).shape == (4, 7)
    assert tuple(head.state_dict()["proj.weight"].shape) == (1, 5)


def test_draft_distribution_rejects_negative_temperature():
    assert torch.equal(temperature_probs(torch.tensor([0.1, 3.0, 2.0]), 0.0), torch.tensor([0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="temperature"):
        temperature_probs(torch.zeros(3), -1.0)


def test_sampled_tokens_follow_q_empirically():
    """x_k ~ q_k: frequencies over 20000 blocks match q at slot 0 and, given x_0, at slot 1."""
    torch.manual_seed(0)
    head = MarkovHead(4, 4, 2, H)
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.tensor([[2.0, 0], [0, 2.0], [-2.0, 0], [0, -2.0]]))
        head.markov_w2.weight.copy_(torch.tensor([[1.0, 0], [0, 1.0], [-1.0, 0], [0, 0]]))
    n = 20000
    base = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(n, 2, 4)
    tokens, q, _ = sample_sequential(base, torch.zeros(n, 2, H), torch.full((n,), 3), head, 1.5,
                                     torch.Generator().manual_seed(11))
    freq0 = torch.bincount(tokens[:, 0], minlength=4) / n
    assert torch.allclose(freq0, q[0, 0], atol=4 * (0.25 / n) ** 0.5)
    for x0 in range(4):
        rows = tokens[:, 0] == x0
        freq1 = torch.bincount(tokens[rows, 1], minlength=4) / rows.sum()
        assert torch.allclose(freq1, q[rows][0, 1], atol=4 * (0.25 / rows.sum().item()) ** 0.5), x0
