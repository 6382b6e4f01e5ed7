"""Sequential temperature scaling (STS) of the drafter's confidence head, and its calibration report.

DSpark (confidence-scheduled verification, STS): the confidence head emits one logit ``z_k`` per block
position k = 1..gamma; the calibrated conditional acceptance is ``c_k = sigmoid(z_k / T_k)`` and the
prefix survival is ``a_k = prod_{i<=k} c_i``. STS fits ``T_1, ..., T_gamma`` left to right, each by a
1-D search over a bounded grid ``[T_MIN, T_MAX]`` for the expected calibration error (ECE, equal-width
bins) of ``a_k`` against the cumulative label ``prod_{i<=k} y_i``, with the earlier temperatures fixed;
where the ECE is flat (within ``ECE_TOL`` of its minimum) the Brier score decides, and a position with
fewer than ``MIN_BLOCKS`` rows keeps the previous position's temperature (:func:`fit_temperatures`).
:func:`fit_global_temperature` fits the one temperature that folds into the head's weight and bias. Labels ``y`` are either the
expected conditional acceptance ``c*_k = 1 - 0.5 ||p_d - p_t||_1`` in [0, 1] or realised 0/1
acceptance indicators; for prefix-closed 0/1 survival indicators the cumulative product is the
indicator itself, so one formula serves both.

Validity: a row counts at position k only if it is valid at every position ``<= k`` (a block cut by
the end of a sequence has a valid prefix), because ``a_k`` needs all earlier logits.
"""
from __future__ import annotations

import io
import math

import fsspec
import numpy as np
import torch

__all__ = ["T_MIN", "T_MAX", "ECE_TOL", "MIN_BLOCKS", "apply_temperatures", "reliability_bins", "ece",
           "ece_equal_mass", "brier", "auc", "fit_temperatures", "fit_global_temperature", "at_bounds",
           "calibration_report", "foldable_temperature", "plot_reliability"]

T_MIN, T_MAX = 0.1, 10.0   # STS search range: a temperature outside it means a head to retrain, not to rescale
ECE_TOL = 0.002            # ECE-flat band (absolute) within which the Brier score decides
MIN_BLOCKS = 200           # least valid blocks to fit a position's temperature


def _check_inputs(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate STS inputs; return float64 z, y and the cumulative (prefix) validity mask [N, gamma]."""
    if z.ndim != 2 or y.shape != z.shape:
        raise ValueError(f"confidence logits and labels must both be [N, gamma]; got {tuple(z.shape)} "
                         f"and {tuple(y.shape)}: stack one row per drafted block")
    if valid is None:
        valid = torch.ones_like(z, dtype=torch.bool)
    if valid.shape != z.shape:
        raise ValueError(f"valid mask shape {tuple(valid.shape)} != logits shape {tuple(z.shape)}: "
                         "pass one bool per (block, position)")
    z64, y64 = z.detach().double(), y.detach().double()
    cum_valid = torch.cumprod(valid.bool().long(), dim=1).bool()
    if not torch.isfinite(z64[cum_valid]).all():
        raise ValueError("confidence logits contain NaN/inf at valid positions: mask them out in `valid`")
    yv = y64[cum_valid]
    if not torch.isfinite(yv).all() or (yv < 0).any() or (yv > 1).any():
        raise ValueError("labels must lie in [0, 1] at valid positions (expected acceptance c*_k or "
                         "0/1 indicators): mask the others out in `valid`")
    return z64, y64, cum_valid


def _check_temperatures(T: torch.Tensor | list[float], gamma: int) -> torch.Tensor:
    """Return T as a float64 tensor [gamma]; raise ValueError unless finite, positive and of length gamma."""
    T = torch.as_tensor(T, dtype=torch.float64)
    if T.shape != (gamma,):
        raise ValueError(f"need one temperature per position: got shape {tuple(T.shape)}, gamma={gamma}")
    if not torch.isfinite(T).all() or (T <= 0).any():
        raise ValueError(f"temperatures must be finite and > 0, got {T.tolist()}: refit with fit_temperatures")
    return T


def apply_temperatures(z: torch.Tensor, T: torch.Tensor | list[float]) -> torch.Tensor:
    """Scale confidence logits per position: ``z_k / T_k`` (DSpark STS).

    Args:
        z: confidence logits [..., gamma], any float dtype.
        T: temperatures [gamma], all finite and > 0.
    Returns:
        scaled logits, same shape and dtype as ``z``; ``sigmoid`` of it is the calibrated ``c_k``.
    Raises:
        ValueError: ``T`` has the wrong length or a non-positive / non-finite entry.
    """
    T = _check_temperatures(T, z.shape[-1])
    return z / T.to(z.dtype)


def reliability_bins(conf: torch.Tensor, label: torch.Tensor, n_bins: int = 15
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-width reliability bins over [0, 1] (Guo et al. 2017, the binning behind ECE).

    Args:
        conf: predicted probabilities [G, N] or [N], float64, in [0, 1].
        label: targets [N] (probabilities or 0/1), float64.
        n_bins: number of equal-width bins (>= 1); bin b covers [b/n, (b+1)/n), the last one includes 1.
    Returns:
        ``(sum_conf, sum_label, count)``, each [G, n_bins] (or [n_bins]) float64: per-bin sums, so that
        mean confidence = sum_conf / count.
    Raises:
        ValueError: ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    squeeze = conf.ndim == 1
    conf2 = conf.reshape(1, -1) if squeeze else conf
    idx = torch.clamp((conf2 * n_bins).long(), 0, n_bins - 1)
    zeros = torch.zeros(conf2.shape[0], n_bins, dtype=torch.float64)
    sum_conf = zeros.scatter_add(1, idx, conf2)
    sum_label = zeros.scatter_add(1, idx, label.reshape(1, -1).expand_as(conf2).contiguous())
    count = zeros.scatter_add(1, idx, torch.ones_like(conf2))
    if squeeze:
        return sum_conf[0], sum_label[0], count[0]
    return sum_conf, sum_label, count


def ece(conf: torch.Tensor, label: torch.Tensor, n_bins: int = 15) -> torch.Tensor:
    """Expected calibration error with equal-width bins: ``sum_b (n_b / N) |mean_conf_b - mean_label_b|``.

    Args:
        conf: [G, N] or [N] float64 probabilities; label: [N] float64 in [0, 1]; n_bins: bin count.
    Returns:
        ECE per row, [G] (or a 0-d tensor) float64, in [0, 1]; NaN when N == 0.
    """
    if conf.shape[-1] == 0:
        return torch.full(conf.shape[:-1], math.nan, dtype=torch.float64)
    sum_conf, sum_label, _ = reliability_bins(conf, label, n_bins)
    return (sum_conf - sum_label).abs().sum(-1) / conf.shape[-1]


def ece_equal_mass(conf: torch.Tensor, label: torch.Tensor, n_bins: int = 15) -> float:
    """ECE with equal-mass (quantile) bins: sort by ``conf``, split into ``n_bins`` near-equal groups
    (``torch.tensor_split``), ``sum_b (n_b / N) |mean_conf_b - mean_label_b|`` (Nixon et al. 2019, "adaptive"
    calibration error). Less sensitive than equal-width bins when the confidences crowd a few bins.

    Args:
        conf: [N] float64 probabilities; label: [N] float64 in [0, 1]; n_bins: groups (>= 1).
    Returns:
        ECE (float) in [0, 1]; NaN when N == 0.
    Raises:
        ValueError: ``n_bins < 1``.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if conf.numel() == 0:
        return math.nan
    order = torch.argsort(conf, stable=True)
    c, lab = conf[order].double(), label[order].double()
    total = sum(float((cb.sum() - lb.sum()).abs()) for cb, lb in
                zip(torch.tensor_split(c, n_bins), torch.tensor_split(lab, n_bins)))
    return total / conf.numel()


def brier(conf: torch.Tensor, label: torch.Tensor) -> float:
    """Brier score ``mean((conf - label)^2)`` over N items (float64 [N] each); NaN when N == 0."""
    return float(((conf - label) ** 2).mean()) if conf.numel() else math.nan


def auc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """ROC AUC via the Mann-Whitney U statistic, ties counted one half.

    Args:
        score: [N] float scores; positive: [N] bool class labels.
    Returns:
        AUC in [0, 1]; NaN when only one class is present (AUC undefined).
    """
    s = score.double().numpy()
    pos = positive.bool().numpy()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)                      # 1-based rank of each distinct value's last copy
    avg_rank = (upper - (counts - 1) / 2.0)[inverse]
    u = avg_rank[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _search_grid(t_min: float, t_max: float, step: float) -> torch.Tensor:
    """Coarse temperature grid ``t_min, t_min + step, ..., <= t_max``, plus T = 1 exactly."""
    n = int(math.floor((t_max - t_min) / step + 1e-9)) + 1
    grid = t_min + step * torch.arange(n, dtype=torch.float64)
    return torch.unique(torch.cat([grid, torch.ones(1, dtype=torch.float64)]))


def _scores(temps: torch.Tensor, prev: torch.Tensor, zk: torch.Tensor, label: torch.Tensor,
            n_bins: int, chunk: int = 2_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """ECE and Brier of ``prev * sigmoid(zk / T)`` against ``label`` for every T in ``temps`` ([G] each)."""
    rows = max(1, chunk // max(1, zk.numel()))
    errs, briers = [], []
    for i in range(0, temps.numel(), rows):
        a = prev * torch.sigmoid(zk / temps[i:i + rows, None])
        errs.append(ece(a, label, n_bins))
        briers.append(((a - label) ** 2).mean(-1))
    return torch.cat(errs), torch.cat(briers)


def _select(temps: torch.Tensor, errs: torch.Tensor, briers: torch.Tensor, ece_tol: float) -> float:
    """The T of least Brier among those whose ECE is within ``ece_tol`` of the least ECE; ties -> T nearest 1."""
    near = torch.nonzero(errs <= errs.min() + ece_tol + 1e-12).flatten()
    best = briers[near].min()
    ties = near[briers[near] <= best + 1e-15]
    return float(temps[ties[torch.argmin(temps[ties].log().abs())]])


def fit_temperatures(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None, *,
                     n_bins: int = 15, t_min: float = T_MIN, t_max: float = T_MAX,
                     grid_step: float = 0.05, refine: bool = True, ece_tol: float = ECE_TOL,
                     min_blocks: int = MIN_BLOCKS) -> torch.Tensor:
    """Fit per-position temperatures by sequential temperature scaling (DSpark STS), with guards.

    For k = 1..gamma, with ``T_1..T_{k-1}`` fixed, each candidate T on the grid ``t_min, t_min +
    grid_step, ..., t_max`` (plus T = 1; then, if ``refine``, a grid of step ``grid_step / 10`` within
    one coarse step of the pick) gets the ECE (equal-width bins) and the Brier score of
    ``a_{k-1} * sigmoid(z_k / T)`` against ``prod_{i<=k} y_i``. The pick is the least Brier among the
    candidates whose ECE is within ``ece_tol`` of the least ECE (ties: T nearest 1). Why: ECE alone
    is flat in T where the survival spread is small, and its arg-min then runs to a grid bound; the
    Brier score is a proper scoring rule (Gneiting & Raftery 2007), so within the ECE-flat band it
    prefers the true temperature. A position with fewer than ``min_blocks`` valid rows keeps the
    previous position's temperature (position 1: T = 1), so a thin tail of long blocks cannot move it.
    ``T_k`` depends on positions ``<= k`` only, so fitting k never changes ``T_{<k}``.

    Args:
        z: confidence logits [N, gamma], float. y: labels [N, gamma], float in [0, 1] (expected
            acceptance c*_k, or 0/1 acceptance / prefix-survival indicators).
        valid: bool [N, gamma] or None (all valid); a row counts at k only if valid at all ``i <= k``.
        n_bins: ECE bin count. t_min, t_max, grid_step: search range and coarse step (unitless).
        refine: add the fine local grid. ece_tol: width of the ECE-flat band (absolute, >= 0; 0 = pure
            ECE arg-min). min_blocks: least valid rows to fit a position (>= 1).
    Returns:
        temperatures [gamma], float64, each in [min(t_min, 1), max(t_max, 1)].
    Raises:
        ValueError: bad shapes, labels outside [0, 1], non-finite logits, or a bad search range.
    """
    if not (0 < t_min < t_max) or grid_step <= 0 or ece_tol < 0 or min_blocks < 1:
        raise ValueError(f"need 0 < t_min < t_max, grid_step > 0, ece_tol >= 0, min_blocks >= 1; got "
                         f"t_min={t_min}, t_max={t_max}, grid_step={grid_step}, ece_tol={ece_tol}, "
                         f"min_blocks={min_blocks}")
    z64, y64, cum_valid = _check_inputs(z, y, valid)
    grid = _search_grid(t_min, t_max, grid_step)
    gamma = z64.shape[1]
    temps = torch.ones(gamma, dtype=torch.float64)
    cum_label = torch.cumprod(y64, dim=1)
    prev = torch.ones(z64.shape[0], dtype=torch.float64)      # a_{k-1} with fitted T_{<k}
    for k in range(gamma):
        rows = cum_valid[:, k]
        if int(rows.sum()) < min_blocks:
            temps[k] = temps[k - 1] if k else 1.0
        else:
            zk, p, lab = z64[rows, k], prev[rows], cum_label[rows, k]
            t = _select(grid, *_scores(grid, p, zk, lab, n_bins), ece_tol)
            if refine:
                fine = t + grid_step / 10 * torch.arange(-10, 11, dtype=torch.float64)
                inside = (fine >= min(t_min, 1.0)) & (fine <= max(t_max, 1.0))
                fine = torch.unique(torch.cat([fine[inside], torch.tensor([t], dtype=torch.float64)]))
                t = _select(fine, *_scores(fine, p, zk, lab, n_bins), ece_tol)
            temps[k] = t
        prev = prev * torch.sigmoid(z64[:, k] / temps[k])
    return temps


def fit_global_temperature(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None, *,
                           n_bins: int = 15, t_min: float = T_MIN, t_max: float = T_MAX,
                           grid_step: float = 0.01, ece_tol: float = ECE_TOL) -> float:
    """One temperature for every position: the transform a runtime applying the raw head can express.

    Each T on a coarse grid ``t_min..t_max`` (step ``max(grid_step, 0.05)``, plus T = 1), then on a grid of
    step ``grid_step`` within one coarse step of the pick, scores the survival
    ``a_k = prod_{i<=k} sigmoid(z_i / T)`` against ``prod_{i<=k} y_i`` by the row-weighted mean over
    positions of the per-position ECE and of the Brier score; the pick is the least Brier among the
    T whose mean ECE is within ``ece_tol`` of the least (as :func:`fit_temperatures`).

    Args:
        z, y, valid: as in :func:`fit_temperatures` ([N, gamma]). n_bins, t_min, t_max, grid_step,
            ece_tol: as there.
    Returns:
        T (float) in [min(t_min, 1), max(t_max, 1)]; 1.0 when no row is valid.
    Raises:
        ValueError: as :func:`fit_temperatures`.
    """
    if not (0 < t_min < t_max) or grid_step <= 0 or ece_tol < 0:
        raise ValueError(f"need 0 < t_min < t_max, grid_step > 0, ece_tol >= 0; got t_min={t_min}, "
                         f"t_max={t_max}, grid_step={grid_step}, ece_tol={ece_tol}")
    z64, y64, cum_valid = _check_inputs(z, y, valid)
    if not cum_valid.any():
        return 1.0
    cum_label = torch.cumprod(y64, dim=1)
    n = cum_valid.sum(0).double()

    def scores(temps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        errs = torch.zeros(temps.numel(), dtype=torch.float64)
        briers = torch.zeros(temps.numel(), dtype=torch.float64)
        rows_per = max(1, 4_000_000 // max(1, z64.numel()))
        for i in range(0, temps.numel(), rows_per):
            t = temps[i:i + rows_per]
            a = torch.cumprod(torch.sigmoid(z64[None] / t[:, None, None]), dim=2)     # [g, N, gamma]
            for k in range(z64.shape[1]):
                rows = cum_valid[:, k]
                if rows.any():
                    ak, lab = a[:, rows, k], cum_label[rows, k]
                    errs[i:i + rows_per] += n[k] * ece(ak, lab, n_bins)
                    briers[i:i + rows_per] += ((ak - lab) ** 2).sum(-1)
        return errs / n.sum(), briers / n.sum()

    coarse_step = max(grid_step, 0.05)
    t = _select(grid := _search_grid(t_min, t_max, coarse_step), *scores(grid), ece_tol)
    fine = t + grid_step * torch.arange(-round(coarse_step / grid_step), round(coarse_step / grid_step) + 1,
                                        dtype=torch.float64)
    fine = torch.unique(torch.cat([fine[(fine >= min(t_min, 1.0)) & (fine <= max(t_max, 1.0))],
                                   torch.tensor([t], dtype=torch.float64)]))
    return _select(fine, *scores(fine), ece_tol)


def at_bounds(T: torch.Tensor | list[float], t_min: float = T_MIN, t_max: float = T_MAX,
              rtol: float = 1e-6) -> list[int]:
    """1-based positions whose temperature sits at a search bound (within ``rtol``): a fit to inspect."""
    return [k + 1 for k, t in enumerate(torch.as_tensor(T, dtype=torch.float64).tolist())
            if abs(t - t_min) <= rtol * t_min or abs(t - t_max) <= rtol * t_max]


def _position_metrics(a: torch.Tensor, label: torch.Tensor, n_bins: int, threshold: float) -> dict:
    """ECE (equal-width and equal-mass bins) / Brier / AUC of survival ``a`` [n] against the cumulative
    label [n]; undefined values -> None (JSON)."""
    area = auc(a, label >= threshold)
    return {"ece": float(ece(a, label, n_bins)) if a.numel() else None,
            "ece_mass": ece_equal_mass(a, label, n_bins) if a.numel() else None,
            "brier": brier(a, label) if a.numel() else None,
            "auc": None if math.isnan(area) else area}


def calibration_report(z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None,
                       T: torch.Tensor | list[float], *, n_bins: int = 15,
                       auc_threshold: float = 0.5, global_temperature: float | None = None) -> dict:
    """Per-position calibration of the survival ``a_k`` before (all T = 1) and after STS (and, given
    ``global_temperature``, with that one temperature at every position: key ``"global"``).

    Args:
        z, y, valid: as in :func:`fit_temperatures` ([N, gamma]). T: temperatures [gamma].
        n_bins: ECE bins. auc_threshold: the cumulative label is binarised as ``label >= threshold``
            for AUC (exact for 0/1 labels).
    Returns:
        JSON-able dict: ``{"n_bins", "temperatures": [gamma floats], "positions": [{"k": 1-based,
        "n": rows, "before": {"ece", "ece_mass", "brier", "auc"}, "after": {...}}]}``; a metric that is undefined
        (no rows, or AUC with one class) is ``None``.
    Raises:
        ValueError: as :func:`fit_temperatures`, or bad temperatures.
    """
    z64, y64, cum_valid = _check_inputs(z, y, valid)
    T = _check_temperatures(T, z64.shape[1])
    cum_label = torch.cumprod(y64, dim=1)
    a_before = torch.cumprod(torch.sigmoid(z64), dim=1)
    a_after = torch.cumprod(torch.sigmoid(z64 / T), dim=1)
    a_global = None if global_temperature is None else torch.cumprod(torch.sigmoid(z64 / global_temperature), 1)
    positions = []
    for k in range(z64.shape[1]):
        rows = cum_valid[:, k]
        lab = cum_label[rows, k]
        positions.append({"k": k + 1, "n": int(rows.sum()),
                          "before": _position_metrics(a_before[rows, k], lab, n_bins, auc_threshold),
                          "after": _position_metrics(a_after[rows, k], lab, n_bins, auc_threshold)})
        if a_global is not None:
            positions[-1]["global"] = _position_metrics(a_global[rows, k], lab, n_bins, auc_threshold)
    return {"n_bins": n_bins, "temperatures": [float(t) for t in T], "positions": positions}


def foldable_temperature(T: torch.Tensor | list[float], rtol: float = 0.05) -> float | None:
    """Decide whether one temperature can replace all, so it folds into the confidence head.

    The head is shared across positions, so dividing its weight and bias by one ``T`` scales every
    logit by ``1/T``; that reproduces per-position STS only if all ``T_k`` agree. Agreement means
    ``max(T) / min(T) - 1 <= rtol``.

    Args:
        T: temperatures [gamma], finite and > 0. rtol: relative tolerance (>= 0), e.g. 0.05 = 5 %.
    Returns:
        the geometric mean of T (float) if they agree, else None (export the per-position vector).
    Raises:
        ValueError: bad temperatures or ``rtol < 0``.
    """
    if rtol < 0:
        raise ValueError(f"rtol must be >= 0, got {rtol}")
    T = torch.as_tensor(T, dtype=torch.float64).flatten()
    T = _check_temperatures(T, T.numel())
    if T.numel() == 0 or float(T.max() / T.min()) - 1.0 > rtol:
        return None
    return float(T.log().mean().exp())


def plot_reliability(path: str, z: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None,
                     T: torch.Tensor | list[float], *, n_bins: int = 15) -> str:
    """Write a reliability-diagram PNG: one panel per position k, survival ``a_k`` before / after STS.

    Each panel plots, per non-empty equal-width bin, the mean predicted survival (x) against the mean
    cumulative label (y), with the diagonal as perfect calibration and the ECE in the legend.

    Args:
        path: destination, any fsspec URL or local path (``.png``).
        z, y, valid, T: as in :func:`calibration_report`. n_bins: bins per panel.
    Returns:
        ``path``.
    Raises:
        ValueError: as :func:`calibration_report`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    z64, y64, cum_valid = _check_inputs(z, y, valid)
    T = _check_temperatures(T, z64.shape[1])
    gamma = z64.shape[1]
    cum_label = torch.cumprod(y64, dim=1)
    fig = Figure(figsize=(3.2 * gamma, 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, gamma, squeeze=False)
    for k, ax in enumerate(axes[0]):
        rows = cum_valid[:, k]
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for name, temps, style in (("before", torch.ones_like(T), "o-"), ("after", T, "s-")):
            a = torch.cumprod(torch.sigmoid(z64[rows, : k + 1] / temps[: k + 1]), dim=1)[:, -1]
            sc, sl, cnt = reliability_bins(a, cum_label[rows, k], n_bins)
            keep = cnt > 0
            err = float(ece(a, cum_label[rows, k], n_bins)) if a.numel() else math.nan
            ax.plot((sc[keep] / cnt[keep]).numpy(), (sl[keep] / cnt[keep]).numpy(), style, ms=3,
                    label=f"{name} ECE={err:.3f}")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted survival a_k", title=f"k={k + 1}  T={float(T[k]):.2f}")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("observed survival")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    with fsspec.open(path, "wb") as f:
        f.write(buf.getvalue())
    return path
