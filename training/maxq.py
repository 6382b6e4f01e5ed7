"""The free acceptance estimator: a per-position calibrated function of the drafter's own ``max q``.

A drafter without a confidence head still says how sure it is: the largest probability of its
draft distribution at slot k, ``m_k = max_v q_k(v)``. The estimator (the form vLLM ships for
drafters without a head) maps it to a conditional acceptance by Platt scaling on its logit,
``c_k = sigmoid(a_k * logit(m_k) + b_k)`` (Platt 1999), one ``(a_k, b_k)`` per position, fitted by
minimising the weighted binary cross-entropy against the conditional label ``y_k`` with weight
``w_k = prod_{i<k} y_i`` (the probability, or the 0/1 indicator, that slot k is reached). With
realised 0/1 outcomes that is the ordinary logistic regression on the blocks that reached slot k;
with expected acceptances ``c*`` it is the same fit in expectation.
"""
from __future__ import annotations

import torch

__all__ = ["maxq_features", "fit_maxq", "apply_maxq"]

_EPS = 1e-6


def maxq_features(max_q: torch.Tensor) -> torch.Tensor:
    """``logit(max q)`` with ``max q`` clamped to ``[1e-6, 1 - 1e-6]``; float64, same shape."""
    return torch.logit(max_q.double().clamp(_EPS, 1 - _EPS))


def fit_maxq(max_q: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None, *,
             min_blocks: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit the per-position Platt parameters of the ``max q`` estimator (module docstring).

    Args:
        max_q: [N, gamma] float, the drafter's largest draft probability per slot, in (0, 1].
        y: [N, gamma] float in [0, 1], conditional acceptance labels (0/1 or ``c*_k``).
        valid: bool [N, gamma] or None; a row counts at k only if valid at every ``i <= k``.
        min_blocks: least reaching weight ``sum w_k`` to fit a position; a thinner position keeps the
            previous position's parameters (position 1: the identity, a = 1, b = 0).
    Returns:
        ``(a, b)``, each [gamma] float64.
    Raises:
        ValueError: shapes differ or labels / probabilities out of range.
    """
    if max_q.ndim != 2 or y.shape != max_q.shape:
        raise ValueError(f"max_q and labels must both be [N, gamma]; got {tuple(max_q.shape)} and {tuple(y.shape)}")
    valid = torch.ones_like(y, dtype=torch.bool) if valid is None else valid.bool()
    cum_valid = torch.cumprod(valid.long(), dim=1).bool()
    y64 = y.double()
    if ((y64[cum_valid] < 0) | (y64[cum_valid] > 1)).any() or ((max_q[cum_valid] <= 0) | (max_q[cum_valid] > 1)).any():
        raise ValueError("labels must lie in [0, 1] and max q in (0, 1] at valid positions")
    x = maxq_features(max_q)
    reach = torch.cumprod(torch.cat([torch.ones_like(y64[:, :1]), y64[:, :-1]], dim=1), dim=1)
    gamma = y.shape[1]
    a, b = torch.ones(gamma, dtype=torch.float64), torch.zeros(gamma, dtype=torch.float64)
    for k in range(gamma):
        rows = cum_valid[:, k]
        w = reach[rows, k]
        if float(w.sum()) < min_blocks:
            a[k], b[k] = (a[k - 1], b[k - 1]) if k else (1.0, 0.0)
            continue
        xk, yk = x[rows, k], y64[rows, k]
        params = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([params], lr=1.0, max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = (w * torch.nn.functional.binary_cross_entropy_with_logits(
                params[0] * xk + params[1], yk, reduction="none")).sum() / w.sum()
            loss.backward()
            return loss

        opt.step(closure)
        a[k], b[k] = params.detach()
    return a, b


def apply_maxq(max_q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Conditional acceptance ``sigmoid(a_k logit(max q_k) + b_k)``: [..., gamma] float64 in (0, 1)."""
    return torch.sigmoid(a.double() * maxq_features(max_q) + b.double())
