"""Calibration on realised acceptance: estimators fitted on one split, scored and simulated on another."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.inference.realised import Outcomes, compare, format_tables, from_rounds, plot_reliability, recommendation
from pipeline.inference.scheduler import SPSCurve
from pipeline.inference.speculate import Decoded, Round


def _outcomes(n: int, seed: int, t_true: float = 2.0) -> Outcomes:
    """Blocks whose acceptance is ``sigmoid(z / t_true)`` (a head twice too sharp) and whose max q
    carries the same information: ``logit(max q) = z / t_true``."""
    g = torch.Generator().manual_seed(seed)
    gamma = 4
    z = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 2 + 1.5
    c = torch.sigmoid(z / t_true)
    acc = torch.bernoulli(c, generator=g).cumprod(1).sum(1).long()
    return Outcomes(z, c.clone(), acc, torch.full((n,), gamma), torch.arange(n) // 50)


def test_fitted_estimators_beat_the_raw_head_out_of_sample(tmp_path):
    fit, held = _outcomes(4_000, 0).split()
    sps = SPSCurve([1, 16, 64, 256, 1024], [300, 280, 200, 80, 20])
    cmp = compare(fit, {"held": held}, sps, concurrency=[1, 64], export_temperature=1.0, seed=0)
    est = cmp["estimators"]
    assert est["global T"]["T"][0] == pytest.approx(2.0, rel=0.1)
    assert est["STS"]["T"][0] == pytest.approx(2.0, rel=0.1)
    assert est["max-q"]["a"] == pytest.approx([1.0] * 4, abs=0.15)
    m = cmp["metrics"]["held"]
    for k in range(4):
        assert m["STS"][k]["ece_mass"] < m["raw"][k]["ece_mass"] and m["max-q"][k]["ece_mass"] < m["raw"][k]["ece_mass"]
    assert m["raw"][0]["auc"] == pytest.approx(m["STS"][0]["auc"])          # k = 1: a monotone map keeps the ranking
    assert m["export"] == m["raw"]                                         # export T = 1: the raw head
    sim = cmp["simulation"]
    assert sim["blocks"] == held.num_blocks and set(sim["best_fixed"]) == {"1", "64"}
    assert all(sim[e]["64"]["tokens_per_s"] > 0 for e in ("raw", "STS", "max-q"))
    # the oracle bound (the best plan knowing the outcomes) is above every estimator's policy, Algorithm 1 too
    assert set(sim["oracle"]) == {"1", "64"} and sim["oracle"]["64"] > 1.05
    assert all(sim[e][R][key] <= sim["oracle"][R] + 1e-12 for e in ("raw", "STS", "max-q", "export")
               for R in ("1", "64") for key in ("ratio", "ratio_algorithm1", "ratio_production"))
    json.dumps(cmp, allow_nan=False)
    text = format_tables("dspark", "T=1", cmp) + recommendation({"T=1": cmp}, "dspark", "runs/x/export/dspark")
    assert "| 64 |" in text and '"num_speculative_tokens": ' in text
    assert "oracle (bound) |" in text and f"| {sim['oracle']['64']:.3f} |" in text
    png = plot_reliability(str(tmp_path / "r.png"), {"raw": torch.sigmoid(held.z)}, held, "t")
    assert open(png, "rb").read()[:4] == b"\x89PNG"


def test_from_rounds_keeps_rounds_with_a_head():
    r = Round(3, 3, 1, [0.5, 0.1, -1.0], 0.0, 0.0, [0.9, 0.5, 0.4])
    o = from_rounds([Decoded([1], [r, Round(3, 3, 2, None, 0.0, 0.0, None)]), Decoded([2], [r])])
    assert o.num_blocks == 2 and o.group.tolist() == [0, 1] and o.accepted.tolist() == [1, 1]
    y, valid = o.labels()
    assert y[0].tolist() == [1.0, 0.0, 0.0] and bool(valid.all())
    with pytest.raises(ValueError, match="confidence head"):
        from_rounds([Decoded([1], [Round(3, 3, 2, None, 0.0, 0.0, None)])])


def test_adaptive_verification_runs_only_where_it_gained_on_the_calibration_rounds():
    """A head of pure noise (max q informative): Algorithm 1 alone loses ~5% to the best fixed block
    at R = 64 on the held-out rounds; it lost on the calibration rounds too, so the policy there is the
    fixed block (exactly 1.00x), while max q, which gains on both, stays adaptive."""
    g = torch.Generator().manual_seed(0)
    n, gamma = 4_000, 4
    c = torch.sigmoid((torch.randn(n, gamma, generator=g, dtype=torch.float64) * 2 + 1.5) / 2)
    acc = torch.bernoulli(c, generator=g).cumprod(1).sum(1).long()
    noise = torch.randn(n, gamma, generator=g, dtype=torch.float64)
    fit, held = Outcomes(noise, c.clone(), acc, torch.full((n,), gamma), torch.arange(n) // 50).split()
    sps = SPSCurve([1, 16, 64, 256, 1024], [300, 280, 200, 80, 20])
    sim = compare(fit, {"held": held}, sps, concurrency=[1, 64, 256], export_temperature=1.0, seed=0)["simulation"]
    for R in ("64", "256"):
        assert sim["raw"][R]["ratio_algorithm1"] < 0.97                    # the loss the gate prevents
        assert not sim["raw"][R]["adaptive"] and sim["raw"][R]["ratio"] == pytest.approx(1.0, abs=1e-12)
        assert sim["max-q"][R]["adaptive"] and sim["max-q"][R]["ratio"] > 1.02
    assert sim["adaptive"] == {"1": False, "64": True, "256": True}
    assert "| 64 | " in format_tables("dspark", "T=1", {"fit_blocks": fit.num_blocks, "estimators": {}, "metrics": {},
                                                        "simulation": sim})


def test_gate_rounds_are_used_only_with_the_head_that_scored_them(tmp_path, caplog):
    """calibrate's gate rounds round-trip through safetensors; evaluate takes them only when its head
    is the one that scored them (a head replaced since would be judged on another head's logits)."""
    from types import SimpleNamespace

    from pipeline.inference.realised import load_outcomes, save_outcomes
    from pipeline.stages.calibrate import gate_rounds_url
    from pipeline.stages.evaluate import gate_outcomes
    from storage import write_json

    cfg = SimpleNamespace(run_dir=str(tmp_path))
    data = _outcomes(60, 1)
    save_outcomes(gate_rounds_url(cfg, "dspark"), data)
    back = load_outcomes(gate_rounds_url(cfg, "dspark"))
    assert all(torch.equal(getattr(back, f), getattr(data, f)) for f in ("z", "max_q", "accepted", "verified", "group"))
    assert gate_outcomes(cfg, "dspark", "abc") is None                    # no calibrate report
    gate = {"prompts": 5, "rounds": 60, "full_blocks": 60, "sampling": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
            "head": "abc", "seconds": 1.0}
    write_json(str(tmp_path / "calibrate" / "dspark" / "report.json"), {"gate": gate})
    found, report = gate_outcomes(cfg, "dspark", "abc")
    assert report == gate and torch.equal(found.accepted, data.accepted)
    with caplog.at_level("WARNING"):
        assert gate_outcomes(cfg, "dspark", "def") is None
    assert "another confidence head" in caplog.text
    (tmp_path / "calibrate" / "dspark" / "gate_rounds.safetensors").unlink()  # a report naming rounds that are gone
    from pipeline.errors import MissingStageOutputError

    with pytest.raises(MissingStageOutputError, match="gate_rounds.safetensors.*rerun \\+stage=calibrate"):
        gate_outcomes(cfg, "dspark", "abc")
    write_json(str(tmp_path / "calibrate" / "dspark" / "report.json"), {"gate": {"skipped": "no prompt", "prompts": 0}})
    assert gate_outcomes(cfg, "dspark", "abc") is None
