"""Markdown tables and PNG plots of the evaluate stage's results.

Why apart from the stage: the evaluate stage (:mod:`pipeline.stages.evaluate`) computes; this module only
writes its tables and plots; :mod:`pipeline.results` composes the run's one-screen summary.
"""
from __future__ import annotations

import math
from typing import Any

from storage import filesystem


def write_text(url: str, text: str) -> None:
    write_bytes(url, text.encode())


def write_bytes(url: str, data: bytes) -> None:
    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def tau_cell(m: dict[str, Any] | None) -> str:
    """``"tau ± SE"`` of a metrics dict (``tau``, ``tau_se``), ``"-"`` without a tau."""
    if not m or m.get("tau") is None:
        return "-"
    return f"{m['tau']:.3f}" + ("" if m.get("tau_se") is None else f" ± {m['tau_se']:.3f}")


def macro_average(tasks: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Unweighted mean of per-task tau (the DSpark paper's Table 1 "average" column) and its standard
    error, ``sqrt(sum_t SE_t^2) / n`` (tasks are disjoint prompt sets, so their errors are independent);
    the SE is None when a task has none (fewer than 2 prompts). None without a task that has rounds."""
    rows = [m for m in tasks.values() if m.get("rounds")]
    if not rows:
        return None
    ses = [m.get("tau_se") for m in rows]
    se = None if any(s is None for s in ses) else math.sqrt(sum(s * s for s in ses)) / len(rows)
    return {"tau": sum(m["tau"] for m in rows) / len(rows), "tau_se": se, "tasks": len(rows)}


def task_table(results: dict[str, Any]) -> list[str]:
    """Markdown lines (a blank line first; none with a single task): tau ± SE per task for each sampling
    setting and drafter, and the macro average over tasks (:func:`macro_average`)."""
    tasks = sorted({t for res in results.values() for r in res["drafters"].values() for t in r["tasks"]})
    if len(tasks) < 2:
        return []
    lines = ["", "tau per task (± SE, prompts as clusters) and the macro average over tasks (± SE):", "",
             "| T | drafter | " + " | ".join(tasks) + " | macro |", "|---|---|" + "---|" * (len(tasks) + 1)]
    for key, res in results.items():
        for name, r in res["drafters"].items():
            cells = [tau_cell(r["tasks"][t]) if r["tasks"].get(t, {}).get("rounds") else "-" for t in tasks]
            lines.append(f"| {key[2:]} | {name} | " + " | ".join(cells) + f" | {tau_cell(macro_average(r['tasks']))} |")
    return lines


RATIO_PAIRS = (("dspark", "dflash"), ("dspark", "eagle3"), ("dflash", "eagle3"))
"""Decoding-loop ratios reported where a run has both drafters of the names (the demo's; the DSpark paper's Table 1)."""
DISPLAY = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3"}


def tau_table(results: dict[str, Any], scheduler: dict[str, Any]) -> str:
    """Markdown: tau per drafter and sampling setting (overall and per task), DSpark/DFlash ratio, and
    the scheduler against the best fixed block size per concurrency: ``scheduler`` is ``{setting key:
    {drafter: {curve name ("cpu", "h200_model"): pipeline.inference.scheduler.simulate result}}}``."""
    lines = ["| T | drafter | tau | verified/round | tokens/s | vs target |", "|---|---|---|---|---|---|"]
    for key, res in results.items():
        for name, r in res["drafters"].items():
            o = r["overall"]
            se = f" ± {o['tau_se']:.3f}" if o.get("tau_se") is not None else ""
            lines.append(f"| {key[2:]} | {name} | {o['tau']:.3f}{se} | {o['verified_per_round']:.2f} | "
                         f"{o['tokens_per_s']:.1f} | {o['speedup_vs_target']:.2f}x |")
        lines.append(f"| {key[2:]} | (target alone) | 1.000 | - | {res['target_tokens_per_s']:.1f} | 1.00x |")
    for a, b in RATIO_PAIRS:
        ratios = [f"{key}: {res['drafters'][a]['overall']['tau'] / res['drafters'][b]['overall']['tau']:.3f}"
                  for key, res in results.items() if a in res["drafters"] and b in res["drafters"]]
        if ratios:
            lines += ["", f"tau ratio {DISPLAY[a]} / {DISPLAY[b]}: " + ", ".join(ratios)]
    lines += task_table(results)
    curves = {"cpu": "the measured SPS curve", "h200_model": "the H200 roofline model of Qwen3-4B"}
    for key, per_drafter in scheduler.items():
        for name, by_curve in per_drafter.items():
            for curve, sim in by_curve.items():
                lines += ["", f"scheduler ({name}, {key}, simulated on {curves.get(curve, curve)}; calibrate-stage "
                          "STS confidences; * = fixed-block fallback): tokens/s",
                          "| R | best fixed gamma | fixed | scheduler | ratio | production | ratio | Algorithm 1 alone |",
                          "|---|---|---|---|---|---|---|---|"]
                for r in sim["results"]:
                    best = r["best_fixed_gamma"]
                    star = "" if r.get("adaptive", True) else "*"
                    lines.append(f"| {r['R']}{star} | {best} | {r['fixed'][str(best)]['tokens_per_s']:.0f} | "
                                 f"{r['scheduler']['tokens_per_s']:.0f} | {r['ratio_scheduler']:.3f} | "
                                 f"{r['production']['tokens_per_s']:.0f} | {r['ratio_production']:.3f} | "
                                 f"{r['ratio_algorithm1']:.3f} |")
    return "\n".join(lines) + "\n"


def plot_acceptance(results: dict[str, Any], acceptance_url: str, tau_url: str) -> None:
    """Per-position conditional acceptance and tau per drafter and temperature, as two PNGs."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, res in results.items():
        for name, r in res["drafters"].items():
            cond = r["overall"]["conditional_acceptance"]
            ax.plot(range(1, len(cond) + 1), [c if c is not None else float("nan") for c in cond],
                    marker="o", label=f"{name} {key}")
    ax.set(xlabel="draft position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1.02))
    ax.legend(fontsize=8)
    fig.tight_layout()
    figs = [(fig, acceptance_url)]
    fig2, ax2 = plt.subplots(figsize=(6, 4))
    names = sorted({n for res in results.values() for n in res["drafters"]})
    for i, key in enumerate(results):
        taus = [results[key]["drafters"][n]["overall"]["tau"] if n in results[key]["drafters"] else 0 for n in names]
        ax2.bar([j + 0.8 * i / len(results) for j in range(len(names))], taus, width=0.8 / len(results), label=key)
    ax2.set_xticks(range(len(names)), names)
    ax2.set(ylabel="acceptance length tau")
    ax2.legend()
    fig2.tight_layout()
    figs.append((fig2, tau_url))
    for f, url in figs:
        buf = io.BytesIO()
        f.savefig(buf, format="png", dpi=110)
        plt.close(f)
        write_bytes(url, buf.getvalue())
