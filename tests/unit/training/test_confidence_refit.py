"""On-policy refit of the confidence head (training.confidence_refit, calibrate's refit step, the head
that export ships and evaluate judges)."""
from __future__ import annotations

import pytest
import torch

from pipeline.drafters import apply_calibrated_head, head_digest, save_calibrated_head
from pipeline.errors import StaleStageOutputError
from training.confidence_refit import fit_logistic, fit_logistic_head, reached_rows


def test_reached_rows_keep_the_slots_a_round_reached_with_their_conditional_acceptance():
    """Round 0: 2 of 4 verified drafts accepted -> slots 0, 1 accepted, slot 2 rejected, slot 3 never
    reached. Round 1: 1 of 1 verified (a scheduler stopped after one) -> slot 0 only, accepted."""
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    got_x, y, rnd, slot = reached_rows(x, torch.tensor([2, 1]), torch.tensor([4, 1]))
    assert rnd.tolist() == [0, 0, 0, 1] and slot.tolist() == [0, 1, 2, 0]
    assert y.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert torch.equal(got_x, torch.stack([x[0, 0], x[0, 1], x[0, 2], x[1, 0]]))
    with pytest.raises(ValueError, match="head_inputs must be"):
        reached_rows(x[0], torch.tensor([1]), torch.tensor([1]))


def _toy(n: int, seed: int):
    """x ~ N(mu, diag(sd^2)) in 4 dims, y ~ Bernoulli(sigmoid(x w* + b*)): the right answer is known."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.tensor([1.5, -2.0, 0.0, 0.5], dtype=torch.float64), -0.3
    x = torch.randn(n, 4, generator=g, dtype=torch.float64) * torch.tensor([1.0, 0.5, 2.0, 3.0], dtype=torch.float64) \
        + torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    y = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(x @ w + b)).float()
    return x.float(), y, w, b


def test_logistic_fit_recovers_the_generating_weights_on_raw_features():
    x, y, w, b = _toy(40_000, 0)
    got_w, got_b = fit_logistic(x, y, l2=1e-6)
    assert torch.allclose(got_w, w, atol=0.06), got_w
    assert abs(float(got_b) - b) < 0.12, float(got_b)


def test_head_refit_beats_a_head_that_ranks_badly_and_keeps_the_heads_form():
    """The trained head's logits are noise (AUC ~0.5): the refit's held-out AUC is the true model's,
    its log loss lower; the weights come back as ``proj.weight`` [1, D], ``proj.bias`` [1]."""
    x, y, w, b = _toy(4_000, 1)
    group = torch.arange(4_000) % 40  # 40 "prompts"
    trained = torch.randn(4_000, generator=torch.Generator().manual_seed(2))
    fit = fit_logistic_head(x, y, group, trained)
    assert fit.weight.shape == (1, 4) and fit.bias.shape == (1,) and fit.weight.dtype == torch.float32
    assert fit.rows == 4_000 and fit.positives == int(y.sum())
    assert abs(fit.heldout_auc["trained"] - 0.5) < 0.05 and fit.heldout_auc["refit"] > 0.8
    held = group % 2 == 1
    from training.sts import auc
    assert fit.heldout_auc["refit"] == pytest.approx(auc(x[held].double() @ w + b, y[held] > 0.5), abs=0.01)
    assert fit.heldout_logloss["refit"] < fit.heldout_logloss["trained"] - 0.3
    with pytest.raises(ValueError, match="refit_prompts"):
        fit_logistic_head(x, torch.ones_like(y), group, trained)  # one class only


def test_a_refitted_head_round_trips_and_refuses_another_checkpoint(tmp_path):
    from training.heads import ConfidenceHead

    class M(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.confidence_head = ConfidenceHead(6)

    trained, other = M(0), M(1)
    w, b = torch.randn(1, 6), torch.randn(1)
    url = str(tmp_path / "calibrate" / "dspark" / "confidence_head.safetensors")
    assert not apply_calibrated_head(trained, url)  # nothing there yet: unchanged
    save_calibrated_head(url, w, b, head_digest(trained))
    with pytest.raises(StaleStageOutputError, match="rerun \\+stage=calibrate"):
        apply_calibrated_head(other, url)
    assert apply_calibrated_head(trained, url)
    assert torch.equal(trained.confidence_head.proj.weight, w) and torch.equal(trained.confidence_head.proj.bias, b)
