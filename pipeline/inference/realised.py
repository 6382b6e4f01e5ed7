"""Calibration on realised acceptance: the confidence a serving engine gets, against what happens.

Every verified block gives, per position k = 1..gamma, the confidence head's logit ``z_k``, the
drafter's largest draft probability ``max q_k`` and the realised prefix survival ``s_k = 1[accepted
>= k]`` (0/1, prefix-closed; known for ``k <= verified``). Sources: the evaluate stage's speculative
decoding (:func:`from_rounds`) and the block-level evaluation on held-out cache blocks
(``training.block_runner.evaluate_blocks(records=...)``, :func:`from_records`).

Estimators of the conditional acceptance ``c_k`` (survival ``a_k = prod_{i<=k} c_i``), all fitted on
one split (``fit``) and reported on another:

- ``raw``: ``sigmoid(z_k)``, what vLLM applies to an unfolded head;
- ``global T``: ``sigmoid(z_k / T)``, one temperature (``training.sts.fit_global_temperature``), the
  transform that folds into the exported head;
- ``STS``: ``sigmoid(z_k / T_k)`` (``training.sts.fit_temperatures``);
- ``max-q``: ``sigmoid(a_k logit(max q_k) + b_k)`` (:mod:`training.maxq`), needs no head;
- ``export``: the calibrate stage's global temperature (fitted on expected acceptance ``c*``), the
  one the exported head carries.

Metrics per position (:func:`metrics`): ECE with equal-width bins (10 and 15, as the calibrate
stage) and equal-mass bins, Brier, AUC. Each estimator also drives the scheduler simulation
(:func:`pipeline.inference.scheduler.simulate`) on the realised full blocks, against the best fixed block length.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.inference.scheduler import MIN_SPEEDUP

__all__ = ["Outcomes", "from_rounds", "from_records", "save_outcomes", "load_outcomes", "fit_estimators", "conditional", "metrics",
           "plot_reliability", "compare", "recommendation", "format_tables"]

ESTIMATORS = ("raw", "global T", "STS", "max-q", "export")


@dataclass
class Outcomes:
    """Realised outcomes of verified blocks.

    Attributes:
        z: [N, gamma] float64 confidence logits (NaN without a head).
        max_q: [N, gamma] float64 largest draft probability per slot, in (0, 1].
        accepted: [N] int64 accepted drafts. verified: [N] int64 positions whose outcome is known.
        group: [N] int64 prompt (decoding) or batch (block level) index, for splitting.
    """

    z: torch.Tensor
    max_q: torch.Tensor
    accepted: torch.Tensor
    verified: torch.Tensor
    group: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.accepted.numel()

    @property
    def gamma(self) -> int:
        return self.z.shape[1]

    def labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, valid)``, each [N, gamma]: ``y_k = 1[accepted >= k]`` float64, ``valid_k = k <= verified``."""
        k = torch.arange(1, self.gamma + 1)
        return (self.accepted[:, None] >= k).double(), self.verified[:, None] >= k

    def select(self, mask: torch.Tensor) -> "Outcomes":
        return Outcomes(self.z[mask], self.max_q[mask], self.accepted[mask], self.verified[mask], self.group[mask])

    def split(self) -> tuple["Outcomes", "Outcomes"]:
        """(even groups, odd groups)."""
        even = self.group % 2 == 0
        return self.select(even), self.select(~even)

    def full(self) -> "Outcomes":
        """The blocks verified at every position (what the scheduler simulation replays)."""
        return self.select(self.verified == self.gamma)


def from_rounds(runs: Sequence) -> Outcomes:
    """Outcomes of the decoding loop: one row per round (``pipeline.inference.speculate.Round``) with a
    confidence head and ``max_q``; group = prompt index. Raises ValueError if none has both."""
    rows = [(i, r) for i, d in enumerate(runs) for r in d.rounds
            if r.confidence_logits is not None and r.max_q is not None and r.verified > 0]
    if not rows:
        raise ValueError("no decoding round has confidence logits and max q: the drafter needs a confidence head")
    return Outcomes(torch.tensor([r.confidence_logits for _, r in rows], dtype=torch.float64),
                    torch.tensor([r.max_q for _, r in rows], dtype=torch.float64),
                    torch.tensor([r.accepted for _, r in rows]), torch.tensor([r.verified for _, r in rows]),
                    torch.tensor([i for i, _ in rows]))


def from_records(rec: dict[str, list[torch.Tensor]]) -> Outcomes:
    """Outcomes of the block-level evaluation (``evaluate_blocks(records=...)``, one ``(name, T)``)."""
    cat = {k: torch.cat(v) for k, v in rec.items()}
    return Outcomes(cat["z"].double(), cat["max_q"].double(), cat["accepted"].long(), cat["verified"].long(),
                    cat["group"].long())


def save_outcomes(url: str, data: Outcomes) -> None:
    """Write ``data``'s tensors (:class:`Outcomes`: shapes and dtypes kept) to a safetensors file at ``url``."""
    from storage import write_tensors

    write_tensors(url, {f: getattr(data, f) for f in ("z", "max_q", "accepted", "verified", "group")})


def load_outcomes(url: str) -> Outcomes:
    """What :func:`save_outcomes` wrote. Raises FileNotFoundError if absent."""
    from storage import read_tensors

    t = read_tensors(url)
    return Outcomes(t["z"], t["max_q"], t["accepted"], t["verified"], t["group"])


def fit_estimators(fit: Outcomes, *, export_temperature: float | None = None, n_bins: int = 15
                   ) -> dict[str, dict[str, Any]]:
    """Fit every estimator (module docstring) on ``fit``.

    Returns:
        ``{name: params}``: ``{"T": [gamma]}`` for temperature scalings, ``{"a": [gamma], "b": [gamma]}``
        for max-q; ``export`` only when ``export_temperature`` is given.
    """
    from training.maxq import fit_maxq
    from training.sts import fit_global_temperature, fit_temperatures

    y, valid = fit.labels()
    g = fit.gamma
    T = fit_temperatures(fit.z, y, valid, n_bins=n_bins)
    a, b = fit_maxq(fit.max_q, y, valid)
    out = {"raw": {"T": [1.0] * g}, "global T": {"T": [fit_global_temperature(fit.z, y, valid, n_bins=n_bins)] * g},
           "STS": {"T": T.tolist()}, "max-q": {"a": a.tolist(), "b": b.tolist()}}
    if export_temperature is not None:
        out["export"] = {"T": [float(export_temperature)] * g}
    return out


def conditional(params: dict[str, Any], data: Outcomes) -> torch.Tensor:
    """Conditional acceptance ``c`` [N, gamma] float64 of one fitted estimator on ``data``."""
    from training.maxq import apply_maxq

    if "T" in params:
        return torch.sigmoid(data.z / torch.tensor(params["T"], dtype=torch.float64))
    return apply_maxq(data.max_q, torch.tensor(params["a"]), torch.tensor(params["b"]))


def metrics(c: torch.Tensor, data: Outcomes) -> list[dict[str, Any]]:
    """Per position k: ``{"k", "n", "ece10", "ece15", "ece_mass", "brier", "auc"}`` of the survival
    ``a_k = prod_{i<=k} c_i`` against the realised survival, over blocks verified through k (None
    where undefined)."""
    from training.sts import auc, brier, ece, ece_equal_mass

    y, valid = data.labels()
    a = torch.cumprod(c, dim=1)
    out = []
    for k in range(data.gamma):
        rows = valid[:, k]
        ak, sk = a[rows, k], y[rows, k]
        n = int(rows.sum())
        area = auc(ak, sk > 0.5) if n else math.nan
        out.append({"k": k + 1, "n": n, "ece10": float(ece(ak, sk, 10)) if n else None,
                    "ece15": float(ece(ak, sk, 15)) if n else None, "ece_mass": ece_equal_mass(ak, sk, 15) if n else None,
                    "brier": brier(ak, sk) if n else None, "auc": None if math.isnan(area) else area})
    return out


def plot_reliability(path: str, curves: dict[str, torch.Tensor], data: Outcomes, title: str, n_bins: int = 10) -> str:
    """Reliability diagram PNG at ``path`` (fsspec): one panel per position, one line per estimator
    (mean predicted survival vs realised survival per equal-mass bin), ECE (equal-mass) in the legend."""
    import fsspec
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from training.sts import ece_equal_mass

    y, valid = data.labels()
    g = data.gamma
    fig = Figure(figsize=(2.9 * g, 3.3))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, g, squeeze=False)[0]
    for k, ax in enumerate(axes):
        rows = valid[:, k]
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for name, c in curves.items():
            a, s = torch.cumprod(c[rows], dim=1)[:, k], y[rows, k]
            if not a.numel():
                continue
            order = torch.argsort(a)
            xs = [float(p.mean()) for p in torch.tensor_split(a[order], n_bins) if p.numel()]
            ys = [float(p.mean()) for p in torch.tensor_split(s[order], n_bins) if p.numel()]
            ax.plot(xs, ys, ".-", ms=3, lw=1, label=f"{name} {ece_equal_mass(a, s, n_bins):.3f}")
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"k={k + 1} (n={int(rows.sum())})", xlabel="predicted a_k")
        ax.legend(fontsize=6, loc="upper left", title="ECE (equal mass)", title_fontsize=6)
    axes[0].set_ylabel("realised survival")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    with fsspec.open(path, "wb") as f:
        f.write(buf.getvalue())
    return path


CALIBRATION_MIN_GAIN = 0.02
"""Adaptive verification runs at a concurrency R only where, on the calibration (fit) rounds, it beat the
best fixed block by at least this fraction (the check a deployer makes before enabling it); elsewhere
the fixed block is the policy. On the tiny run Algorithm 1 lost 3-5% at R = 64 of the CPU curve for
every estimator, max q included, where the curve alone said adaptive lengths could pay."""


def _adaptive_gain(fit: Outcomes, p, sps, concurrency: Sequence[int], seed: int, min_speedup: float | None
                   ) -> list[int] | None:
    """The R values where the scheduler with estimator ``p`` beats the best fixed block by
    :data:`CALIBRATION_MIN_GAIN` on ``fit``'s full blocks; None (no restriction) without any."""
    from pipeline.inference.scheduler import simulate

    full = fit.full()
    if not full.num_blocks:
        return None
    y, _ = full.labels()
    res = simulate(y.numpy().astype(np.int64), conditional(p, full).numpy(), sps, concurrency=concurrency,
                   seed=seed, min_speedup=min_speedup)["results"]
    return [r["R"] for r in res if r["ratio_scheduler"] >= 1 + CALIBRATION_MIN_GAIN]


def _simulation(set_name: str, full: Outcomes, est: dict[str, Any], sps, concurrency: Sequence[int],
                seed: int, min_speedup: float | None, fit: Outcomes | None = None) -> dict[str, Any]:
    """The scheduler simulation of every estimator on the realised full blocks ``full`` over one cost
    curve (an :class:`SPSCurve` or ``{R: SPSCurve}``); the structure of ``compare``'s ``simulation``.
    With ``fit`` (the calibration rounds), each estimator's adaptive policy runs only at the R where it
    gained on them (:func:`_adaptive_gain`)."""
    from pipeline.inference.scheduler import simulate

    sim: dict[str, Any] = {"set": set_name, "blocks": full.num_blocks}
    if full.num_blocks:
        y, _ = full.labels()
        for e, p in est.items():
            allowed = None if fit is None else _adaptive_gain(fit, p, sps, concurrency, seed, min_speedup)
            res = simulate(y.numpy().astype(np.int64), conditional(p, full).numpy(), sps, concurrency=concurrency,
                           seed=seed, min_speedup=min_speedup, adaptive_at=allowed)["results"]
            sim.setdefault("fixed", {str(r["R"]): {g: v["tokens_per_s"] for g, v in r["fixed"].items()} for r in res})
            sim.setdefault("best_fixed", {str(r["R"]): r["best_fixed_gamma"] for r in res})
            sim.setdefault("oracle", {str(r["R"]): r["ratio_oracle"] for r in res})
            flags = sim.setdefault("adaptive", {})
            for r in res:
                flags[str(r["R"])] = flags.get(str(r["R"]), False) or r["adaptive"]
            sim[e] = {str(r["R"]): {"tokens_per_s": r["scheduler"]["tokens_per_s"], "ratio": r["ratio_scheduler"],
                                    "adaptive": r["adaptive"],
                                    "ratio_production": r["ratio_production"], "ratio_algorithm1": r["ratio_algorithm1"],
                                    "verified_per_request": r["scheduler"]["verified_per_request"]} for r in res}
    return sim


def compare(fit: Outcomes, reports: dict[str, Outcomes], sps, *, concurrency: Sequence[int],
            export_temperature: float | None, seed: int, n_bins: int = 15, model_curves=None,
            min_speedup: float | None = MIN_SPEEDUP, fit_set: str = "other blocks") -> dict[str, Any]:
    """Fit the estimators on ``fit``; per report set, their per-position metrics; on the first report
    set's full blocks, the scheduler simulation per estimator against fixed block lengths, on ``sps``
    and, when given, on ``model_curves`` (``{R: SPSCurve}``, e.g. the H200 roofline model);
    ``min_speedup``: the scheduler's fixed-block fallback (``pipeline.inference.scheduler.simulate``);
    each estimator's adaptive policy also runs only at the R where it beat the best fixed block by
    :data:`CALIBRATION_MIN_GAIN` on ``fit``'s full blocks (the rest: the fixed block). ``fit_set``
    names what ``fit`` is, for the tables.

    Returns:
        ``{"fit_blocks", "fit_set", "estimators": {name: params}, "metrics": {set: {"blocks", name: [per position]}},
        "simulation": {"set", "blocks", "fixed": {R: {gamma: tokens/s}}, "best_fixed": {R: gamma},
        "adaptive": {R: bool} (any estimator verified adaptively there), "oracle": {R: ratio} (the bound:
        the best plan knowing the outcomes, ``pipeline.inference.scheduler`` module doc), name: {R: {"tokens_per_s", "ratio",
        "adaptive" (this estimator's policy was adaptive, not the fixed block), "ratio_production", "ratio_algorithm1",
        "verified_per_request"}}}}`` (R as str), plus ``"simulation_h200_model"`` of the same form
        when ``model_curves`` is given.
    """
    est = fit_estimators(fit, export_temperature=export_temperature, n_bins=n_bins)
    out: dict[str, Any] = {"fit_blocks": fit.num_blocks, "fit_set": fit_set, "estimators": est, "metrics": {}}
    for name, data in reports.items():
        out["metrics"][name] = {"blocks": data.num_blocks, **{e: metrics(conditional(p, data), data) for e, p in est.items()}}
    set_name, data = next(iter(reports.items()))
    full = data.full()
    out["simulation"] = _simulation(set_name, full, est, sps, concurrency, seed, min_speedup, fit)
    if model_curves is not None:
        out["simulation_h200_model"] = _simulation(set_name, full, est, model_curves, concurrency, seed, min_speedup,
                                                   fit)
    return out


def recommendation(comparisons: dict[str, dict[str, Any]], method: str, path: str) -> str:
    """Markdown: per temperature and concurrency R, the best fixed ``num_speculative_tokens`` (from the
    simulated fixed-length throughput on the realised blocks and the SPS curve), the best estimator's
    gain over it, and the ``speculative_config`` to copy into vLLM."""
    lines = ["| T | R | num_speculative_tokens | fixed tokens/s | best adaptive | gain | vLLM speculative_config |",
             "|---|---:|---:|---:|---|---:|---|"]
    for key, cmp in comparisons.items():
        sim = cmp["simulation"]
        if "fixed" not in sim:
            continue
        for R, g in sim["best_fixed"].items():
            best = max((e for e in ESTIMATORS if e in sim), key=lambda e: sim[e][R]["ratio"])
            cfg = f'`{{"method": "{method}", "model": "{path}", "num_speculative_tokens": {g}}}`'
            lines.append(f"| {key[2:]} | {R} | {g} | {sim['fixed'][R][str(g)]:.0f} | {best} | "
                         f"{sim[best][R]['ratio']:.3f} | {cfg} |")
    return "\n".join(lines) + "\n"


def _cell(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def format_tables(name: str, key: str, cmp: dict[str, Any]) -> str:
    """Markdown: ECE (equal mass) / AUC per position per estimator on each report set, and simulated
    tokens/s ratio over the best fixed block length per R for each estimator."""
    lines = []
    for set_name, m in cmp["metrics"].items():
        est = [e for e in ESTIMATORS if e in m]
        g = len(m[est[0]])
        lines += ["", f"{name} {key}, {set_name} ({m['blocks']} blocks; fitted on {cmp['fit_blocks']} "
                  f"{cmp.get('fit_set', 'other blocks')}): ECE equal-mass / ECE 15 bins / AUC of survival per position",
                  "| estimator | " + " | ".join(f"k={k + 1}" for k in range(g)) + " | mean ECE |",
                  "|---|" + "---:|" * (g + 1)]
        for e in est:
            cells = [f"{_cell(p['ece_mass'])} / {_cell(p['ece15'])} / {_cell(p['auc'], '.2f')}" for p in m[e]]
            ok = [p["ece_mass"] for p in m[e] if p["ece_mass"] is not None]
            lines.append(f"| {e} | " + " | ".join(cells) + f" | {np.mean(ok) if ok else float('nan'):.4f} |")
    for curve, sim in (("measured SPS curve", cmp["simulation"]),
                       ("H200 roofline model of Qwen3-4B", cmp.get("simulation_h200_model", {}))):
        if "fixed" not in sim:
            continue
        est = [e for e in ESTIMATORS if e in sim]
        lines += ["", f"{name} {key}, {curve}: simulated tokens/s over the best fixed block length ({sim['blocks']} "
                  f"realised full blocks of {sim['set']}, scheduler = DSpark Algorithm 1 with the fixed-block "
                  "fallback, production variant in brackets; * = fallback: the curve says other lengths cannot pay, or "
                  f"no estimator beat the best fixed block by {CALIBRATION_MIN_GAIN:.0%} on the calibration rounds; "
                  "f = this estimator fell back to the fixed block; oracle = the best plan knowing the outcomes, "
                  "what a perfect estimator would reach)",
                  "| R | best fixed gamma | fixed tokens/s | " + " | ".join(est) + " | oracle (bound) |",
                  "|---:|---:|---:|" + "---:|" * (len(est) + 1)]
        for R, g in sim["best_fixed"].items():
            star = "" if sim.get("adaptive", {}).get(R, True) else "*"
            lines.append(f"| {R}{star} | {g} | {sim['fixed'][R][str(g)]:.0f} | "
                         + " | ".join(f"{sim[e][R]['ratio']:.3f} ({sim[e][R]['ratio_production']:.3f})"
                                      f"{'' if sim[e][R].get('adaptive', True) or star else ' f'}" for e in est)
                         + f" | {sim['oracle'][R]:.3f} |")
    return "\n".join(lines) + "\n"
