"""On-policy refit of the confidence head (issue #36: the head trained on what the drafter drafts).

The head is one linear layer on ``x_k = [h_k ; W1[x_{k-1}]]`` (DSpark sec. 3.2.1,
:class:`training.heads.ConfidenceHead`), trained with the backbone on teacher-forced blocks and the
label ``c*_k`` (sec. 3.3). On the decoding loop it scores the drafter's *own* drafts: ``x_{k-1}`` is the
drafted (then accepted) token, the context is the target's own continuation, and what matters is the
realised acceptance ``1[accepted >= k]``. bench/bench_confidence.py measured that teacher forcing is
why the trained head ranks decoding rounds worse than the free max-q estimator; since the head's
inputs are detached (``confidence_grad_to_backbone=false``), refitting only the head on the drafter's
own rounds is a convex problem: weighted logistic regression of the realised acceptance of every
reached slot on ``x_k``.

Rows: slot k (0-based) of a round is *reached* when every earlier slot was accepted and it was
verified (``accepted >= k`` and ``k < verified``); its label is ``1[accepted > k]`` (accepted given
reached: the conditional acceptance whose product is the survival ``a_k``).

The fit (:func:`fit_logistic_head`): features standardised, an L2 penalty on the standardised weights
chosen from :data:`L2_GRID` by the held-out log loss of a fit on the even groups scored on the odd
groups (groups = prompts: rounds of one prompt are not independent), then refitted on every row at the
chosen penalty; LBFGS (strong Wolfe) in float64. The weights are mapped back to raw features so the
head keeps its form (``proj.weight`` [1, D], ``proj.bias`` [1]) and vLLM loads it unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["L2_GRID", "HeadFit", "reached_rows", "fit_logistic", "fit_logistic_head"]

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""L2 penalties tried (on standardised weights, per unit of mean log loss)."""


@dataclass(frozen=True)
class HeadFit:
    """A refitted confidence head.

    Attributes:
        weight: [1, D] float32, bias: [1] float32 (``ConfidenceHead.proj``'s parameters, raw features).
        l2: the chosen penalty. rows: reached slots fitted. positives: of them accepted.
        heldout_logloss: {"refit", "trained"} mean log loss on the odd groups of the even-group fit and
            of the trained head (nats). heldout_auc: {"refit", "trained"} pooled AUC on the odd groups.
        heldout_auc_by_part: the same per part (``fit_logistic_head(part=...)``; NaN where a part's odd
            rows hold one class only), or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    l2: float
    rows: int
    positives: int
    heldout_logloss: dict[str, float]
    heldout_auc: dict[str, float | None]
    heldout_auc_by_part: list[dict[str, float]] | None = None


def reached_rows(head_inputs: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reached slots of R rounds and their realised acceptance.

    Args:
        head_inputs: [R, gamma, D] the head's inputs ``[h_k ; W1[x_{k-1}]]`` of each round's slots.
        accepted: [R] int drafts accepted per round. verified: [R] int drafts verified per round.
    Returns:
        ``(x [n, D] float32, y [n] float32 in {0, 1}, round [n] int64, slot [n] int64)``: the reached
        slots (``accepted >= k``, ``k < verified``) in round-major order, labels ``1[accepted > k]``, each
        row's round and 0-based slot.
    Raises:
        ValueError: shapes that disagree.
    """
    if head_inputs.dim() != 3 or accepted.shape != verified.shape or accepted.shape[0] != head_inputs.shape[0]:
        raise ValueError(f"head_inputs must be [R, gamma, D] with accepted, verified [R]; got {tuple(head_inputs.shape)}, "
                         f"{tuple(accepted.shape)}, {tuple(verified.shape)}")
    k = torch.arange(head_inputs.shape[1])
    reached = (accepted[:, None] >= k) & (verified[:, None] > k)
    y = (accepted[:, None] > k).expand_as(reached)[reached].float()
    rounds, slots = reached.nonzero(as_tuple=True)
    return head_inputs[reached].float(), y, rounds, slots


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-penalised logistic regression: ``min sum_i w_i BCE(x_i w + b, y_i) / sum_i w_i + l2 |w * sd|^2``
    (the penalty on the standardised weights; ``sd`` the features' standard deviations), LBFGS in float64.

    Args:
        x: [n, D] float features. y: [n] float labels in [0, 1] (soft labels allowed). l2: penalty >= 0.
        weight: [n] row weights >= 0, or None (all 1).
    Returns:
        ``(w [D], b [])`` float64 on raw (unstandardised) features.
    """
    mu, sd = x.double().mean(0), x.double().std(0).clamp_min(1e-6)
    xs, y64 = (x.double() - mu) / sd, y.double()
    w64 = torch.ones_like(y64) if weight is None else weight.double()
    w64 = w64 / w64.sum()
    theta = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        bce = F.binary_cross_entropy_with_logits(xs @ theta[:-1] + theta[-1], y64, reduction="none")
        loss = (w64 * bce).sum() + l2 * theta[:-1].pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    th = theta.detach()
    w = th[:-1] / sd
    return w, th[-1] - (w * mu).sum()


def _logloss(z: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.binary_cross_entropy_with_logits(z.double(), y.double()))


def fit_logistic_head(x: torch.Tensor, y: torch.Tensor, group: torch.Tensor, trained_logits: torch.Tensor,
                      part: torch.Tensor | None = None) -> HeadFit:
    """Refit the confidence head on reached slots (module docstring: penalty chosen on held-out groups).

    Args:
        x: [n, D] head inputs. y: [n] realised acceptance (0/1). group: [n] int64 group per row (the
            prompt); even groups fit, odd groups judge the penalty and the comparison with the trained
            head. trained_logits: [n] the trained head's logits on the same rows. part: optional [n] int64
            index of each row's part (the sampling setting its round was decoded at, 0..P-1), for
            ``heldout_auc_by_part``; the fit and the adoption figures pool the parts.
    Returns:
        :class:`HeadFit` (weights fitted on every row at the chosen penalty).
    Raises:
        ValueError: no row of an even or of an odd group, or one class only among the rows (draft more
            rounds: ``calibrate.refit_prompts``).
    """
    from training.sts import auc

    fit, held = group % 2 == 0, group % 2 == 1
    if not fit.any() or not held.any() or y.min() == y.max():
        raise ValueError(f"the on-policy refit needs rounds of both even and odd prompts and both accepted and "
                         f"rejected slots (got {int(fit.sum())} / {int(held.sum())} rows, {int(y.sum())} accepted of "
                         f"{y.numel()}): raise calibrate.refit_prompts or refit_max_new_tokens")
    scored = {}
    for l2 in L2_GRID:
        w, b = fit_logistic(x[fit], y[fit], l2)
        scored[l2] = (_logloss(x[held].double() @ w + b, y[held]), x[held].double() @ w + b)
    best = min(scored, key=lambda l2: scored[l2][0])
    w, b = fit_logistic(x, y, best)
    pos, trained = y[held] > 0.5, trained_logits[held].double()
    by_part = None
    if part is not None:
        p = part[held]
        by_part = [{"refit": auc(scored[best][1][p == i], pos[p == i]), "trained": auc(trained[p == i], pos[p == i])}
                   for i in range(int(part.max()) + 1)]
    return HeadFit(weight=w.float()[None], bias=b.float().reshape(1), l2=best, rows=int(y.numel()),
                   positives=int(y.sum()),
                   heldout_logloss={"refit": scored[best][0], "trained": _logloss(trained_logits[held], y[held])},
                   heldout_auc={"refit": auc(scored[best][1], pos), "trained": auc(trained, pos)},
                   heldout_auc_by_part=by_part)
