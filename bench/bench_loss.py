"""The DSpark loss alone at the recipe's vocabulary: fused (closed-form logit gradients in the
forward) vs checkpointed (autograd under activation checkpointing), side by side.

Shape (default, the Qwen3-4B recipe): H = 2560, V = 151,936, Markov rank 256, M = 3,584 supervised
slots (512 anchors x 7 slots of one sample), bf16 hidden / features / weights, ``lm_head`` tied to a
random embedding (std 0.02) and used as the target's head too (full vocabulary, as Qwen3-4B ties its
embeddings), target hidden ~ N(0, 3^2) and drafter hidden = target hidden + N(0, 1.5^2) (peaked,
overlapping ``p_d`` / ``p_t``), Markov features ~ N(0, 1), ``W2`` ~ N(0, 0.02^2), labels uniform,
a confidence head. Each measurement is one subprocess per variant: setup (its RSS is reported),
then the peak RSS is reset (Linux ``/proc/self/clear_refs``; on CUDA also torch's peak allocation)
and the process runs one warm-up on the first ``chunk_size`` slots and one timed ``drafter_loss``
forward and ``loss.backward()``, whose peak RSS is reported. ``--rounds`` rounds alternate the order
of the two variants (ABBA), so that a load change on a shared machine hits both; the table gives each
variant's best round and the median of the per-round ratios fused / checkpointed. The gradients
(hidden, Markov features, ``W2``, confidence logits) of the last round come back through a temporary
file and the parent prints their relative error, fused against checkpointed.

    python bench/bench_loss.py [--slots 3584 512] [--rounds 2] [--chunk 512] [--threads N] [--quick]

``--quick``: H = 256, V = 8,192, rank 32, M = 448 (seconds). Timings are wall-clock seconds of the
process's CPU threads (or the GPU with ``--device cuda``, synchronised).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.losses import LossConfig, SupervisedSlots, drafter_loss  # noqa: E402

RECIPE = dict(hidden=2560, vocab=151936, rank=256, gamma=7)
QUICK = dict(hidden=256, vocab=8192, rank=32, gamma=7)
VARIANTS = ("checkpointed", "fused")


def make_inputs(M: int, hidden: int, vocab: int, rank: int, gamma: int, device: str, seed: int = 0):
    """Seeded slots and heads of the module docstring's shape and magnitudes (bf16, leaves requiring grad)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):  # drawn in bf16: no float32 copy of the [V, H] head inflates the setup
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16).mul_(std).to(device)

    embed, target_hidden = randn(vocab, hidden, std=0.02), randn(M, hidden, std=3.0)
    slots = SupervisedSlots(
        hidden=(target_hidden + randn(M, hidden, std=1.5)).requires_grad_(),
        bias_features=randn(M, rank).requires_grad_(), confidence_logits=randn(M).float().requires_grad_(),
        labels=torch.randint(0, vocab, (M,), generator=g).to(device),
        slot=(torch.arange(M) % gamma).to(device), block=(torch.arange(M) // gamma).to(device),
        target_hidden=target_hidden, num_blocks=-(-M // gamma), block_size=gamma)
    w2 = randn(vocab, rank, std=0.02).requires_grad_()
    return slots, dict(lm_head=embed, target_lm_head=embed, markov_w2=w2, draft_to_target=None)


def _first(slots: SupervisedSlots, n: int) -> SupervisedSlots:
    """The first n slots, as fresh leaves (for the warm-up)."""
    cut = lambda t: t[:n].detach().requires_grad_(t.requires_grad)  # noqa: E731
    return SupervisedSlots(hidden=cut(slots.hidden), bias_features=cut(slots.bias_features),
                           confidence_logits=cut(slots.confidence_logits), labels=slots.labels[:n],
                           slot=slots.slot[:n], block=slots.block[:n], target_hidden=slots.target_hidden[:n],
                           num_blocks=int(slots.block[:n].max()) + 1, block_size=slots.block_size)


def _sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _proc_status_gib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` (peak RSS since the last :func:`_reset_peak_rss`) of this process, GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` value 5, proc(5))."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(args) -> None:
    """One variant: setup, warm-up, one timed run; JSON figures on stdout, gradients to ``args.grads``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else RECIPE
    slots, heads = make_inputs(args.slots, **shape, device=args.device)
    config = LossConfig(chunk_size=args.chunk, fused=args.worker == "fused")
    leaves = {"hidden": slots.hidden, "bias_features": slots.bias_features, "markov_w2": heads["markov_w2"],
              "confidence_logits": slots.confidence_logits}
    setup_rss = _proc_status_gib("VmRSS")
    _reset_peak_rss()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    drafter_loss(_first(slots, args.chunk), **heads, config=config).loss.backward()  # warm-up
    heads["markov_w2"].grad = None
    for t in leaves.values():
        t.grad = None
    t0 = _sync(args.device)
    out = drafter_loss(slots, **heads, config=config)
    t1 = _sync(args.device)
    out.loss.backward()
    t2 = _sync(args.device)
    torch.save({k: t.grad.float().cpu() for k, t in leaves.items()} | {"loss": out.loss.detach().float().cpu()},
               args.grads)
    peak = {"peak_rss_gib": _proc_status_gib("VmHWM"), "setup_rss_gib": setup_rss}
    if args.device == "cuda":
        peak["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps({"variant": args.worker, "slots": args.slots, "forward_s": t1 - t0, "backward_s": t2 - t1,
                      "total_s": t2 - t0, "loss": float(out.loss), "threads": torch.get_num_threads(), **peak}))


def run_variant(variant: str, M: int, args, grads: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--slots", str(M), "--chunk", str(args.chunk),
           "--threads", str(args.threads), "--device", args.device, "--grads", grads]
    if args.quick:
        cmd.append("--quick")
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} at M={M} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def relative_errors(a: dict, b: dict) -> dict:
    """Per gradient: max |a - b| / max |b| and ||a - b|| / ||b|| (b the reference)."""
    return {k: {"max_rel": float((a[k] - b[k]).abs().max() / b[k].abs().max()),
                "norm_rel": float((a[k] - b[k]).norm() / b[k].norm())} for k in b if k != "loss"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", help="supervised slots M (default 3584; 448 with --quick)")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per variant, order alternating")
    ap.add_argument("--chunk", type=int, default=LossConfig.chunk_size, help="LossConfig.chunk_size")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="H=256, V=8192, rank 32 (seconds)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--grads", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.slots = args.slots[0]
        return worker(args)
    shape = QUICK if args.quick else RECIPE
    args.slots = args.slots or [448 if args.quick else 3584]
    print(f"loss alone: H={shape['hidden']} V={shape['vocab']} rank={shape['rank']} bf16, chunk {args.chunk}, "
          f"{args.device}, best of {args.rounds} rounds")
    print("| M | variant | forward s | backward s | total s | fused / ckpt (median) "
          "| peak RSS GiB (setup RSS) [CUDA peak] |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for M in args.slots:
            runs = {v: [] for v in VARIANTS}
            for i in range(args.rounds):
                for v in VARIANTS[::1 if i % 2 == 0 else -1]:
                    runs[v].append(run_variant(v, M, args, f"{tmp}/{v}.pt"))
            grads = {v: torch.load(f"{tmp}/{v}.pt") for v in VARIANTS}
            ratio = statistics.median(f["total_s"] / c["total_s"] for f, c in zip(runs["fused"], runs["checkpointed"]))
            res = {v: min(runs[v], key=lambda r: r["total_s"]) for v in VARIANTS}
            for v in VARIANTS:
                r = res[v]
                cuda = f" [{r['peak_cuda_gib']:.2f}]" if "peak_cuda_gib" in r else ""
                print(f"| {M} | {v} | {r['forward_s']:.2f} | {r['backward_s']:.2f} | {r['total_s']:.2f} | "
                      f"{ratio if v == 'fused' else 1.0:.2f} | "
                      f"{r['peak_rss_gib']:.2f} ({r['setup_rss_gib']:.2f}){cuda} |")
            err = relative_errors(grads["fused"], grads["checkpointed"])
            loss_rel = float((grads["fused"]["loss"] - grads["checkpointed"]["loss"]).abs()
                             / grads["checkpointed"]["loss"].abs())
            print(f"M={M} fused vs checkpointed: loss rel {loss_rel:.2e}; gradients " + ", ".join(
                f"{k} max_rel {e['max_rel']:.2e} norm_rel {e['norm_rel']:.2e}" for k, e in err.items()))
            rows.append({"slots": M, "fused_over_checkpointed": ratio, "runs": runs, "grad_rel_error": err,
                         "loss_rel_error": loss_rel})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
