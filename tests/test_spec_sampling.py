"""Speculative sampling verification: greedy exactness, truncation, acceptance rate, input errors.

The distributional (chi-square) losslessness checks, with and without the scheduler's truncation,
live in tests/test_scheduler.py.
"""
from __future__ import annotations

import pytest
import torch

from training.spec_sampling import temperature_probs, verify_batch, verify_block

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
