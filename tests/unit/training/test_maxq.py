"""The max-q acceptance estimator: Platt parameters recovered from outcomes drawn from a known map."""
from __future__ import annotations

import pytest
import torch

from training.maxq import apply_maxq, fit_maxq


def test_recovers_known_platt_parameters_from_realised_outcomes():
    g = torch.Generator().manual_seed(0)
    n, a_true, b_true = 20_000, torch.tensor([0.8, 1.5], dtype=torch.float64), torch.tensor([0.5, -0.3], dtype=torch.float64)
    max_q = torch.rand(n, 2, generator=g, dtype=torch.float64) * 0.98 + 0.01
    c = apply_maxq(max_q, a_true, b_true)
    y = torch.bernoulli(c, generator=g)
    y[:, 1] *= y[:, 0]                       # prefix-closed: slot 2 only counts where slot 1 was accepted
    a, b = fit_maxq(max_q, y)
    assert torch.allclose(a, a_true, atol=0.1) and torch.allclose(b, b_true, atol=0.1), (a, b)


def test_thin_position_keeps_previous_parameters_and_errors():
    max_q = torch.full((50, 2), 0.5)
    a, b = fit_maxq(max_q, torch.ones(50, 2))
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [0.0, 0.0]     # 50 < min_blocks: identity
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fit_maxq(max_q, torch.full((50, 2), 2.0))
