"""Paired block-level speculative-sampling evaluation of drafters on cached (teacher-forced) blocks.

For each block (an anchor and its ``gamma`` predicting slots, :mod:`training.blocks`) we have the
drafter's logits ``l_q`` (base logits + sequential-head bias on the true previous token) and the
target's logits ``l_p`` (frozen ``lm_head`` on the cached final hidden state) at every slot. The
evaluator simulates speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2)
slot by slot: ``x_k ~ q_k`` is accepted with probability ``min(1, p_k(x_k) / q_k(x_k))``; the block
stops at the first rejection or at the end of its valid (supervised) prefix, and ``tau = accepted
+ 1`` (the +1 is the correction / bonus token). Each slot is accepted with probability
``c*_k = sum_v min(p_k, q_k)`` (Leviathan et al. 2023, Thm. 3.5), hence ``E[tau] = 1 + sum_j
prod_{i<=j} c*_i`` (DSpark paper sec. 3.2; :func:`training.losses.expected_tau`). At ``T = 0`` the
draft is ``argmax q`` and is accepted iff it equals ``argmax p``.

Pairing: all drafters see the same blocks and the same uniforms (:func:`block_uniforms`, a pure
function of ``(seed, batch index, slot)``), ``x_k`` is drawn by inverse CDF from ``u_draw`` and
accepted iff ``u_accept * q(x) < p(x)``. Differences between drafters then come from the drafters,
not from the dice, and the ratio of mean taus gets a paired delta-method standard error.

One of the evaluation modules, each for one question: this one the paired statistics over tensors;
:mod:`training.block_runner` runs drafters on cache blocks; :mod:`training.validation` the learning curves.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import torch

from training.spec_sampling import Sampling, temperature_probs

__all__ = ["ENTROPY_BINS", "block_uniforms", "speculative_outcomes", "draw_tokens", "paired_ratio", "PairedTally",
           "summarise", "format_table"]

ENTROPY_BINS: tuple[tuple[float, float], ...] = ((0.0, 0.5), (0.5, 1.5), (1.5, 3.0), (3.0, math.inf))
"""Default target-entropy bins ``[lo, hi)`` in nats (entropy of ``p`` at the first slot)."""


def block_uniforms(seed: int, batch_index: int, num_blocks: int, max_slots: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared random numbers of one evaluation batch: ``(u_draw, u_accept)``.

    Slot k's two columns come from a CPU ``torch.Generator`` seeded with the first 8 bytes of
    ``sha256(f"{seed}/{batch_index}/{k}")``, so they depend only on ``(seed, batch_index, k,
    num_blocks)``: drafters of block sizes 7 and 16 share the first 7 slots' numbers.

    Args:
        seed: any int. batch_index: >= 0, the evaluation batch. num_blocks: N >= 0. max_slots: >= 1.
    Returns:
        u_draw, u_accept: [num_blocks, max_slots] float64 on CPU, uniform on [0, 1).
    Raises:
        ValueError: negative batch_index / num_blocks or max_slots < 1.
    """
    if batch_index < 0 or num_blocks < 0 or max_slots < 1:
        raise ValueError(f"need batch_index >= 0, num_blocks >= 0, max_slots >= 1; got {batch_index}, "
                         f"{num_blocks}, {max_slots}")
    cols = []
    for k in range(max_slots):
        digest = hashlib.sha256(f"{int(seed)}/{int(batch_index)}/{k}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))
        cols.append(torch.rand(2, num_blocks, generator=gen, dtype=torch.float64))
    u = torch.stack(cols, dim=-1)
    return u[0].contiguous(), u[1].contiguous()


def _check_inputs(q_logits, p_logits, valid, u_draw, u_accept, temperature) -> None:
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if q_logits.ndim != 3 or p_logits.shape != q_logits.shape:
        raise ValueError(f"q_logits and p_logits must both be [N, gamma, V]; got {tuple(q_logits.shape)} "
                         f"and {tuple(p_logits.shape)}")
    N, gamma, V = q_logits.shape
    if gamma < 1 or V < 1:
        raise ValueError(f"need gamma >= 1 and V >= 1, got logits {tuple(q_logits.shape)}")
    if valid.dtype != torch.bool or valid.shape != (N, gamma):
        raise ValueError(f"valid must be a bool [N={N}, gamma={gamma}] mask, got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    if not torch.equal(valid.long().cumprod(-1).bool(), valid):
        raise ValueError("valid must be a prefix mask (no True after a False in a block)")
    if N and not bool(valid[:, 0].all()):
        raise ValueError("every block needs a valid first slot; drop dummy blocks (Blocks.keep False) first")
    for name, u in (("u_draw", u_draw), ("u_accept", u_accept)):
        if u.ndim != 2 or u.shape[0] != N or u.shape[1] < gamma:
            raise ValueError(f"{name} must be [N={N}, >= gamma={gamma}], got {tuple(u.shape)}")
        if u.numel() and bool(((u < 0) | (u >= 1)).any()):
            raise ValueError(f"{name} must lie in [0, 1)")


def speculative_outcomes(q_logits: torch.Tensor, p_logits: torch.Tensor, valid: torch.Tensor,
                         u_draw: torch.Tensor, u_accept: torch.Tensor, temperature: float
                         ) -> dict[str, torch.Tensor]:
    """Simulate speculative sampling of N blocks against the cached target (formulas: module doc).

    ``T > 0``: ``q = softmax(q_logits / T)``, ``p = softmax(p_logits / T)``, each truncated by the
    setting's top-k then top-p and renormalised when ``temperature`` is a
    :class:`training.spec_sampling.Sampling` (vLLM's order, :func:`temperature_probs`); ``x_k`` is the first
    index with ``cumsum(q_k) > u_draw * sum(q_k)`` (so ``q_k(x_k) > 0``), accepted iff
    ``u_accept * q_k(x_k) < p_k(x_k)``. ``T = 0``: ``x_k = argmax q_logits`` (first on ties),
    accepted iff ``x_k == argmax p_logits``; the uniforms are unused. Probabilities are float32
    (float64 for float64 logits); memory is a few ``N x gamma x V`` tensors, so pass chunks.

    Args:
        q_logits, p_logits: [N, gamma, V] float drafter / target logits. valid: [N, gamma] bool
            prefix mask with every ``valid[:, 0]`` True. u_draw, u_accept: [N, >= gamma] in [0, 1)
            (:func:`block_uniforms`; extra columns ignored). temperature: T >= 0 or a
            :class:`training.spec_sampling.Sampling` (T with top-p / top-k).
    Returns:
        dict on the logits' device: ``tokens`` [N, gamma] int64 drawn x_k (at every slot);
        ``accept`` [N, gamma] bool the per-slot decision, ignoring the stop; ``reached`` [N, gamma]
        bool (slot valid and all earlier slots accepted); ``accepted_at`` = reached & accept;
        ``accepted`` [N] int64; ``tau`` [N] float64 = accepted + 1; ``c_star`` [N, gamma] float64
        ``sum_v min(p, q)`` (0/1 indicator at T = 0; 0 where not valid); ``tau_expected`` [N]
        float64 ``1 + sum_j prod_{i<=j} c*_i``; ``target_entropy`` [N] float64 nats of p at slot 0
        (after temperature; T = 1 probabilities when T = 0).
    Raises:
        ValueError: bad shapes or dtypes, a non-prefix mask, a block without a valid first slot,
            uniforms outside [0, 1), or T negative / not finite.
    """
    _check_inputs(q_logits, p_logits, valid, u_draw, u_accept, temperature)
    N, gamma, V = q_logits.shape
    dev = q_logits.device
    dt = torch.float64 if q_logits.dtype == torch.float64 else torch.float32
    valid = valid.to(dev)
    if temperature == 0:
        tokens = q_logits.argmax(-1)
        accept = tokens == p_logits.argmax(-1)
        c_star = accept.double()
        ent_logits = p_logits[:, 0].to(dt)
    else:
        q, p = temperature_probs(q_logits.to(dt), temperature), temperature_probs(p_logits.to(dt), temperature)
        tokens = _inverse_cdf(q, u_draw[:, :gamma].to(dev, dt))
        q_x = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        p_x = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        accept = u_accept[:, :gamma].to(dev, dt) * q_x < p_x
        c_star = torch.minimum(p, q).sum(-1).double().clamp(0, 1)
        ent_logits = p_logits[:, 0].to(dt) / temperature
        del q, p
    ok = accept & valid
    before = torch.cat([torch.ones(N, 1, dtype=torch.long, device=dev), ok.long().cumprod(-1)[:, :-1]], 1)
    reached = valid & before.bool()
    accepted_at = reached & accept
    accepted = accepted_at.sum(-1)
    c_star = c_star * valid
    logp = torch.log_softmax(ent_logits, dim=-1)
    entropy = -(logp.exp() * logp).nansum(-1).double()
    return {"tokens": tokens, "accept": accept, "reached": reached, "accepted_at": accepted_at,
            "accepted": accepted, "tau": accepted.double() + 1, "c_star": c_star,
            "tau_expected": 1 + c_star.cumprod(-1).sum(-1), "target_entropy": entropy}


def _inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index with ``cumsum(q) > u * sum(q)`` over the last dim of ``q`` [..., V] (so
    ``q(x) > 0``), for ``u`` [...] in [0, 1); int64 [...]."""
    cdf = q.cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
    last_pos = q.shape[-1] - 1 - (q > 0).flip(-1).long().argmax(-1)  # rounding guard when the target >= cdf[-1]
    return torch.where(tokens >= q.shape[-1], last_pos, tokens)


def draw_tokens(q_logits: torch.Tensor, u_draw: torch.Tensor, temperature: float) -> torch.Tensor:
    """The draft tokens :func:`speculative_outcomes` draws from ``q_logits`` [..., V] with uniforms
    ``u_draw`` [...] at one setting: the argmax at T = 0, else the inverse CDF of the (truncated)
    ``softmax(q_logits / T)``; int64 [...]. For drawing a block slot by slot (a sequential head fed the
    token drawn at the slot before) with the same tokens as the one-shot draw."""
    if temperature == 0:
        return q_logits.argmax(-1)
    dt = torch.float64 if q_logits.dtype == torch.float64 else torch.float32
    return _inverse_cdf(temperature_probs(q_logits.to(dt), temperature), u_draw.to(q_logits.device, dt))


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error ``std(x, ddof=1) / sqrt(n)`` (NaN SE for n < 2, NaN mean for n = 0)."""
    n = x.numel()
    mean = float(x.mean()) if n else math.nan
    return mean, (float(x.std()) / math.sqrt(n) if n > 1 else math.nan)


def paired_ratio(tau_a: torch.Tensor, tau_b: torch.Tensor) -> tuple[float, float]:
    """``R = mean(tau_a) / mean(tau_b)`` over the same blocks, with its paired delta-method SE.

    ``d_i = tau_a,i - R tau_b,i``, ``SE(R) = std(d, ddof=1) / (sqrt(n) mean(tau_b))`` (first-order
    Taylor expansion of a ratio of means, e.g. Cochran 1977, *Sampling Techniques*, sec. 6.3).

    Args:
        tau_a, tau_b: [n] float per-block values, paired by position.
    Returns:
        (R, SE) as floats; SE is NaN for n < 2, both NaN for n = 0.
    Raises:
        ValueError: different lengths.
    """
    if tau_a.shape != tau_b.shape or tau_a.ndim != 1:
        raise ValueError(f"paired taus must be 1-D of equal length (same blocks), got {tuple(tau_a.shape)} "
                         f"and {tuple(tau_b.shape)}")
    n = tau_a.numel()
    if n == 0:
        return math.nan, math.nan
    a, b = tau_a.double(), tau_b.double()
    r = float(a.mean() / b.mean())
    se = float((a - r * b).std()) / (math.sqrt(n) * float(b.mean())) if n > 1 else math.nan
    return r, se


class PairedTally:
    """Accumulates :func:`speculative_outcomes` per ``(drafter, setting)`` (a temperature or a
    :class:`training.spec_sampling.Sampling`; a plain float T is the setting without truncation), keeping per-block values
    in call order (so two drafters fed the same batches in the same order are paired by block)."""

    _KEYS = ("tau", "tau_expected", "target_entropy")

    def __init__(self) -> None:
        self._data: dict[tuple[str, float], dict] = {}

    def add(self, drafter: str, temperature: float, outcomes: dict[str, torch.Tensor]) -> None:
        """Append one chunk of outcomes. Raises ValueError if the drafter's gamma changed."""
        key = (drafter, Sampling.of(temperature))
        reached, acc = outcomes["reached"].sum(0).long().cpu(), outcomes["accepted_at"].sum(0).long().cpu()
        d = self._data.setdefault(key, {k: [] for k in self._KEYS} | {"reached": torch.zeros_like(reached),
                                                                       "accepted": torch.zeros_like(acc)})
        if d["reached"].shape != reached.shape:
            raise ValueError(f"{drafter!r} at T={temperature}: gamma changed from {d['reached'].numel()} "
                             f"to {reached.numel()}")
        for k in self._KEYS:
            d[k].append(outcomes[k].detach().double().cpu())
        d["reached"] += reached
        d["accepted"] += acc

    def keys(self) -> list[tuple[str, float]]:
        """The ``(drafter, temperature)`` pairs seen, in insertion order."""
        return list(self._data)

    def values(self, drafter: str, temperature: float, name: str) -> torch.Tensor:
        """[n] float64 per-block ``tau``, ``tau_expected`` or ``target_entropy``; or [gamma] int64
        ``reached`` / ``accepted`` slot counts. Raises KeyError for an unknown drafter / temperature."""
        d = self._data[(drafter, Sampling.of(temperature))]
        v = d[name]
        return torch.cat(v) if isinstance(v, list) else v.clone()


def _bin_masks(entropy: torch.Tensor, bins: Sequence[tuple[float, float]]) -> list[torch.Tensor]:
    return [(entropy >= lo) & (entropy < hi) for lo, hi in bins]


def summarise(tally: PairedTally, *, baseline: str | None = None, pairs: Iterable[tuple[str, str]] = (),
              entropy_bins: Sequence[tuple[float, float]] = ENTROPY_BINS) -> dict:
    """Means, SEs, per-slot acceptance, paired ratios and the target-entropy split.

    Args:
        tally: the accumulated outcomes. baseline: if given, adds the pair ``(d, baseline)`` for every
            other drafter. pairs: explicit ``(a, b)`` pairs, ratio = tau_a / tau_b.
        entropy_bins: ``[lo, hi)`` bins in nats of the slot-0 target entropy.
    Returns:
        ``{"drafters": {name: {T: {"n", "tau", "tau_se", "tau_expected", "tau_expected_se",
        "closed_form_gap", "closed_form_gap_se" (mean and SE of tau - tau_expected, paired per block),
        "acceptance" [gamma] (accepted / reached, NaN where never reached), "reached", "accepted",
        "by_entropy": [{"lo", "hi", "n", "tau"}]}}}, "pairs": {(a, b): {T: {"n", "ratio", "se",
        "se_unpaired", "by_entropy": [{"lo", "hi", "n", "ratio", "se"}]}}}, "temperatures": [...]}``.
        A pair covers the temperatures both drafters have; entropy bins of a pair use b's entropies.
    Raises:
        ValueError: an unknown drafter in a pair, no shared temperature, or a pair evaluated on
            different block counts / different blocks (slot-0 target entropies differ by > 1e-3 nats).
    """
    names = list(dict.fromkeys(d for d, _ in tally.keys()))
    temps = sorted({t for _, t in tally.keys()})
    out: dict = {"temperatures": temps, "drafters": {}, "pairs": {}}
    for d, t in tally.keys():
        tau, ent = tally.values(d, t, "tau"), tally.values(d, t, "target_entropy")
        reached, acc = tally.values(d, t, "reached"), tally.values(d, t, "accepted")
        m, se = _mean_se(tau)
        me, see = _mean_se(tally.values(d, t, "tau_expected"))
        rate = torch.where(reached > 0, acc.double() / reached.clamp_min(1), math.nan)
        bins = [{"lo": lo, "hi": hi, "n": int(mk.sum()), "tau": _mean_se(tau[mk])[0]}
                for (lo, hi), mk in zip(entropy_bins, _bin_masks(ent, entropy_bins))]
        gap, gap_se = _mean_se(tau - tally.values(d, t, "tau_expected"))
        out["drafters"].setdefault(d, {})[t] = {
            "n": tau.numel(), "tau": m, "tau_se": se, "tau_expected": me, "tau_expected_se": see,
            "closed_form_gap": gap, "closed_form_gap_se": gap_se,
            "acceptance": rate.tolist(), "reached": reached.tolist(), "accepted": acc.tolist(),
            "by_entropy": bins}
    all_pairs = list(pairs) + [(d, baseline) for d in names if baseline is not None and d != baseline]
    for a, b in dict.fromkeys(all_pairs):
        for x in (a, b):
            if x not in out["drafters"]:
                raise ValueError(f"pair ({a!r}, {b!r}): unknown drafter {x!r}; known: {names}")
        shared = [t for t in temps if t in out["drafters"][a] and t in out["drafters"][b]]
        if not shared:
            raise ValueError(f"pair ({a!r}, {b!r}) has no temperature evaluated for both drafters")
        res = {}
        for t in shared:
            ta, tb = tally.values(a, t, "tau"), tally.values(b, t, "tau")
            if ta.numel() != tb.numel():
                raise ValueError(f"pair ({a!r}, {b!r}) at T={t}: {ta.numel()} vs {tb.numel()} blocks; "
                                 "paired ratios need the same blocks for both drafters")
            ea, eb = tally.values(a, t, "target_entropy"), tally.values(b, t, "target_entropy")
            if ta.numel() and float((ea - eb).abs().max()) > 1e-3:
                raise ValueError(f"pair ({a!r}, {b!r}) at T={t}: slot-0 target entropies differ, so the "
                                 "blocks are not the same (feed both drafters the same batches in order)")
            r, se = paired_ratio(ta, tb)
            (_, sa), (mb, sb) = _mean_se(ta), _mean_se(tb)
            se_u = math.sqrt(sa ** 2 + (r * sb) ** 2) / mb if ta.numel() else math.nan
            bins = []
            for (lo, hi), mk in zip(entropy_bins, _bin_masks(eb, entropy_bins)):
                rb, seb = paired_ratio(ta[mk], tb[mk])
                bins.append({"lo": lo, "hi": hi, "n": int(mk.sum()), "ratio": rb, "se": seb})
            res[t] = {"n": ta.numel(), "ratio": r, "se": se, "se_unpaired": se_u, "by_entropy": bins}
        out["pairs"][(a, b)] = res
    return out


def _pm(m: float, se: float) -> str:
    return "n/a" if math.isnan(m) else (f"{m:.3f}" if math.isnan(se) else f"{m:.3f} ± {se:.3f}")


def format_table(summary: dict) -> str:
    """README-style markdown tables of a :func:`summarise` result: tau ± SE (and the closed form) per
    temperature, paired ratios ± SE with the entropy split, and per-slot conditional acceptance."""
    temps, drafters = summary["temperatures"], summary["drafters"]
    head = " | ".join(f"tau T={t:g} | closed form T={t:g}" for t in temps)
    lines = [f"| drafter | blocks | {head} |", "|---|---:|" + "---:|" * (2 * len(temps))]
    for d, per_t in drafters.items():
        n = max(v["n"] for v in per_t.values())
        cells = " | ".join(f"{_pm(per_t[t]['tau'], per_t[t]['tau_se'])} | "
                           f"{_pm(per_t[t]['tau_expected'], per_t[t]['tau_expected_se'])}"
                           if t in per_t else "- | -" for t in temps)
        lines.append(f"| {d} | {n} | {cells} |")
    if summary["pairs"]:
        bins = next(iter(next(iter(summary["pairs"].values())).values()))["by_entropy"]
        bin_names = [f"H in [{b['lo']:g}, {b['hi']:g})" for b in bins]
        lines += ["", "| ratio | T | blocks | paired | (unpaired SE) | " + " | ".join(bin_names) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(bins)]
        for (a, b), per_t in summary["pairs"].items():
            for t, r in per_t.items():
                split = " | ".join(f"{_pm(x['ratio'], x['se'])} (n={x['n']})" for x in r["by_entropy"])
                lines.append(f"| {a} / {b} | {t:g} | {r['n']} | {_pm(r['ratio'], r['se'])} | "
                             f"{r['se_unpaired']:.3f} | {split} |")
    for t in temps:
        rows = {d: per_t[t]["acceptance"] for d, per_t in drafters.items() if t in per_t}
        g = max(len(v) for v in rows.values())
        lines += ["", f"| accept. T={t:g} | " + " | ".join(f"slot {k + 1}" for k in range(g)) + " |",
                  "|---|" + "---:|" * g]
        for d, acc in rows.items():
            cells = [("n/a" if math.isnan(x) else f"{x:.3f}") for x in acc] + ["-"] * (g - len(acc))
            lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
