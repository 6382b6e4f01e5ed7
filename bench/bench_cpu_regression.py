"""The CPU path before and after a change, paired (issue #35: "the same block-level and decoding-loop
figures on the demo as before the change, within SE"): two code trees evaluate the SAME trained
drafters of one run directory with the same seeds, and the outcomes are compared block by block and
prompt by prompt.

Each tree runs in its own process (``PYTHONPATH=<tree>``, this venv, one torch thread) that calls its
own evaluate stage's pieces on the CPU:

- block level: ``pipeline.stages.evaluate.block_level`` (the stage's held-out blocks, anchors and
  sampling settings); the per-block tau (tokens per block incl. the bonus) is taken from the tally that
  ``training.block_runner.evaluate_blocks`` returns;
- decoding loop: ``speculative_decode`` of every drafter on ``evaluate.num_prompts`` held-out prompts at
  each sampling setting (``evaluate_settings``; a tree older than it: ``evaluate.temperatures``), from one
  generator per (drafter, setting) seeded ``evaluate.seed``, as the stage does (the plain-target baseline
  is skipped: it does not change the drafters' rounds). Keys only one tree evaluated (a drafter or setting
  its config lacks) are listed and left out of the tables.

Reported per drafter and setting: tau of each tree and the paired difference new - old with its
SE; block level: mean and SE of the per-block differences (SE = sd / sqrt(n)); decoding loop: the ratio
estimator tau = sum(accepted + 1) / rounds, prompts as clusters, the difference's SE by the delta method
on per-prompt linearised terms z_i = (s_i - tau n_i) / mean(n) taken new minus old (the same formula as
``pipeline.stages.evaluate.tau_standard_error``, applied to the paired z), plus how many blocks / prompts
gave identical outcomes (identical random numbers and logits give identical outcomes).

    python bench/bench_cpu_regression.py --old /tmp/e-old --new /tmp/e-new --run-dir /tmp/e-run \
        [--conf conf/tiny.yaml] [key=value ...]   # the overrides the run was trained with

Make the old tree without touching git state: ``git archive c437ed2 | tar -x -C /tmp/e-old``. Both trees
must load the run's drafters: an old tree refuses a checkpoint trained with an option it lacks (its
checkpoint check names it), so compare on a run the old tree's recipe trained.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def child(run_dir: str, conf: str, overrides: list[str], out: str) -> None:
    """Evaluate the run's drafters with the code on ``sys.path`` (the tree under test); writes
    ``{"tree", "block": {"name|T": [tau per block]}, "decode": {"name|T": [[s_i, n_i, tokens]...]}}``."""
    import torch

    import pipeline
    import pipeline.stages.evaluate as ev_stage
    import training.block_runner as block_runner
    from pipeline.drafters import load_trained_drafter
    from pipeline.run import load_config
    from pipeline.target_model.loader import load_target, resolve_target_path
    from pipeline.target_model.prefill import LayerTap

    torch.set_num_threads(1)
    cfg = load_config(conf, [f"run_dir={run_dir}", *overrides])
    target_dir = resolve_target_path(cfg.target.path)
    prepare = getattr(block_runner, "eval_drafter", None)  # the new tree: eval mode, tied lm_head held once
    drafters = {n: load_trained_drafter(cfg, n, target_dir) for n in cfg.train.drafters}
    drafters = {n: prepare(d, "cpu", None) if prepare else d.eval() for n, d in drafters.items()}

    tallies = []
    evaluate_blocks = block_runner.evaluate_blocks

    def capture(*args, **kwargs):
        tallies.append(evaluate_blocks(*args, **kwargs))
        return tallies[-1]

    block_runner.evaluate_blocks = capture
    ev_stage.block_level(cfg, drafters, target_dir, {})
    tally = tallies[0]
    settings = ev_stage.evaluate_settings(cfg) if hasattr(ev_stage, "evaluate_settings") else cfg.evaluate.temperatures
    block = {f"{n}|{T:g}": tally.values(n, T, "tau").tolist() for n in drafters for T in settings}

    model, tok, _ = load_target(cfg.target)
    prompts = ev_stage.eval_prompts(cfg, tok)
    stop = {tok.eos_token_id, *np.atleast_1d(model.generation_config.eos_token_id or []).tolist()} - {None}
    tap = LayerTap(model, cfg.target.target_layer_ids)
    decode = {}
    with torch.no_grad():
        for T in settings:
            for name, drafter in drafters.items():
                runs = ev_stage._decode_all(lambda **kw: ev_stage.speculative_decode(model, drafter, tap=tap, **kw),
                                            prompts, cfg.evaluate.seed, temperature=T,
                                            max_new_tokens=cfg.evaluate.max_new_tokens, stop_ids=stop)
                decode[f"{name}|{T:g}"] = [[sum(r.accepted + 1 for r in d.rounds), len(d.rounds), d.tokens]
                                           for v in runs.values() for d in v]
    Path(out).write_text(json.dumps({"tree": str(Path(pipeline.__file__).parents[1]), "block": block,
                                     "decode": decode}))


def run_tree(tree: str, args: argparse.Namespace, out: str) -> subprocess.Popen:
    """Start the child for ``tree`` (its code first on the path, run from the tree's root)."""
    env = {**os.environ, "PYTHONPATH": tree, "RAY_AUTH_MODE": "disabled", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", out, "--run-dir", args.run_dir,
           "--conf", args.conf, *args.overrides]
    return subprocess.Popen(cmd, cwd=tree, env=env)


def block_pair(old: list[float], new: list[float]) -> dict:
    """Paired per-block comparison: means, mean difference and its SE (sd / sqrt(n)).

    Raises:
        SystemExit: the trees evaluated different block counts (not the same blocks)."""
    a, b = np.asarray(old), np.asarray(new)
    if a.shape != b.shape:
        raise SystemExit(f"block counts differ: old {a.size}, new {b.size}: not the same held-out blocks")
    d = b - a
    return {"n": a.size, "old": a.mean(), "new": b.mean(), "diff": d.mean(),
            "se": d.std(ddof=1) / math.sqrt(a.size), "same": int((d == 0).sum())}


def decode_pair(old: list, new: list) -> dict:
    """Paired per-prompt comparison of the ratio estimator tau = sum s_i / sum n_i (module docstring)."""
    if len(old) != len(new):
        raise SystemExit(f"prompt counts differ: old {len(old)}, new {len(new)}")
    s_o, n_o = (np.array([r[i] for r in old], float) for i in (0, 1))
    s_n, n_n = (np.array([r[i] for r in new], float) for i in (0, 1))
    tau_o, tau_n = s_o.sum() / n_o.sum(), s_n.sum() / n_n.sum()
    z = (s_n - tau_n * n_n) / n_n.mean() - (s_o - tau_o * n_o) / n_o.mean()
    k = len(z)
    return {"n": k, "old": tau_o, "new": tau_n, "diff": tau_n - tau_o,
            "se": math.sqrt((z ** 2).sum() / (k * (k - 1))), "same": sum(a[2] == b[2] for a, b in zip(old, new))}


def table(title: str, rows: dict[str, dict], unit: str) -> None:
    print(f"\n{title}")
    print(f"{'drafter':<8} {'setting':>12} {unit:>8} {'tau old':>8} {'tau new':>8} {'new-old':>9} {'SE':>7} "
          f"{'|d|/SE':>6} {'identical':>10}")
    for key, r in rows.items():
        name, t = key.split("|")
        ratio = abs(r["diff"]) / r["se"] if r["se"] > 0 else 0.0
        print(f"{name:<8} {t:>12} {r['n']:>8} {r['old']:>8.4f} {r['new']:>8.4f} {r['diff']:>+9.4f} {r['se']:>7.4f} "
              f"{ratio:>6.2f} {r['same']:>5}/{r['n']:<4}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the code tree before the change")
    ap.add_argument("--new", help="the code tree after the change")
    ap.add_argument("--run-dir", required=True, help="a run directory with trained drafters and a cache")
    ap.add_argument("--conf", default="conf/tiny.yaml", help="the run's config, relative to each tree")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="key=value overrides the run was made with")
    args = ap.parse_args()
    if args.child:
        child(args.run_dir, args.conf, args.overrides, args.child)
        return
    if not (args.old and args.new):
        ap.error("--old and --new code trees are required")
    with tempfile.TemporaryDirectory() as tmp:
        outs = {k: f"{tmp}/{k}.json" for k in ("old", "new")}
        procs = {k: run_tree(getattr(args, k), args, outs[k]) for k in ("old", "new")}
        for k, p in procs.items():
            if p.wait() != 0:
                raise SystemExit(f"the {k} tree's evaluation failed (exit {p.returncode}); see its stderr above")
        res = {k: json.loads(Path(v).read_text()) for k, v in outs.items()}
    print(f"old: {res['old']['tree']}\nnew: {res['new']['tree']}\nrun: {args.run_dir} (same drafters, same seeds)")
    for part in ("block", "decode"):
        only = sorted(set(res["old"][part]) ^ set(res["new"][part]))
        if only:  # a drafter or setting one tree's config has and the other's has not
            print(f"{part}: evaluated by one tree only, not compared: {', '.join(only)}")
    common = {part: [k for k in res["new"][part] if k in res["old"][part]] for part in ("block", "decode")}
    table("block level (held-out cache blocks, paired per block)",
          {k: block_pair(res["old"]["block"][k], res["new"]["block"][k]) for k in common["block"]}, "blocks")
    table("decoding loop (held-out prompts, paired per prompt, prompts as clusters)",
          {k: decode_pair(res["old"]["decode"][k], res["new"]["decode"][k]) for k in common["decode"]}, "prompts")


if __name__ == "__main__":
    main()
