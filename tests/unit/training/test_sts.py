"""Sequential temperature scaling: known answers, monotone ECE, left-to-right independence, report."""
from __future__ import annotations

import json
import math

import pytest
import torch

from training.sts import (T_MAX, apply_temperatures, at_bounds, auc, brier, calibration_report, ece,
                          ece_equal_mass, fit_global_temperature, fit_temperatures, foldable_temperature,
                          plot_reliability)

LOGIT_06 = math.log(0.6 / 0.4)


def _miscalibrated(n: int, gamma: int, t_true: list[float], seed: int, bernoulli: bool):
    """Logits ``T_true,k * logit(c_k)`` of true conditional acceptances c_k ~ U(0.05, 0.95)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(n, gamma, generator=g, dtype=torch.float64) * 0.9 + 0.05
    z = torch.logit(c) * torch.tensor(t_true, dtype=torch.float64)
    y = torch.bernoulli(c, generator=g) if bernoulli else c
    return z, y


def test_known_answer_ln9_vs_06_per_position():
    # position 1: logit ln 9 (confidence 0.9) while the true acceptance is 0.6 -> T_1 = ln 9 / logit(0.6);
    # position 2: logit ln 4 with true 0.6 given the calibrated position 1 -> T_2 = ln 4 / logit(0.6)
    n = 500
    z = torch.tensor([[math.log(9), math.log(4)]]).repeat(n, 1)
    y = torch.full((n, 2), 0.6)
    step = 0.05
    T = fit_temperatures(z, y, grid_step=step)
    assert abs(float(T[0]) - math.log(9) / LOGIT_06) < step       # 5.419...
    assert abs(float(T[1]) - math.log(4) / LOGIT_06) < step       # 3.419...
    # without refinement the coarse grid is still within one step
    T_coarse = fit_temperatures(z, y, grid_step=step, refine=False)
    assert abs(float(T_coarse[0]) - 5.419) < step


def test_calibrated_position_keeps_unit_temperature():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(10_000, 2, generator=g, dtype=torch.float64) * 1.5
    # expected-acceptance labels equal to the prediction: ECE is 0 only at T = 1
    assert fit_temperatures(z, torch.sigmoid(z)).tolist() == [1.0, 1.0]
    # realised 0/1 outcomes drawn from the prediction: position 1 stays near 1
    y = torch.bernoulli(torch.sigmoid(z), generator=g)
    assert abs(float(fit_temperatures(z, y)[0]) - 1.0) < 0.1


def test_recovers_overconfident_temperatures_from_expected_acceptance():
    z, y = _miscalibrated(5_000, 3, [2.0, 3.0, 0.5], seed=2, bernoulli=False)
    T = fit_temperatures(z, y, grid_step=0.05)
    assert torch.allclose(T, torch.tensor([2.0, 3.0, 0.5], dtype=torch.float64), atol=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ece_after_never_above_before(seed):
    z, y = _miscalibrated(4_000, 4, [2.5, 0.6, 1.0, 1.8], seed=seed, bernoulli=True)
    report = calibration_report(z, y, None, fit_temperatures(z, y), n_bins=10)
    for pos in report["positions"]:
        assert pos["after"]["ece"] <= pos["before"]["ece"] + 1e-12, pos
    assert report["positions"][0]["after"]["ece"] < 0.5 * report["positions"][0]["before"]["ece"]


def test_each_step_never_worse_than_unit_temperature_on_noise():
    # labels unrelated to the logits: the per-step guarantee (T_k = 1 is a candidate) still holds
    g = torch.Generator().manual_seed(5)
    z = torch.randn(3_000, 4, generator=g, dtype=torch.float64) * 3
    y = torch.rand(3_000, 4, generator=g, dtype=torch.float64)
    T = fit_temperatures(z, y, n_bins=8)
    cum = torch.cumprod(y, 1)
    for k in range(4):
        a_prev = torch.cumprod(torch.sigmoid(z[:, :k] / T[:k]), 1)[:, -1] if k else torch.ones(3_000)
        fitted = ece(a_prev * torch.sigmoid(z[:, k] / T[k]), cum[:, k], 8)
        unit = ece(a_prev * torch.sigmoid(z[:, k]), cum[:, k], 8)
        assert float(fitted) <= float(unit) + 1e-12


def test_fitting_position_k_never_changes_earlier_temperatures():
    z, y = _miscalibrated(3_000, 4, [2.0, 1.5, 0.7, 3.0], seed=7, bernoulli=True)
    T = fit_temperatures(z, y)
    assert torch.equal(fit_temperatures(z[:, :2], y[:, :2]), T[:2])
    g = torch.Generator().manual_seed(8)
    z2, y2 = z.clone(), y.clone()
    z2[:, 3] = torch.randn(3_000, generator=g, dtype=torch.float64) * 5
    y2[:, 3] = torch.rand(3_000, generator=g, dtype=torch.float64)
    T2 = fit_temperatures(z2, y2)
    assert torch.equal(T2[:3], T[:3])
    assert not torch.equal(T2[3], T[3])


def test_valid_mask_uses_prefix_validity():
    z, y = _miscalibrated(4_000, 3, [2.0, 0.8, 1.5], seed=9, bernoulli=True)
    valid = torch.ones_like(z, dtype=torch.bool)
    valid[:2_000, 1] = False                       # cut after position 1: positions 2 and 3 both drop
    T = fit_temperatures(z, y, valid)
    z_bad, y_bad = z.clone(), y.clone()
    z_bad[:2_000, 1:] = math.nan                   # values behind the cut are never read
    y_bad[:2_000, 1:] = 7.0
    assert torch.equal(fit_temperatures(z_bad, y_bad, valid), T)
    assert T[0] == fit_temperatures(z[:, :1], y[:, :1])[0]
    assert not torch.equal(T, fit_temperatures(z, y))   # the 2,000 cut rows did count when valid
    report = calibration_report(z_bad, y_bad, valid, T)
    assert [p["n"] for p in report["positions"]] == [4_000, 2_000, 2_000]


def _realised(n: int, t_true: list[float], seed: int):
    """0/1 acceptances drawn from ``sigmoid(z_k / T_true,k)``, z ~ N(1, 2^2): the head's logits are
    miscalibrated by exactly ``T_true``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(t_true), generator=g, dtype=torch.float64) * 2 + 1
    return z, torch.bernoulli(torch.sigmoid(z / torch.tensor(t_true, dtype=torch.float64)), generator=g)


def test_recovers_known_per_position_temperatures_from_realised_outcomes():
    t_true = [0.6, 1.5, 2.5, 0.8]
    z, y = _realised(20_000, t_true, seed=0)
    T = fit_temperatures(z, y)
    assert torch.allclose(T, torch.tensor(t_true, dtype=torch.float64), rtol=0.10), T
    assert at_bounds(T) == []


def test_thin_position_keeps_previous_temperature():
    z, y = _realised(4_000, [2.0, 0.5, 3.0], seed=1)
    valid = torch.ones_like(z, dtype=torch.bool)
    valid[150:, 2] = False                          # 150 blocks reach position 3 (< MIN_BLOCKS = 200)
    T = fit_temperatures(z, y, valid)
    assert T[2] == T[1] and abs(float(T[1]) - 0.5) < 0.1
    assert fit_temperatures(z, y, valid, min_blocks=100)[2] != T[1]
    assert fit_temperatures(z[:150], y[:150])[0] == 1.0   # position 1 too thin: T = 1


def test_brier_tie_break_keeps_a_flat_ece_from_running_to_the_bound():
    # conditional acceptance ~0.4 at every position with logits that barely vary: a_3 is nearly
    # constant, the ECE is flat in T_3 over a wide range and its arg-min is noise
    g = torch.Generator().manual_seed(4)
    z = torch.randn(3_000, 3, generator=g, dtype=torch.float64) * 0.05 - 0.4
    y = torch.bernoulli(torch.sigmoid(z), generator=g)
    T = fit_temperatures(z, y, t_max=20.0)
    assert at_bounds(T, t_max=20.0) == [] and float(T.max()) < 5


def test_global_temperature():
    z, y = _realised(20_000, [1.7] * 4, seed=2)
    assert fit_global_temperature(z, y) == pytest.approx(1.7, rel=0.05)
    c = torch.rand(3_000, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.9 + 0.05
    assert fit_global_temperature(2 * torch.logit(c), c) == pytest.approx(2.0, abs=0.011)
    assert at_bounds([1.0, T_MAX, 0.1]) == [2, 3]


def test_metric_reference_values():
    assert ece_equal_mass(torch.tensor([0.9, 0.1, 0.8, 0.2], dtype=torch.float64),
                          torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), 2) == pytest.approx(0.25)
    assert math.isnan(ece_equal_mass(torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)))
    conf = torch.tensor([0.1, 0.9], dtype=torch.float64)
    label = torch.tensor([0.0, 1.0], dtype=torch.float64)
    assert float(ece(conf, label, 10)) == pytest.approx(0.1)
    assert float(ece(conf, label, 1)) == pytest.approx(0.0)   # one bin: |mean conf - mean label|
    assert brier(conf, label) == pytest.approx(0.01)
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    assert auc(scores, torch.tensor([False, False, True, True])) == pytest.approx(0.75)
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([False, True])) == pytest.approx(0.5)
    assert math.isnan(auc(scores, torch.ones(4, dtype=torch.bool)))


def test_report_is_strict_json_with_one_class_auc_as_none():
    z = torch.tensor([[2.0, 1.0], [1.0, 0.5], [0.0, -1.0]])
    y = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    report = calibration_report(z, y, None, [1.0, 2.0], n_bins=5)
    json.dumps(report, allow_nan=False)
    assert report["temperatures"] == [1.0, 2.0]
    assert report["positions"][0]["before"]["auc"] is None   # all labels 1 at position 1
    assert report["positions"][1]["after"]["auc"] == pytest.approx(1.0)
    a1 = torch.sigmoid(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    assert report["positions"][0]["before"]["brier"] == pytest.approx(float(((a1 - 1) ** 2).mean()))


def test_apply_temperatures_and_fold_decision():
    z = torch.tensor([[2.0, 3.0, -1.0]])
    assert torch.allclose(apply_temperatures(z, [2.0, 1.5, 0.5]), torch.tensor([[1.0, 2.0, -2.0]]))
    with pytest.raises(ValueError, match="one temperature per position"):
        apply_temperatures(z, [1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        apply_temperatures(z, [1.0, 0.0, 1.0])
    assert foldable_temperature([1.0, 1.02, 0.99], rtol=0.05) == pytest.approx((1.02 * 0.99) ** (1 / 3))
    assert foldable_temperature([1.0, 1.2], rtol=0.05) is None
    assert foldable_temperature([1.0, 1.2], rtol=0.25) == pytest.approx(math.sqrt(1.2))
    with pytest.raises(ValueError, match="rtol"):
        foldable_temperature([1.0], rtol=-1)


def test_input_errors():
    z = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fit_temperatures(z, torch.full((4, 2), 1.5))
    with pytest.raises(ValueError, match=r"\[N, gamma\]"):
        fit_temperatures(z, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="t_min"):
        fit_temperatures(z, torch.zeros(4, 2), t_min=2.0, t_max=1.0)


def test_plot_reliability_writes_png(tmp_path):
    z, y = _miscalibrated(500, 3, [2.0, 1.0, 0.5], seed=3, bernoulli=True)
    T = fit_temperatures(z, y)
    out = plot_reliability(str(tmp_path / "rel.png"), z, y, None, T, n_bins=10)
    data = (tmp_path / "rel.png").read_bytes()
    assert out.endswith("rel.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
