"""Hardware-aware verification scheduler (DSpark Algorithm 1) and its offline throughput simulator.

Terms: R requests in a decode step, each with a drafted block of gamma tokens and calibrated
conditional acceptance ``c_{r,j}`` (j = 1..gamma); survival ``a_{r,j} = prod_{i<=j} c_{r,i}`` is the
probability that draft j is accepted. Verifying ``l_r`` drafts of request r costs ``1 + l_r`` target
tokens in the verify forward (the drafts plus the position that yields the resampled / bonus token),
so the step processes ``B = sum_r (1 + l_r)`` tokens.

- ``tau(B) = sum_r (1 + sum_{j<=l_r} a_{r,j})``: expected tokens emitted per verify step across the
  batch, the bonus / resampled token included (each request emits its accepted prefix plus one).
- ``SPS(B)``: target verify steps per second at B tokens per step (a measured :class:`SPSCurve`).
- ``Theta = tau(B) * SPS(B)``: expected tokens per second.

Algorithm 1: sort all (r, j) by ``a_{r,j}`` descending and admit them one by one while Theta strictly
rises; stop at the first candidate that does not raise it. Survival is non-increasing in j
(``c <= 1``) and ties are broken by j, so (r, j) always ranks before (r, j + 1): the admitted set of
each request is a contiguous prefix ``1..l_r``, and the decision for (r, j) depends only on
candidates ranked above it, never on a later position of the same request (non-anticipating, which
keeps speculative sampling lossless). Production variant: the budget ``K`` (admitted drafts) comes
from the confidences of two steps earlier; the current step admits the top-K by current survival.

The oracle bound (:func:`_oracle_lengths`): knowing every outcome (after the fact, so no engine can run
it), a step never verifies a rejected draft, and only the number m of accepted drafts it verifies
matters: it emits ``R + m`` tokens in ``1 / SPS(R + m)`` seconds. Any plan that verifies ``l_r`` drafts
emits ``R + m'`` tokens with ``m' = sum_r min(l_r, accepted_r)`` in at least that time (SPS does not rise
with B), so the best choice of m per step, over all steps together (Dinkelbach's method for the ratio of
sums: each step maximises ``(R + m) - rho / SPS(R + m)`` at the current ``rho``, then ``rho`` = tokens /
seconds, until no step changes), is the highest tokens/s any verification policy reaches on the same
blocks and curve: what a perfect confidence estimator would gain over the best fixed block, the
ceiling against which an estimator's gain is judged. Where ``B SPS(B)`` does not fall (the roofline
model), the oracle verifies exactly the accepted drafts.

Fallback to the fixed block (:func:`adaptive_can_pay`): the serving engine runs a fixed block of
``g`` drafts (vLLM's ``num_speculative_tokens``, chosen by benchmark: the best fixed block). Whatever
it verifies, a step of R requests with blocks of gamma drafts processes between R and R (1 + gamma)
tokens, so choosing per-request lengths can change its speed by at most ``SPS(R) / SPS(R (1 +
gamma))``; when that ceiling is below ``1 + min_speedup`` the curve says verifying fewer (or other)
drafts cannot pay for the tokens it risks, and every request verifies the fixed ``g`` drafts: the
step is then exactly the fixed block's, so the policy is 1.00x the best fixed block there by
construction (Algorithm 1 alone lost ~3% at R = 1, where the curve is flat, on miscalibrated
confidences). The decision reads the curve alone, never a confidence: non-anticipating (lossless).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import fsspec
import numpy as np

__all__ = ["SPSCurve", "Schedule", "MIN_SPEEDUP", "survival", "schedule", "fill_top_k", "schedule_production",
           "adaptive_can_pay", "simulate"]

MIN_SPEEDUP = 0.10
"""Default ``min_speedup`` of :func:`adaptive_can_pay`: adaptive verification runs only where the
curve's speed at R tokens per step is at least 10% above its speed at R (1 + gamma) (below that, the
gain of any per-request choice, a fraction of this ceiling, is within the confidences' calibration
error and Algorithm 1 lost to the best fixed block)."""


class SPSCurve:
    """Target verify steps per second as a function of tokens per step B (piecewise linear).

    Built from a measured table of ``(B, steps/s)``. With ``monotone=True`` (default) the table is made
    non-increasing in B by a running minimum (more tokens per step never run faster; noise that says
    otherwise is dropped conservatively). Below the first point SPS is constant; beyond the last,
    tokens per second ``B * SPS(B)`` is held constant (compute-bound extrapolation).

    Args:
        batch_tokens: B values (tokens per step, > 0, distinct). steps_per_s: SPS at each B (> 0).
        monotone: enforce non-increasing SPS.
    Raises:
        ValueError: empty or mismatched table, duplicate B, or non-positive / non-finite values.
    """

    def __init__(self, batch_tokens: Sequence[float], steps_per_s: Sequence[float], monotone: bool = True):
        b = np.asarray(batch_tokens, dtype=np.float64)
        s = np.asarray(steps_per_s, dtype=np.float64)
        if b.ndim != 1 or b.shape != s.shape or b.size == 0:
            raise ValueError(f"need two equal-length non-empty 1-D tables, got {b.shape} and {s.shape}")
        if not (np.isfinite(b).all() and np.isfinite(s).all() and (b > 0).all() and (s > 0).all()):
            raise ValueError("B and steps/s must be finite and > 0: drop failed measurements from the table")
        order = np.argsort(b, kind="stable")
        b, s = b[order], s[order]
        if (np.diff(b) == 0).any():
            raise ValueError("duplicate B in the SPS table: average repeated measurements first")
        self.monotone = monotone
        self.batch_tokens = b
        self.steps_per_s = np.minimum.accumulate(s) if monotone else s

    def __call__(self, B: float | np.ndarray) -> np.ndarray:
        """SPS (steps/s) at B tokens per step (scalar or array, > 0); float64 of the same shape."""
        B = np.asarray(B, dtype=np.float64)
        inside = np.interp(B, self.batch_tokens, self.steps_per_s)
        b_max, s_max = self.batch_tokens[-1], self.steps_per_s[-1]
        return np.where(B > b_max, s_max * b_max / np.maximum(B, b_max), inside)

    def to_dict(self) -> dict:
        """JSON-able ``{"batch_tokens": [...], "steps_per_s": [...], "monotone": bool}`` (as stored)."""
        return {"batch_tokens": self.batch_tokens.tolist(), "steps_per_s": self.steps_per_s.tolist(),
                "monotone": self.monotone}

    def save(self, path: str) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (any fsspec URL)."""
        with fsspec.open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path: str) -> "SPSCurve":
        """Read a curve written by :meth:`save` (or by hand: the same two lists).

        Raises:
            BadInputFileError: not JSON, the keys missing, or a table the constructor refuses (the
                message names the file and the fix).
        """
        from pipeline.errors import BadInputFileError

        try:
            with fsspec.open(path, "r") as f:
                d = json.load(f)
            if not isinstance(d, dict) or "batch_tokens" not in d or "steps_per_s" not in d:
                raise ValueError("need a JSON object with lists 'batch_tokens' and 'steps_per_s'")
            return cls(d["batch_tokens"], d["steps_per_s"], d.get("monotone", True))
        except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise BadInputFileError(f"{path} is not a usable SPS table: {e}") from None


@dataclass(frozen=True)
class Schedule:
    """One step's verification plan.

    Attributes:
        lengths: int64 [R], drafts verified per request (l_r).
        admitted: bool [R, gamma], ``admitted[r, j] == (j < lengths[r])`` (contiguous prefixes).
        batch_tokens: B = sum_r (1 + l_r), tokens in the verify forward.
        expected_tokens: tau = sum_r (1 + sum_{j<=l_r} a_{r,j}), expected tokens emitted this step.
        throughput: Theta = tau * SPS(B), expected tokens per second.
    """

    lengths: np.ndarray
    admitted: np.ndarray
    batch_tokens: int
    expected_tokens: float
    throughput: float


def survival(conf: np.ndarray) -> np.ndarray:
    """Survival ``a_{r,j} = prod_{i<=j} c_{r,i}`` (DSpark, prefix survival) of conditional acceptances.

    Args:
        conf: [R, gamma] float in [0, 1] (calibrated c_{r,j}).
    Returns:
        float64 [R, gamma], non-increasing along j.
    Raises:
        ValueError: not 2-D, or an entry outside [0, 1] / NaN.
    """
    c = np.asarray(conf, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidences must be [R, gamma], got shape {c.shape}")
    if not ((c >= 0) & (c <= 1)).all():
        raise ValueError("confidences must be calibrated probabilities in [0, 1]: apply sigmoid(z / T)")
    return np.cumprod(c, axis=1)


def _plan(a: np.ndarray, n_admit: int, sps: SPSCurve, position: np.ndarray | None = None) -> Schedule:
    """Admit the top ``n_admit`` (r, j) by survival (ranks ``position`` of :func:`_schedule_steps`,
    computed when not given) and evaluate B, tau, Theta."""
    R, gamma = a.shape
    if position is None:
        position = _schedule_steps(a[None], sps)[1]
    lengths = _prefix_lengths(position, np.array([n_admit]), R)[0]
    admitted = np.arange(gamma) < lengths[:, None]
    B = int(R + n_admit)
    tau = float(R + a[admitted].sum())
    return Schedule(lengths, admitted, B, tau, float(tau * sps(B)) if R else 0.0)


def adaptive_can_pay(sps: SPSCurve, R: int, gamma: int, min_speedup: float = MIN_SPEEDUP) -> bool:
    """Whether choosing per-request verified lengths can pay at concurrency R with blocks of gamma
    drafts: ``SPS(R) >= (1 + min_speedup) SPS(R (1 + gamma))``, the largest change of step speed any
    choice of lengths can make (module doc). A pure function of the curve.

    Args:
        sps: :class:`SPSCurve` (steps/s over tokens per step). R: requests >= 1.
        gamma: drafts per block >= 0. min_speedup: >= 0 (0: adaptive at every R).
    Raises:
        ValueError: R < 1, gamma < 0 or min_speedup < 0.
    """
    if R < 1 or gamma < 0 or not min_speedup >= 0:
        raise ValueError(f"need R >= 1, gamma >= 0 and min_speedup >= 0, got {R}, {gamma}, {min_speedup}")
    return bool(sps(R) >= (1 + min_speedup) * sps(R * (1 + gamma)))


def _fixed(a: np.ndarray, g: int, sps: SPSCurve) -> Schedule:
    """Every request verifies ``min(g, gamma)`` drafts (the fixed block)."""
    R, gamma = a.shape
    admitted = np.zeros((R, gamma), dtype=bool)
    admitted[:, :min(g, gamma)] = True
    B = int(R + admitted.sum())
    tau = float(R + a[admitted].sum())
    return Schedule(admitted.sum(1).astype(np.int64), admitted, B, tau, float(tau * sps(B)) if R else 0.0)


def schedule(conf: np.ndarray, sps: SPSCurve) -> Schedule:
    """DSpark Algorithm 1: greedy admission by survival while Theta = tau(B) * SPS(B) strictly rises.

    Starting from no drafts (B = R, tau = R), candidates are taken in order of descending ``a_{r,j}``
    (ties: smaller j first); candidate m gives ``B_m = R + m`` and ``tau_m = R + sum of the first m
    survivals``; admission stops at the first m with ``Theta_m <= Theta_{m-1}``. When Theta along this
    order is unimodal the result maximises Theta over all per-request prefix lengths (for a fixed B the
    top survivals maximise tau).

    Args:
        conf: [R, gamma] calibrated conditional acceptances c_{r,j} in [0, 1].
        sps: measured :class:`SPSCurve`.
    Returns:
        :class:`Schedule` with contiguous prefixes.
    Raises:
        ValueError: as :func:`survival`.
    """
    a = survival(conf)
    n_admit, position = _schedule_steps(a[None], sps)
    return _plan(a, int(n_admit[0]), sps, position)


def fill_top_k(conf: np.ndarray, budget: int, sps: SPSCurve) -> Schedule:
    """Admit exactly ``min(budget, R * gamma)`` drafts with the highest current survival (ties by j).

    Args:
        conf: [R, gamma] calibrated c_{r,j}. budget: K >= 0 drafts. sps: for the reported Theta.
    Returns:
        :class:`Schedule` (contiguous prefixes).
    Raises:
        ValueError: ``budget < 0`` or bad confidences.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0 drafts, got {budget}")
    a = survival(conf)
    return _plan(a, min(int(budget), a.size), sps)


def schedule_production(conf_now: np.ndarray, conf_stale: np.ndarray, sps: SPSCurve) -> Schedule:
    """Production variant of Algorithm 1: budget from stale confidences, top-K by current survival.

    The serving engine overlaps scheduling with execution, so the budget ``K`` is the number of drafts
    Algorithm 1 admits on the confidences available two steps earlier (``conf_stale``, any request
    count); the current step then admits the top-K (r, j) by current survival.

    Args:
        conf_now: [R, gamma] current calibrated c_{r,j}. conf_stale: [R', gamma'] two steps old.
        sps: :class:`SPSCurve`.
    Returns:
        :class:`Schedule` for ``conf_now``.
    Raises:
        ValueError: bad confidences.
    """
    budget = int(schedule(conf_stale, sps).lengths.sum())
    return fill_top_k(conf_now, budget, sps)


def _schedule_steps(a: np.ndarray, sps: SPSCurve) -> tuple[np.ndarray, np.ndarray]:
    """:func:`schedule` for many steps at once: ``a`` float64 [S, R, gamma] survivals of S steps.

    Returns ``(n_admit, position)``: int64 [S], the drafts Algorithm 1 admits at each step, and int64
    [S, gamma * R], the rank of each (r, j) in that step's order (flattened as ``j * R + r``, so that a
    stable sort of ``-a`` breaks ties by j, then r: (r, j) ranks before (r, j + 1)). Identical to calling
    :func:`schedule` step by step (the same sums in the same order; ``tests/unit/pipeline/test_scheduler.py``).
    """
    S, R, gamma = a.shape
    flat = a.transpose(0, 2, 1).reshape(S, gamma * R)
    order = np.argsort(-flat, axis=1, kind="stable")
    m = np.arange(gamma * R + 1)
    taken = np.concatenate([np.zeros((S, 1)), np.cumsum(np.take_along_axis(flat, order, axis=1), axis=1)], axis=1)
    drops = np.diff((R + taken) * sps(R + m), axis=1) <= 0
    first = drops.argmax(axis=1) if drops.shape[1] else np.zeros(S, dtype=np.int64)  # R = 0: nothing to admit
    n_admit = np.where(drops.any(axis=1), first, gamma * R)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(m[:-1], order.shape), axis=1)
    return n_admit, position


def _prefix_lengths(position: np.ndarray, budget: np.ndarray, R: int) -> np.ndarray:
    """Verified drafts per request, int64 [S, R], when each step admits its top ``budget[s]`` (r, j) by the
    ranks ``position`` of :func:`_schedule_steps` (:func:`fill_top_k` step by step)."""
    S = position.shape[0]
    return (position < budget[:, None]).reshape(S, position.shape[1] // max(R, 1), R).sum(axis=1)


def _oracle_lengths(accepted: np.ndarray, R: int, sps: SPSCurve, max_iter: int = 100) -> np.ndarray:
    """The oracle's verified drafts per request (module doc: the bound no verification policy beats).

    Args:
        accepted: int [S, R] realised accepted drafts of each request in each of S steps.
        R: requests per step. sps: the step's cost curve (steps/s at B tokens per step).
        max_iter: Dinkelbach iterations at most (each step's count m only moves while the ratio rises;
            a few suffice in practice).
    Returns:
        int64 [S, R]: per step the count m maximising the run's tokens / seconds (Dinkelbach 1967, the
        ratio of sums), given to the requests in order and never past a request's accepted drafts.
    """
    total = accepted.sum(axis=1)
    m = np.arange(int(total.max()) + 1)
    seconds = 1.0 / sps(R + m)
    feasible = m[None, :] <= total[:, None]
    choice = total.copy()
    for _ in range(max_iter):
        rho = float((R + choice).sum()) / float(seconds[choice].sum())
        new = np.where(feasible, (R + m)[None, :] - rho * seconds[None, :], -np.inf).argmax(axis=1)
        if (new == choice).all():
            break
        choice = new
    before = np.cumsum(accepted, axis=1) - accepted
    return np.clip(choice[:, None] - before, 0, accepted).astype(np.int64)


def _summary(tokens: float, seconds: float, steps: int, R: int, verified: float) -> dict:
    """Throughput summary of one policy at concurrency R over ``steps`` steps."""
    tps = tokens / seconds
    return {"tokens_per_s": tps, "tokens_per_s_per_user": tps / R, "tau": tokens / (steps * R),
            "verified_per_request": verified / (steps * R)}


def _curve(sps: SPSCurve | Mapping[int, SPSCurve], R: int) -> SPSCurve:
    """The curve of concurrency R: ``sps`` itself, or ``sps[R]`` (one curve per R, e.g. the roofline's)."""
    if isinstance(sps, SPSCurve):
        return sps
    if R not in sps:
        raise ValueError(f"no SPS curve for R = {R}: pass one per concurrency (have {sorted(sps)})")
    return sps[R]


def simulate(outcomes: np.ndarray, conf: np.ndarray, sps: SPSCurve | Mapping[int, SPSCurve], *,
             concurrency: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
             n_steps: int = 200, seed: int = 0, min_speedup: float | None = MIN_SPEEDUP,
             adaptive_at: Sequence[int] | None = None) -> dict:
    """Replay recorded blocks to compare fixed gamma against the scheduler (DSpark Algorithm 1).

    At concurrency R, each of ``n_steps`` steps draws R recorded blocks uniformly with replacement
    (``numpy.random.default_rng(seed)``; the same draws for every policy). A request that verifies l
    drafts emits ``1 + sum_{j<=l} outcome_j`` tokens (accepted prefix plus resample / bonus) and the
    step takes ``1 / SPS(B)`` seconds with ``B = sum_r (1 + l_r)``. Throughput = total tokens / total
    seconds. The production variant takes its budget from the blocks drawn two steps earlier (the
    first two steps use their own confidences). Both adaptive policies fall back to the best fixed
    block (the engine's configured ``num_speculative_tokens``) where :func:`adaptive_can_pay` says
    other verified lengths cannot pay (module doc); ``min_speedup=None`` turns the fallback off
    (Algorithm 1 alone, as the paper). ``adaptive_at`` restricts the adaptive policies further to the
    concurrencies it lists (e.g. where they beat the best fixed block on calibration rounds:
    :func:`pipeline.inference.realised.compare`).

    Args:
        outcomes: [M, gamma] 0/1 realised acceptances, prefix-closed (1s then 0s).
        conf: [M, gamma] calibrated conditional acceptances c_{r,j} in [0, 1] of the same blocks.
        sps: :class:`SPSCurve`, or ``{R: SPSCurve}`` one per concurrency (the roofline's
            :func:`pipeline.inference.roofline.sps_curves`). concurrency: R values (>= 1).
        n_steps: steps per R (>= 1). seed: RNG seed. min_speedup: the fallback's threshold (>= 0) or None.
        adaptive_at: the R values where adaptive verification may run, or None (every R).
    Returns:
        JSON-able dict ``{"gamma", "n_steps", "seed", "min_speedup", "results": [per R: {"R", "fixed":
        {"1": summary, ...}, "scheduler": summary, "production": summary, "algorithm1": summary (DSpark
        Algorithm 1 alone, no fallback, for comparison), "oracle": summary (the best plan knowing
        the outcomes: the bound of the module doc), "best_fixed_gamma", "adaptive"
        (False where the fallback verified the fixed block), "ratio_scheduler", "ratio_production",
        "ratio_algorithm1", "ratio_oracle"}]}``; a summary is ``{"tokens_per_s", "tokens_per_s_per_user", "tau"
        (tokens per request per step, bonus included), "verified_per_request"}`` and the ratios are
        tokens/s over the best fixed gamma's tokens/s.
    Raises:
        ValueError: shape mismatch, outcomes not 0/1 prefix-closed, bad R / n_steps / min_speedup,
            or no curve for an R.
    """
    out = np.asarray(outcomes)
    c = np.asarray(conf, dtype=np.float64)
    if out.ndim != 2 or out.shape != c.shape or out.shape[0] == 0:
        raise ValueError(f"outcomes and conf must be the same non-empty [M, gamma], got {out.shape}, {c.shape}")
    if not np.isin(out, (0, 1)).all() or (np.diff(out.astype(np.int64), axis=1) > 0).any():
        raise ValueError("outcomes must be 0/1 and prefix-closed (no 1 after a 0): take the cumulative "
                         "product of per-position acceptances")
    survival(c)                                   # validates conf: [M, gamma] in [0, 1]
    if n_steps < 1 or any(int(r) < 1 for r in concurrency):
        raise ValueError(f"need n_steps >= 1 and every R >= 1, got {n_steps}, {list(concurrency)}")
    if min_speedup is not None and not min_speedup >= 0:
        raise ValueError(f"min_speedup must be >= 0 (or None: no fallback to the fixed block), got {min_speedup}")
    gamma = out.shape[1]
    accepted_upto = np.concatenate([np.zeros((out.shape[0], 1)), np.cumsum(out, axis=1)], axis=1)
    a_all = survival(c)
    rng = np.random.default_rng(seed)
    results = []
    for R in (int(r) for r in concurrency):
        curve = _curve(sps, R)
        idx = rng.integers(0, out.shape[0], size=(n_steps, R))
        fixed = {}
        for g in range(1, gamma + 1):
            tokens = float((1 + accepted_upto[idx, g]).sum())
            fixed[str(g)] = _summary(tokens, n_steps / float(curve(R * (1 + g))), n_steps, R, n_steps * R * g)
        best = max(fixed, key=lambda g: fixed[g]["tokens_per_s"])
        adaptive = (min_speedup is None or adaptive_can_pay(curve, R, gamma, min_speedup)) and (
            adaptive_at is None or R in adaptive_at)
        n_admit, position = _schedule_steps(a_all[idx], curve)
        lengths = {"algorithm1": _prefix_lengths(position, n_admit, R),
                   "oracle": _oracle_lengths(out[idx].sum(axis=2), R, curve)}
        if adaptive:
            lengths["scheduler"] = lengths["algorithm1"]
            stale = np.concatenate([n_admit[:2], n_admit[:-2]])[:n_steps]  # the budget of two steps earlier
            lengths["production"] = _prefix_lengths(position, stale, R)
        else:
            lengths["scheduler"] = lengths["production"] = np.full((n_steps, R), min(int(best), gamma))
        entry = {"R": R, "fixed": fixed, "best_fixed_gamma": int(best), "adaptive": adaptive}
        for name in ("scheduler", "production", "algorithm1", "oracle"):
            ln = lengths[name]
            tokens = float((1 + np.take_along_axis(accepted_upto[idx], ln[..., None], axis=2)).sum())
            seconds = 0.0
            for step_seconds in (1.0 / curve(R + ln.sum(1))).tolist():  # summed in step order
                seconds += step_seconds
            entry[name] = _summary(tokens, seconds, n_steps, R, float(ln.sum()))
            entry[f"ratio_{name}"] = entry[name]["tokens_per_s"] / fixed[best]["tokens_per_s"]
        results.append(entry)
    return {"gamma": gamma, "n_steps": n_steps, "seed": seed, "min_speedup": min_speedup, "results": results}
