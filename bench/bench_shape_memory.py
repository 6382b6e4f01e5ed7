"""Peak memory of the steps that hold the target's frozen weights, old code against new, at the real
Qwen3-4B width (hidden 2,560, vocabulary 151,936: ``pipeline/target_model/shapes/qwen3_4b.json``)
with a few layers and random weights. The (step, variant) pairs run one at a time in one process
(the target is built in another), each reporting its peak RSS over its RSS before it (the kernel's
high-water mark ``VmHWM``, reset before each by writing 5 to ``/proc/self/clear_refs``), the RSS it
still holds after it, and the bytes of what it built (distinct storages). Linux only; under ~5 GiB.

Steps:
- ``train_build``: the train worker's drafter as DeepSpeed's bf16 engine receives it
  (:func:`training.loop.build_drafter_from`, then DeepSpeed's parameter cast to bf16,
  ``_cast_module_mixed_precision``). Old: the frozen tied embedding / lm_head cast to two float32
  copies, each cast again to bf16 separately. New: one bf16 tensor shared by both.
- ``load_build``: the drafter calibrate / evaluate / export build to load a checkpoint into
  (float32). Old: two float32 copies; new: one.
- ``export_fresh``: the export guard's initial state (:func:`pipeline.stages.export._fresh_state`).

- ``--rehearsal DIR``: reads a finished ``make rehearsal`` folder instead and prints the train
  stage's seconds per optimizer step and per supervised slot beside the single-process probe's
  (``DIR/run/train/dspark/metrics.jsonl``, ``DIR/train_probe.json``): the step's cost follows its
  supervised slots (anchors x block slots, each through the backbone and the 151,936-wide loss),
  not its tokens.

Usage: ``.venv/bin/python bench/bench_shape_memory.py [--layers 2] [--draft-layers 1] [--rehearsal DIR]``
(the machine this was measured on was shared: run twice and take the smaller peaks).
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAPE = REPO / "pipeline/target_model/shapes/qwen3_4b.json"
STEPS = ("train_build", "load_build", "export_fresh")
GiB = 2**30


def build_target(out: Path, layers: int) -> None:
    """A random bf16 Qwen3ForCausalLM of the published Qwen3-4B config cut to ``layers`` layers
    (tied embedding, as published), saved with ``save_pretrained`` into ``out``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads(SHAPE.read_text())
    cfg.update(num_hidden_layers=layers, max_window_layers=layers, layer_types=None)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # never materialised in fp32
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    model.save_pretrained(out, safe_serialization=True)


def _old_build(config, target_dir, d2t=None):
    """``training.loop.build_drafter_from`` before the fix: each frozen weight upcast on its own."""
    from transformers import AutoConfig

    from training.drafter import Drafter
    from training.target_weights import load_shared_weights

    embed, lm_head = load_shared_weights(target_dir)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return Drafter(config, tc, embed.float(), lm_head.float(), d2t)


def _old_fresh_state(model, seed, target_dir, dtype):
    """``pipeline.stages.export._fresh_state`` before the fix."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fresh = _old_build(model.config, target_dir, getattr(model, "d2t", None))
    return {k: v.detach().to(dtype) if v.is_floating_point() else v.detach() for k, v in fresh.state_dict().items()}


def _deepspeed_cast(model, dtype) -> None:
    """DeepSpeed's bf16 parameter cast (``DeepSpeedEngine._cast_module_mixed_precision``)."""
    for p in model.parameters(recurse=True):
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def _storage_bytes(tensors) -> dict[str, int]:
    """Bytes of the distinct storages of ``tensors``, in all and in float32."""
    seen, total, fp32 = set(), 0, 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        n = t.untyped_storage().nbytes()
        total += n
        fp32 += n if t.dtype.is_floating_point and t.element_size() == 4 else 0
    return {"bytes": total, "fp32_bytes": fp32}


def _status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_step(step: str, variant: str, target_dir: str, draft_layers: int) -> dict:
    """One (step, variant) in this process: its peak RSS over the RSS before it, and what it holds."""
    import torch

    from pipeline.stages.export import _fresh_state
    from training.drafter import DrafterConfig
    from training.loop import build_drafter_from

    cfg = DrafterConfig(target_layer_ids=(0,), mask_token_id=151669, num_layers=draft_layers, block_size=7,
                        markov_rank=256)
    old = variant == "old"
    trained = build_drafter_from(cfg, target_dir, dtype=torch.bfloat16) if step == "export_fresh" else None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    before = _status_bytes("VmRSS")
    if step == "train_build":
        model = _old_build(cfg, target_dir) if old else build_drafter_from(cfg, target_dir, dtype=torch.bfloat16)
        _deepspeed_cast(model, torch.bfloat16)
        held = list(model.state_dict().values())
    elif step == "load_build":
        model = _old_build(cfg, target_dir) if old else build_drafter_from(cfg, target_dir)
        held = list(model.state_dict().values())
    else:
        held = list((_old_fresh_state if old else _fresh_state)(trained, 0, target_dir, torch.bfloat16).values())
    gc.collect()
    row = {"step": step, "variant": variant, "peak_over_start": _status_bytes("VmHWM") - before,
           "held_after": _status_bytes("VmRSS") - before, **_storage_bytes(held)}
    return row


def step_time_per_slot(rehearsal: Path) -> None:
    """Print the rehearsal train loop's seconds per step and per supervised slot beside its probe's.

    Step seconds are the step's tokens over its logged ``tokens_per_s``; the step's tokens are
    ``2 x data.max_length`` (the rehearsal's 2 samples per step, each cut at ``max_length``: its
    cache holds ``16 x 512`` tokens for 16 samples; checked against the cache stage's token count).
    """
    report = json.loads((rehearsal / "rehearsal.json").read_text())
    probe = json.loads((rehearsal / "train_probe.json").read_text())
    scale, cache = report["scale"], report["stages"]["cache"]["summary"]
    samples = 2
    tokens = samples * scale["max_length"]
    per_sample = cache["bytes"] / cache["bytes_per_token"] / scale["rows"]
    rows = [json.loads(line) for line in (rehearsal / "run/train/dspark/metrics.jsonl").read_text().splitlines()]
    p_slots, p_s = probe["supervised_slots"], probe["step_s"]
    print(f"\ntrain step: loop {samples} x {tokens // samples} tokens (cache: {per_sample:.0f} tokens per sample) vs "
          f"probe 1 x {probe['tokens']} tokens, {probe['num_anchors']} anchors each")
    print(f"{'':<14} {'slots':>6} {'step s':>7} {'ms/slot':>8} {'slots/probe':>11} {'s/probe':>8}")
    print(f"{'probe':<14} {p_slots:6.0f} {p_s:7.1f} {1e3 * p_s / p_slots:8.1f} {1:11.2f} {1:8.2f}")
    for r in rows:
        sec = tokens / r["tokens_per_s"]
        print(f"{'loop step ' + str(r['step']):<14} {r['supervised_slots']:6.0f} {sec:7.1f} "
              f"{1e3 * sec / r['supervised_slots']:8.1f} {r['supervised_slots'] / p_slots:11.2f} {sec / p_s:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="target layers (the widths are the real ones)")
    ap.add_argument("--draft-layers", type=int, default=1, help="drafter layers (recipe: 5)")
    ap.add_argument("--rehearsal", type=Path, help="a finished make rehearsal folder: print the train step split")
    ap.add_argument("--child", metavar="TARGET", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rehearsal:
        step_time_per_slot(args.rehearsal)
        return
    if args.child:
        import torch

        from transformers import AutoConfig

        from training.target_weights import load_shared_weights

        torch.set_num_threads(1)
        AutoConfig.from_pretrained(args.child, local_files_only=True)  # lazy imports before any measurement
        load_shared_weights(args.child)
        for step in STEPS:
            for variant in ("old", "new"):
                print(json.dumps(run_step(step, variant, args.child, args.draft_layers)), flush=True)
                gc.collect()
        return
    with tempfile.TemporaryDirectory() as tmp:
        code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.bench_shape_memory import build_target; " \
               f"from pathlib import Path; build_target(Path({tmp!r}), {args.layers})"
        subprocess.run([sys.executable, "-c", code], check=True)
        out = subprocess.run([sys.executable, __file__, "--draft-layers", str(args.draft_layers), "--child", tmp],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        rows = {(r["step"], r["variant"]): r for r in map(json.loads, out.strip().splitlines())}
    print(f"real width (hidden 2560, vocab 151,936), target {args.layers} layers, drafter {args.draft_layers} "
          "layer(s); GiB; shared 2-core machine")
    print(f"{'step':<13} {'peak old':>9} {'peak new':>9} {'ratio':>6}  {'held old':>9} {'held new':>9}  "
          f"{'tensors old':>11} {'tensors new':>11}  {'fp32 old':>8} {'fp32 new':>8}")
    for step in STEPS:
        o, n = rows[step, "old"], rows[step, "new"]
        print(f"{step:<13} {o['peak_over_start'] / GiB:9.2f} {n['peak_over_start'] / GiB:9.2f} "
              f"{n['peak_over_start'] / o['peak_over_start']:6.2f}  {o['held_after'] / GiB:9.2f} "
              f"{n['held_after'] / GiB:9.2f}  {o['bytes'] / GiB:11.2f} {n['bytes'] / GiB:11.2f}  "
              f"{o['fp32_bytes'] / GiB:8.2f} {n['fp32_bytes'] / GiB:8.2f}")
    print(json.dumps({f"{s}/{v}": r for (s, v), r in rows.items()}))


if __name__ == "__main__":
    main()
