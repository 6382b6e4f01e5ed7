"""Paired block-level speculative-sampling evaluator: hand cases, greedy, statistics, pairing, SEs."""
from __future__ import annotations

import math

import pytest
import torch

from training.block_eval import (block_uniforms, format_table, paired_ratio, PairedTally,
                                 speculative_outcomes, summarise)

# slot distributions of the hand case (V = 3, gamma = 3)
Q = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2]]
P = [[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]]


def _logits(rows, n):
    return torch.tensor(rows, dtype=torch.float64).log().expand(n, -1, -1).clone()


def test_hand_computed_blocks():
    q, p = _logits(Q, 4), _logits(P, 4)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # cdf(q) rows: [.5, .8, 1], [.1, .2, 1], [.4, .8, 1]; x = first index with cdf > u_draw
    u_draw = torch.tensor([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1], [0.45, 0.3, 0.1], [0.85, 0.15, 0.95]])
    u_acc = torch.tensor([[0.9, 0.2, 0.5], [0.9, 0.3, 0.5], [0.39, 0.0, 0.0], [0.99, 0.99, 0.99]])
    out = speculative_outcomes(q, p, valid, u_draw, u_acc, 1.0)
    assert out["tokens"].tolist() == [[1, 2, 0], [1, 2, 0], [0, 2, 0], [2, 1, 2]]
    # accept iff u * q(x) < p(x): block 0: .27<.5, .16<.2, .2>.1; block 1: .24>.2 at slot 1;
    # block 2: .195<.2 (slot 1 would accept but is not valid); block 3: p(x) >= q(x) everywhere
    assert out["accept"].tolist() == [[True, True, False], [True, False, False], [True, True, True],
                                      [True, True, True]]
    assert out["reached"].tolist() == [[True, True, True], [True, True, False], [True, False, False],
                                       [True, True, True]]
    assert out["accepted_at"].tolist() == [[True, True, False], [True, False, False],
                                           [True, False, False], [True, True, True]]
    assert out["accepted"].tolist() == [2, 1, 1, 3]
    assert out["tau"].tolist() == [3.0, 2.0, 2.0, 4.0]
    c = [0.2 + 0.3 + 0.2, 0.1 + 0.1 + 0.2, 0.1 + 0.1 + 0.2]  # sum_v min(p, q) = 0.7, 0.4, 0.4
    expect_c = torch.tensor([c, c, [c[0], 0, 0], c], dtype=torch.float64)
    assert torch.allclose(out["c_star"], expect_c, atol=1e-6)
    full = 1 + c[0] + c[0] * c[1] + c[0] * c[1] * c[2]  # 2.092
    assert out["tau_expected"].tolist() == pytest.approx([full, full, 1.7, full], abs=1e-6)
    h = -sum(x * math.log(x) for x in P[0])  # 1.0297 nats
    assert out["target_entropy"].tolist() == pytest.approx([h] * 4, abs=1e-6)


def test_temperature_scales_both_distributions():
    q, p = _logits(Q, 1), _logits(P, 1)
    u = torch.zeros(1, 3)
    out = speculative_outcomes(q, p, torch.ones(1, 3, dtype=torch.bool), u, u, 0.5)
    # T = 0.5 squares the probabilities: q ~ [.25, .09, .04], p ~ [.04, .25, .09], both / 0.38
    assert out["c_star"][0, 0].item() == pytest.approx((0.04 + 0.09 + 0.04) / 0.38, abs=1e-6)
    pt = torch.tensor([0.04, 0.25, 0.09]) / 0.38
    assert out["target_entropy"].item() == pytest.approx(float(-(pt * pt.log()).sum()), abs=1e-6)


def test_greedy_acceptance_and_short_prefix():
    def onehot(idx, V=4):
        return torch.nn.functional.one_hot(torch.tensor(idx), V).double() * 3.0

    q = onehot([[0, 1, 2], [1, 1, 1], [2, 0, 0]])
    p = onehot([[0, 1, 0], [1, 1, 1], [0, 0, 0]])
    valid = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    u1, u2 = block_uniforms(0, 0, 3, 3), block_uniforms(5, 9, 3, 3)
    out = speculative_outcomes(q, p, valid, *u1, 0.0)
    assert out["tokens"].tolist() == [[0, 1, 2], [1, 1, 1], [2, 0, 0]]
    assert out["accepted"].tolist() == [2, 1, 0]  # block 1 matches everywhere but stops at its prefix
    assert out["tau"].tolist() == [3.0, 2.0, 1.0]
    assert out["reached"].tolist() == [[True] * 3, [True, False, False], [True, False, False]]
    assert out["c_star"].tolist() == [[1, 1, 0], [1, 0, 0], [0, 1, 1]]  # 0 only where not valid
    assert out["tau_expected"].tolist() == [3.0, 2.0, 1.0]
    ent = -(torch.softmax(p[:, 0], -1) * torch.log_softmax(p[:, 0], -1)).sum(-1)
    assert torch.allclose(out["target_entropy"], ent)  # T = 1 probabilities at T = 0
    other = speculative_outcomes(q, p, valid, *u2, 0.0)  # greedy ignores the uniforms
    assert torch.equal(other["accepted_at"], out["accepted_at"])


def test_input_validation():
    q = torch.zeros(2, 3, 4)
    v = torch.ones(2, 3, dtype=torch.bool)
    u = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="temperature"):
        speculative_outcomes(q, q, v, u, u, -1.0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_outcomes(q, q, v, u, u, math.inf)
    with pytest.raises(ValueError, match="p_logits"):
        speculative_outcomes(q, torch.zeros(2, 3, 5), v, u, u, 1.0)
    with pytest.raises(ValueError, match="prefix"):
        speculative_outcomes(q, q, torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool), u, u, 1.0)
    with pytest.raises(ValueError, match="first slot"):
        speculative_outcomes(q, q, torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.bool), u, u, 1.0)
    with pytest.raises(ValueError, match="u_draw"):
        speculative_outcomes(q, q, v, torch.zeros(2, 2), u, 1.0)
    with pytest.raises(ValueError, match="u_accept"):
        speculative_outcomes(q, q, v, u, torch.ones(2, 3), 1.0)


def test_uniforms_deterministic_and_nested():
    a7, b7 = block_uniforms(1234, 3, 50, 7)
    a16, b16 = block_uniforms(1234, 3, 50, 16)
    again = block_uniforms(1234, 3, 50, 16)
    assert a16.shape == b16.shape == (50, 16) and a16.dtype == torch.float64
    assert torch.equal(again[0], a16) and torch.equal(again[1], b16)
    assert torch.equal(a16[:, :7], a7) and torch.equal(b16[:, :7], b7)
    assert not torch.equal(block_uniforms(1234, 4, 50, 7)[0], a7)
    assert not torch.equal(block_uniforms(1235, 3, 50, 7)[0], a7)
    assert not torch.equal(a16, b16)
    assert 0 <= float(a16.min()) and float(a16.max()) < 1
    with pytest.raises(ValueError):
        block_uniforms(0, 0, 5, 0)


def test_statistics_match_closed_form_and_draws_follow_q():
    g = torch.Generator().manual_seed(0)
    N, gamma, V = 20000, 4, 8
    q = 1.5 * torch.randn(N, gamma, V, generator=g)
    p = q + 1.5 * torch.randn(N, gamma, V, generator=g)
    lens = torch.randint(1, gamma + 1, (N,), generator=g)
    valid = torch.arange(gamma) < lens.unsqueeze(1)
    ud, ua = block_uniforms(7, 0, N, gamma)
    out = speculative_outcomes(q, p, valid, ud, ua, 1.0)
    diff = out["tau"] - out["tau_expected"]
    assert abs(float(diff.mean())) < 4 * float(diff.std()) / math.sqrt(N)
    for k in range(gamma):
        r = out["reached"][:, k]
        n = int(r.sum())
        rate = float(out["accepted_at"][:, k].sum()) / n
        assert abs(rate - float(out["c_star"][r, k].mean())) < 4 * math.sqrt(rate * (1 - rate) / n)
    # inverse-CDF draws from one fixed q reproduce q
    q1 = q[:1, :1].expand(N, 1, V)
    toks = speculative_outcomes(q1, q1, torch.ones(N, 1, dtype=torch.bool), ud, ua, 1.0)["tokens"][:, 0]
    freq = torch.bincount(toks, minlength=V).double() / N
    probs = torch.softmax(q[0, 0].double(), -1)
    assert torch.all((freq - probs).abs() < 4 * (probs * (1 - probs) / N).sqrt() + 1e-9)


def test_pairing_identical_and_similar_drafters():
    g = torch.Generator().manual_seed(1)
    N, gamma, V = 20000, 4, 8
    qa = 1.5 * torch.randn(N, gamma, V, generator=g)
    qb = qa + 0.1 * torch.randn(N, gamma, V, generator=g)
    p = qa + 1.0 * torch.randn(N, gamma, V, generator=g)
    valid = torch.ones(N, gamma, dtype=torch.bool)
    u = block_uniforms(3, 0, N, gamma)
    tally = PairedTally()
    out_a = speculative_outcomes(qa, p, valid, *u, 1.0)
    tally.add("a", 1.0, out_a)
    tally.add("a_copy", 1.0, out_a)
    tally.add("b", 1.0, speculative_outcomes(qb, p, valid, *u, 1.0))
    tally.add("b_unpaired", 1.0, speculative_outcomes(qb, p, valid, *block_uniforms(4, 0, N, gamma), 1.0))
    s = summarise(tally, pairs=[("a_copy", "a"), ("b", "a"), ("b_unpaired", "a")])
    same = s["pairs"][("a_copy", "a")][1.0]
    assert same["ratio"] == 1.0 and same["se"] == 0.0
    paired, unpaired = s["pairs"][("b", "a")][1.0], s["pairs"][("b_unpaired", "a")][1.0]
    assert paired["se"] < 0.5 * paired["se_unpaired"]
    # the independent-uniforms SE matches the unpaired formula, and is far above the paired one
    assert unpaired["se"] == pytest.approx(unpaired["se_unpaired"], rel=0.2)
    assert paired["se"] < 0.5 * unpaired["se"]
    assert abs(paired["ratio"] - unpaired["ratio"]) < 4 * unpaired["se"]
    d = s["drafters"]["a"][1.0]
    assert d["n"] == N and d["tau"] == pytest.approx(float(out_a["tau"].mean()))
    assert d["tau_se"] == pytest.approx(float(out_a["tau"].std()) / math.sqrt(N))
    assert d["tau_expected"] == pytest.approx(float(out_a["tau_expected"].mean()))
    assert d["reached"] == out_a["reached"].sum(0).tolist()
    assert d["acceptance"][2] == pytest.approx(d["accepted"][2] / d["reached"][2])
    assert sum(b["n"] for b in d["by_entropy"]) == N
    assert sum(b["n"] for b in paired["by_entropy"]) == N
    for b in d["by_entropy"]:
        mask = (out_a["target_entropy"] >= b["lo"]) & (out_a["target_entropy"] < b["hi"])
        if b["n"]:
            assert b["tau"] == pytest.approx(float(out_a["tau"][mask].mean()))


def test_block_sizes_7_and_16_share_the_first_slots():
    g = torch.Generator().manual_seed(2)
    N, V = 3000, 6
    q16 = 2.0 * torch.randn(N, 16, V, generator=g)
    p = q16 + 0.7 * torch.randn(N, 16, V, generator=g)
    valid = torch.ones(N, 16, dtype=torch.bool)
    o16 = speculative_outcomes(q16, p, valid, *block_uniforms(11, 2, N, 16), 1.0)
    o7 = speculative_outcomes(q16[:, :7], p[:, :7], valid[:, :7], *block_uniforms(11, 2, N, 7), 1.0)
    assert torch.equal(o16["accepted_at"][:, :7], o7["accepted_at"])
    short = o7["accepted"] < 7
    assert torch.equal(o16["accepted"][short], o7["accepted"][short])
    assert bool((o16["accepted"] >= o7["accepted"]).all())


def test_paired_ratio_exact_and_bootstrap():
    r, se = paired_ratio(torch.tensor([2.0, 3, 1, 4]), torch.tensor([1.0, 3, 2, 2]))
    # R = 2.5 / 2; d = [.75, -.75, -1.5, 1.5], var(d) = 5.625 / 3; SE = sqrt(1.875) / (2 * 2)
    assert r == 1.25 and se == pytest.approx(math.sqrt(1.875) / 4, abs=1e-12)
    g = torch.Generator().manual_seed(3)
    n = 500
    tb = 1 + torch.poisson(torch.full((n,), 2.0), generator=g)
    ta = (tb + torch.randint(-1, 3, (n,), generator=g)).clamp_min(1).double()
    _, se = paired_ratio(ta, tb.double())
    idx = torch.randint(0, n, (2000, n), generator=g)
    boot = ta[idx].mean(1) / tb.double()[idx].mean(1)
    assert se == pytest.approx(float(boot.std()), rel=0.2)
    with pytest.raises(ValueError):
        paired_ratio(ta, tb[:-1])


def test_summary_refusals_and_table():
    u = block_uniforms(0, 0, 5, 3)
    q = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(4))
    valid = torch.ones(5, 3, dtype=torch.bool)
    tally = PairedTally()
    for T in (0.0, 1.0):
        tally.add("base", T, speculative_outcomes(q, q.flip(-1), valid, *u, T))
        tally.add("new", T, speculative_outcomes(q, q, valid, *u, T))
    tally.add("short", 1.0, speculative_outcomes(q[:4], q[:4], valid[:4], u[0][:4], u[1][:4], 1.0))
    with pytest.raises(ValueError, match="blocks"):
        summarise(tally, pairs=[("short", "base")])
    with pytest.raises(ValueError, match="unknown"):
        summarise(tally, pairs=[("nope", "base")])
    with pytest.raises(ValueError, match="gamma"):
        tally.add("base", 1.0, speculative_outcomes(q[:, :2], q[:, :2], valid[:, :2], *u, 1.0))
    s = summarise(tally, pairs=[("new", "base")])
    assert s["temperatures"] == [0.0, 1.0]
    new = s["drafters"]["new"]
    assert new[0.0]["tau"] == 4.0 and new[0.0]["acceptance"] == [1.0, 1.0, 1.0]  # q == p accepts all
    assert s["pairs"][("new", "base")][1.0]["n"] == 5
    table = format_table(s)
    assert "| new | 5 | 4.000 ± 0.000 |" in table
    assert "new / base" in table and "slot 3" in table and "T=0" in table
