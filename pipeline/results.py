"""The one-screen results of a run, composed from the stages' summaries (printed after ``all``).

Why apart from the evaluate stage's report (:mod:`pipeline.eval_report`): this reads every stage's
summary, not only evaluate's.
"""
from __future__ import annotations

from typing import Any

from pipeline.config import RenderConfig
from pipeline.eval_report import DISPLAY, RATIO_PAIRS, task_table, tau_cell
from pipeline.chats.render import thinking_mode
from storage import join, read_json


def _read(url: str) -> dict[str, Any] | None:
    try:
        return read_json(url)
    except FileNotFoundError:
        return None


def results_table(run_dir: str, stages: dict[str, dict[str, Any]]) -> str:
    """Markdown: decoding-loop tau per drafter at each temperature with the DSpark/DFlash (/EAGLE-3) ratios, per task
    with the macro average (when the prompts form several tasks), the paired block-level table, the held-out learning curves' end points, ECE before/after STS per
    position, cache bytes per token, and every stage's time."""
    lines = [f"# Results of {run_dir}", ""]
    ev = stages.get("evaluate") or _read(join(run_dir, "evaluate", "summary.json"))
    if ev and "enable_thinking" in ev:
        lines += [f"Chats and prompts rendered with {thinking_mode(RenderConfig(enable_thinking=ev['enable_thinking']))}: "
                  "serve the drafters in that mode.", ""]
    if ev:
        temps = list(ev["results"])
        names = sorted({n for r in ev["results"].values() for n in r["drafters"]})
        lines += ["| drafter | " + " | ".join(f"tau {t}" for t in temps) + " |", "|---|" + "---|" * len(temps)]
        for n in names:
            cells = [tau_cell(ev["results"][t]["drafters"][n]["overall"]) for t in temps]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        for a, b in RATIO_PAIRS:
            if {a, b} <= set(names):
                ratio = [ev["results"][t]["drafters"][a]["overall"]["tau"]
                         / ev["results"][t]["drafters"][b]["overall"]["tau"] for t in temps]
                lines.append(f"| {DISPLAY[a]} / {DISPLAY[b]} | " + " | ".join(f"{r:.3f}" for r in ratio) + " |")
        lines += task_table(ev["results"])
        lines.append("")
    if ev and ev.get("blocks"):
        b = ev["blocks"]
        lines += [f"Paired block-level speculative sampling on held-out cache blocks (shards {b['heldout_shards']}; "
                  "same anchors and random numbers for every drafter; ± is one standard error):", "",
                  b["table"]]
    train = stages.get("train") or _read(join(run_dir, "train", "summary.json")) or {}
    curves = [f"{n} {d['validation']['last']['tau_expected']:.3f} at step {d['validation']['last']['step']} "
              f"(best {d['validation']['best']['tau_expected']:.3f} at {d['validation']['best']['step']})"
              for n, d in sorted(train.get("drafters", {}).items()) if d.get("validation")]
    if curves:
        lines.append("held-out learning curves (validation shards, tau_expected): " + ", ".join(curves))
    cal = stages.get("calibrate") or _read(join(run_dir, "calibrate", "summary.json")) or {}
    taus = [f"{n} {d['heldout_tau_expected']:.3f} (block size {d['block_size']})"
            for n, d in sorted(cal.get("drafters", {}).items()) if "heldout_tau_expected" in d]
    if taus:
        lines.append("held-out tau_expected on cache shards: " + ", ".join(taus))
    for name in sorted((stages.get("train") or {}).get("drafters", {})):
        rep = _read(join(run_dir, "calibrate", name, "report.json"))
        if rep:
            before = " ".join(f"{p['before']['ece']:.3f}" for p in rep["positions"] if p["before"]["ece"] is not None)
            after = " ".join(f"{p['after']['ece']:.3f}" for p in rep["positions"] if p["after"]["ece"] is not None)
            lines.append(f"ECE of survival per position, {name}: before STS [{before}], after [{after}]")
    cache = stages.get("cache") or _read(join(run_dir, "cache", "summary.json"))
    if cache:
        lines.append(f"cache: {cache['samples']:,} samples, {cache['tokens']:,} tokens, "
                     f"{cache['bytes_per_token']:,.1f} bytes/token")
    lines += ["", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {s.get('seconds', 0):.1f} |" for name, s in stages.items()]
    return "\n".join(lines) + "\n"
