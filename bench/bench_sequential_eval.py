"""The block-level evaluation drafted slot by slot (a sequential head fed its own drawn tokens) against
the teacher-forced evaluation before it: time and peak memory side by side, and how far the tau of a
Markov drafter moves, on the same random drafter, samples, blocks and uniforms.

Both run :func:`training.block_runner.evaluate_blocks` (``sequential=True`` / ``False``) on the CPU at the
real vocabulary (V = 151,936 by default) with ``bench/bench_eval_memory.py``'s random drafter (hidden 64,
one layer, block size 7, Markov rank 8 and a confidence head) and random cache samples; the Markov
head's output is scaled up (``--markov-scale``) so that it moves the draft as a trained head does.
The settings are T = 0, T = 1 and the generate stage's 0.7 / top-p 0.8 / top-k 20.

Run: ``.venv/bin/python bench/bench_sequential_eval.py [--vocab 151936] [--blocks 64] [--repeats 2]``
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.block_runner import evaluate_blocks  # noqa: E402
from training.spec_sampling import Sampling  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_eval_memory", Path(__file__).with_name("bench_eval_memory.py"))
mem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mem)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--blocks", type=int, default=64, help="blocks (2 samples, half the anchors each)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode; the best time and the largest peak")
    ap.add_argument("--markov-scale", type=float, default=6.0, help="factor on the Markov head's W2")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    drafter = mem.random_drafter(args.vocab, block_size=7)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(args.markov_scale)
    samples = mem.random_samples(args.vocab, lengths=(96, 80))
    for s in samples:  # a flatter target, so that blocks accept drafts
        s["last_hidden"] = (s["last_hidden"].float() * 0.05).bfloat16()
    settings = [Sampling(0.0), Sampling(1.0), Sampling(0.7, 0.8, 20)]
    kw = dict(temperatures=settings, num_anchors=args.blocks // 2, seed=3, records={})
    rows = {}
    for mode, seq in (("teacher-forced", False), ("sequential", True)):
        best, peak = float("inf"), 0.0
        for _ in range(args.repeats):
            tally, mib, seconds = mem.peak_rss(evaluate_blocks, {"d": drafter}, [samples], sequential=seq, **kw)
            best, peak = min(best, seconds), max(peak, mib)
        rows[mode] = (best, peak, {f"{T:g}": tally.values("d", T, "tau") for T in settings})
    print(f"V = {args.vocab:,}, {args.blocks} blocks of 7, 3 settings, 1 thread")
    print(f"{'mode':<16} {'seconds':>8} {'peak MiB':>9}  tau per setting (mean)")
    for mode, (sec, peak, tau) in rows.items():
        print(f"{mode:<16} {sec:8.2f} {peak:9.0f}  " + "  ".join(f"T={k}: {v.mean():.3f}" for k, v in tau.items()))
    (s_tf, _, tau_tf), (s_seq, _, tau_seq) = rows["teacher-forced"], rows["sequential"]
    print(f"sequential / teacher-forced time: {s_seq / s_tf:.2f}x")
    for k in tau_tf:
        diff = tau_seq[k] - tau_tf[k]
        print(f"T={k}: tau sequential - teacher-forced {diff.mean():+.3f} ± {diff.std() / diff.numel() ** 0.5:.3f} "
              f"(paired, {diff.numel()} blocks; {int((diff != 0).sum())} blocks differ)")


if __name__ == "__main__":
    main()
