"""z-lab ``dflash`` 0.1.0 on the native DFlash exports (its own environment, ``.venv-dflash``, CPU).

Run after ``tests/envs/compat/make_exports.py`` wrote ``OUT`` (``make test-compat`` does):

    .venv-dflash/bin/python tests/envs/compat/check_dflash.py OUT

For every native export, ``DFlashDraftModel.from_pretrained`` reports its
missing and unexpected keys (none for the full vocabulary; z-lab has no reduced vocabulary: it drafts
from the target's full ``lm_head`` and leaves ``lm_head`` / ``d2t`` / ``t2d`` unread), its
``block_size`` is the exported slot count, and ``dflash_generate`` (greedy) gives exactly the target's
own greedy tokens, with its per-step acceptance (``acceptance_lengths``) equal to the product's own
drafter replaying the same schedule (``zlab.<drafter>.acceptance.i`` in the reference). z-lab has no
DSpark model: a DSpark export loads as its backbone alone (Markov and confidence heads unread),
still lossless, not as trained. ``dflash_generate``'s timing path calls ``torch.cuda.synchronize()``: on CPU
this script times with ``time.perf_counter`` instead (``dflash.model._cuda_time``).

Prints ``ok:``/``FAIL:`` lines, ``row:`` JSON lines for the README's compatibility table and
``N passed, M failed`` last; exits 1 on a failure.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from findings import Findings


def main(out: Path) -> None:
    import dflash
    import dflash.model as zlab
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    zlab._cuda_time = time.perf_counter          # its stats path synchronises CUDA; nothing to sync on CPU
    manifest = json.loads((out / "manifest.json").read_text())
    ref = load_file(str(out / "reference.safetensors"))
    target = AutoModelForCausalLM.from_pretrained(manifest["target"], dtype=torch.float32).eval()
    found = Findings(out, __file__)
    row, report = found.row, found.report

    version = getattr(dflash, "__version__", None) or __import__("importlib.metadata").metadata.version("dflash")
    for e in manifest["exports"]:
        if e["format"] != "native":
            continue
        name, reduced, dspark = e["drafter"], e["draft_vocab_size"] is not None, e["drafter"].startswith("dspark")
        model, info = zlab.DFlashDraftModel.from_pretrained(e["path"], dtype=torch.float32, output_loading_info=True)
        model.eval()
        missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
        tensors = load_file(str(Path(e["path"]) / "model.safetensors"))
        state = model.state_dict()
        same = all(torch.equal(state[k], v) for k, v in tensors.items() if k in state)
        lossless = accept_same = 0
        n = manifest["num_prompts"]
        for i in range(n):
            prompt, want = ref[f"prompt.{i}"], ref[f"greedy.{i}"].tolist()
            res = zlab.dflash_generate(model, target, prompt[None], manifest["new_tokens"], None, temperature=0.0,
                                       return_stats=True)
            lossless += res.output_ids[0, len(prompt):].tolist() == want
            ours = ref.get(f"zlab.{name}.acceptance.{i}")
            accept_same += ours is not None and res.acceptance_lengths == ours.tolist()
            print(f"  {name} prompt {i}: z-lab acceptance {res.acceptance_lengths}, product replay "
                  f"{None if ours is None else ours.tolist()}")
        report(lossless == n, f"{name}: greedy dflash_generate equals the target's greedy output ({lossless}/{n} "
                              f"prompts, {manifest['new_tokens']} tokens)")
        if dspark:   # z-lab has no DSpark model: the backbone alone, in the DFlash layout
            print(f"  {name}: z-lab has no DSpark model; DFlashDraftModel leaves {unexpected} unread")
            ignores = ("no DSpark model: runs the backbone alone in the DFlash layout (unread: Markov and "
                       "confidence heads" + (", lm_head, d2t, t2d" if reduced else "") + ")")
            row({"tool": "z-lab dflash", "version": version, "format": "native", "drafter": name, "loads": False,
                 "lossless": lossless == n, "as_trained": False, "ignores": ignores})
            continue
        ignored = sorted({"lm_head.weight", "d2t", "t2d"}) if reduced else []
        report(not missing and unexpected == ignored and same,
               f"{name}: DFlashDraftModel.from_pretrained loads every tensor it has slots for, values equal "
               f"(missing {missing or 'none'}, unread {unexpected or 'none'})")
        report(model.block_size == e["block_size"] == e["num_speculative_tokens"] + 1,
               f"{name}: block_size {model.block_size} slots = anchor + {e['num_speculative_tokens']} drafts as trained")
        if reduced:   # z-lab drafts over the full vocabulary: not the trained drafter, so not the same drafts
            print(f"  {name}: acceptance equal to the product's replay on {accept_same}/{n} prompts (z-lab ignores "
                  f"the reduced vocabulary)")
        else:
            report(accept_same == n, f"{name}: z-lab's per-step acceptance equals the product's replay of the same "
                                     f"drafts ({accept_same}/{n} prompts)")
        row({"tool": "z-lab dflash", "version": version, "format": "native", "drafter": name,
             "loads": not missing and not unexpected and same, "lossless": lossless == n,
             "as_trained": (not reduced) and accept_same == n and model.block_size == e["block_size"],
             "ignores": "reduced vocabulary (unread lm_head, d2t, t2d): drafts over the full target vocabulary"
             if reduced else "none"})
    found.finish()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: check_dflash.py OUT   (OUT written by tests/envs/compat/make_exports.py)")
    main(Path(sys.argv[1]))
