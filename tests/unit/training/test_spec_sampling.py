"""Speculative sampling verification: greedy exactness, truncation, acceptance rate, input errors.

The distributional (chi-square) losslessness checks, with and without the scheduler's truncation,
live in tests/unit/pipeline/test_scheduler.py; the one at the serving setting (T=0.7, top-p 0.8, top-k 20) is here.
"""
from __future__ import annotations

import pickle

import pytest
import torch

from training.heads import sample_sequential
from training.spec_sampling import Sampling, temperature_probs, truncation_mask, verify_batch, verify_block

V = 6


def _one_hot(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_temperature_probs():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    assert torch.equal(temperature_probs(logits, 0.0), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(temperature_probs(logits, 1.0), torch.softmax(logits, -1))
    assert torch.allclose(temperature_probs(logits, 2.0), torch.softmax(logits / 2, -1))
    assert temperature_probs(logits.double(), 0.5).dtype == torch.float64
    with pytest.raises(ValueError, match="0 = greedy"):
        temperature_probs(logits, -0.1)


def test_greedy_rejects_at_first_mismatch_and_emits_target_argmax():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([3, 1, 2])
    q = _one_hot([3, 1, 2])
    p = _one_hot([3, 1, 5, 4])                     # target agrees on two, then wants 5
    tokens, n_acc = verify_block(draft, q, p, g)
    assert tokens.tolist() == [3, 1, 5] and n_acc == 2


def test_full_accept_emits_bonus_from_last_target_row():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([0, 4])
    q = _one_hot([0, 4])
    p = _one_hot([0, 4, 2])
    tokens, n_acc = verify_block(draft, q, p, g)
    assert tokens.tolist() == [0, 4, 2] and n_acc == 2


def test_truncated_verify_takes_bonus_from_p_l():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([0, 4, 1])
    q = _one_hot([0, 4, 1])
    p = _one_hot([0, 4, 3, 5])
    tokens, n_acc = verify_block(draft, q, p, g, verify_len=1)
    assert tokens.tolist() == [0, 4] and n_acc == 1
    tokens, n_acc = verify_block(draft, q, p, g, verify_len=2)
    assert tokens.tolist() == [0, 4, 3] and n_acc == 2
    tokens, n_acc = verify_block(draft, q, p, g, verify_len=0)
    assert tokens.tolist() == [0] and n_acc == 0


def test_batch_padding_and_lengths():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([[1, 2], [1, 2], [3, 3]])
    q = torch.stack([_one_hot([1, 2]), _one_hot([1, 2]), _one_hot([3, 3])])
    p = torch.stack([_one_hot([1, 2, 0]), _one_hot([1, 5, 0]), _one_hot([1, 2, 0])])
    emitted, n_acc = verify_batch(draft, q, p, g, torch.tensor([2, 2, 0]))
    assert emitted.tolist() == [[1, 2, 0], [1, 5, -1], [1, -1, -1]]
    assert n_acc.tolist() == [2, 1, 0]


def test_acceptance_rate_is_one_minus_total_variation():
    # P(accept d_1) = sum_x min(p(x), q(x)) (Leviathan et al. 2023, Sec. 3.1)
    g = torch.Generator().manual_seed(1)
    n = 40_000
    p1 = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.05, 0.05])
    q1 = torch.tensor([0.1, 0.2, 0.2, 0.2, 0.2, 0.1])
    draft = torch.multinomial(q1, n, replacement=True, generator=g).unsqueeze(1)
    p = torch.stack([p1, torch.full((V,), 1 / V)]).expand(n, 2, V)
    _, n_acc = verify_batch(draft, q1.expand(n, 1, V), p, g)
    alpha = float(torch.minimum(p1, q1).sum())     # 0.7
    sd = (alpha * (1 - alpha) / n) ** 0.5
    assert abs(float(n_acc.float().mean()) - alpha) < 5 * sd


def test_input_errors():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([3, 1])
    q = _one_hot([3, 2])                           # q gives draft token 1 zero probability
    p = _one_hot([3, 1, 0])
    with pytest.raises(ValueError, match="q_k\\(d_k\\) = 0"):
        verify_block(draft, q, p, g)
    with pytest.raises(ValueError, match="gamma\\+1 rows"):
        verify_block(draft, _one_hot([3, 1]), p[:2], g)
    with pytest.raises(ValueError, match="verify_len"):
        verify_block(draft, _one_hot([3, 1]), p, g, verify_len=3)
    with pytest.raises(ValueError, match="integer ids"):
        verify_block(torch.tensor([3, 9]), _one_hot([3, 1]), p, g)


def test_top_k_then_top_p_hand_values():
    # probabilities 0.5, 0.2, 0.15, 0.1, 0.05 at T = 1 (vLLM's order: temperature, top-k, top-p, renormalise)
    logits = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()
    nucleus = temperature_probs(logits, Sampling(1.0, top_p=0.8))    # mass above the 3rd is 0.7 < 0.8
    assert torch.allclose(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    both = temperature_probs(logits, Sampling(1.0, top_p=0.8, top_k=2))  # top-p on the renormalised top-2
    assert torch.allclose(both, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    assert torch.equal(temperature_probs(logits, Sampling(1.0, top_p=0.7, top_k=2)),
                       torch.tensor([1.0, 0, 0, 0, 0]))              # 5/7 >= 0.7: the 2nd goes
    sharp = temperature_probs(logits, Sampling(0.5, top_k=3))
    assert torch.allclose(sharp, torch.tensor([0.25, 0.04, 0.0225, 0, 0]) / 0.3125)
    assert truncation_mask(logits, 1.0) is None and Sampling(1.0) == 1.0 and Sampling(0.7, 0.8, 20) != 0.7
    s = Sampling(0.7, 0.8, 20)
    assert f"T={s:g}" == "T=0.7,p0.8,k20" and pickle.loads(pickle.dumps(s)) == s and s.top_k == 20
    for bad, match in (((0.7, 0.0), "top_p"), ((0.7, 1.0, -1), "top_k"), ((-1.0,), "temperature")):
        with pytest.raises(ValueError, match=match):
            Sampling(*bad)


def test_speculative_sampling_at_the_serving_setting_is_lossless():
    """Drafts from the drafter's sampler (Gumbel-max over top-k / top-p survivors) verified against
    the truncated target: the first emitted token follows the target's truncated p_1, the drafts
    follow the truncated q_1, and nothing outside either kept set is ever emitted or drafted."""
    from chisquare import chi_square_pvalue

    s, n, vocab = Sampling(0.7, 0.8, 20), 40_000, 40
    g = torch.Generator().manual_seed(5)
    target = 1.5 * torch.randn(3, vocab, generator=g)             # slots 1, 2 and the bonus row
    drafter = target[:2] + 0.8 * torch.randn(2, vocab, generator=g)
    tokens, q, _ = sample_sequential(drafter.expand(n, 2, vocab), torch.zeros(n, 2, 1),
                                     torch.zeros(n, dtype=torch.long), None, s, g)
    p = temperature_probs(target, s).double()
    q1 = temperature_probs(drafter[0], s).double()
    assert torch.allclose(q[0].double(), temperature_probs(drafter, s).double(), atol=1e-6)
    kept_p, kept_q = p[0] > 0, q1 > 0
    assert 3 <= int(kept_p.sum()) <= 20 and 3 <= int(kept_q.sum()) <= 20      # the truncation is real
    emitted, n_acc = verify_batch(tokens, q, p.float().expand(n, 3, vocab), g)
    for x, probs, kept in ((emitted[:, 0], p[0], kept_p), (tokens[:, 0], q1, kept_q)):
        counts = torch.bincount(x, minlength=vocab)
        assert int(counts[~kept].sum()) == 0
        assert chi_square_pvalue(counts[kept], probs[kept]) > 1e-3
    assert 0.1 < float(n_acc.float().mean()) < 1.9                   # drafts are both accepted and rejected


def test_truncation_mask_equals_a_full_sort_reference():
    """The top-k fast path keeps exactly the tokens a full descending sort keeps (distinct logits), for top-k,
    top-p and both, at the draft / target widths of the tests and the tiny target."""
    g = torch.Generator().manual_seed(11)
    for V in (40, 512, 3000):
        logits = 2.0 * torch.randn(64, V, generator=g, dtype=torch.float64)
        for s in (Sampling(0.7, 0.8, 20), Sampling(1.0, top_k=5), Sampling(0.5, top_p=0.9), Sampling(1.0, 0.3, 50)):
            z = logits / s.temperature
            srt, order = z.sort(dim=-1, descending=True)
            keep = torch.arange(V) < (s.top_k if 0 < s.top_k < V else V)
            probs = torch.softmax(srt.masked_fill(~keep, float("-inf")), -1)
            keep = keep & ((probs.cumsum(-1) - probs) < s.top_p)
            want = torch.zeros_like(keep.expand_as(z)).scatter(-1, order, keep.expand_as(z))
            got = truncation_mask(z, s)
            assert torch.equal(got, want), (V, s)
            assert int(got.sum(-1).max()) <= (s.top_k or V) and bool(got.any(-1).all())
