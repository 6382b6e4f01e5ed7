"""SpecForge 0.2.0's model classes on the native exports (its own environment, ``.venv-specforge``, CPU).

Run after ``tests/envs/compat/make_exports.py`` wrote ``OUT`` (``make test-compat`` does):

    .venv-specforge/bin/python tests/envs/compat/check_specforge.py OUT

For every ``native/<drafter>`` export: SpecForge's ``DSparkDraftModel`` (DSpark) or
``DFlashDraftModel`` (DFlash) ``.from_pretrained`` builds the model from ``config.json`` (DSpark: the
Markov and confidence heads from ``dflash_config``, ``projector_type: "dspark"``) and loads every
exported tensor with no missing or unexpected key and the exported values; its ``block_size``,
target layer ids and mask token are the exported ones. SpecForge's heads cover the full vocabulary
only (``markov_w2`` [V, r], drafts from the target's ``lm_head``): a reduced-vocabulary export is
reported with what SpecForge does with it. Each loaded drafter then runs SpecForge's own greedy
``spec_generate`` on the reference prompts, which must give the target's own greedy tokens; its DSpark
inference drafts ``block_size - 1`` tokens from the mask slots (the DFlash layout), not the
``sample_from_anchor`` layout SpecForge's DSpark training uses.

Prints ``ok:``/``FAIL:`` lines, ``row:`` JSON lines for the README's compatibility table and
``N passed, M failed`` last; exits 1 on a failure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from findings import Findings


def main(out: Path) -> None:
    from importlib.metadata import version as pkg_version

    import specforge
    import torch
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from transformers import AutoModelForCausalLM

    version = pkg_version("specforge")
    manifest = json.loads((out / "manifest.json").read_text())
    ref = load_file(str(out / "reference.safetensors"))
    target = AutoModelForCausalLM.from_pretrained(manifest["target"], dtype=torch.float32).eval()
    reads_temperatures = [str(p.relative_to(Path(specforge.__file__).parent)) for p in
                          Path(specforge.__file__).parent.rglob("*.py") if "confidence_temperatures" in p.read_text()]
    print(f"  files of specforge that read confidence_temperatures: {reads_temperatures or 'none'}")
    found = Findings(out, __file__)
    row, report = found.row, found.report

    for e in manifest["exports"]:
        if e["format"] != "native":
            continue
        name, path, reduced = e["drafter"], e["path"], e["draft_vocab_size"] is not None
        dspark = name.startswith("dspark")
        cls = DSparkDraftModel if dspark else DFlashDraftModel
        tensors = load_file(str(Path(path) / "model.safetensors"))
        try:
            model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        except Exception as exc:   # noqa: BLE001 - a refusal is the finding for the reduced vocabulary
            fresh = cls(cls.config_class.from_pretrained(path)).state_dict()
            shapes = [f"{k} {list(v.shape)} vs SpecForge's {list(fresh[k].shape)}" for k, v in tensors.items()
                      if k in fresh and fresh[k].shape != v.shape]
            outcome = f"{type(exc).__name__} (size mismatch: {'; '.join(shapes) or 'none'})"
            if not reduced:
                report(False, f"{name}: {cls.__name__}.from_pretrained failed: {outcome}")
            else:
                print(f"  {name}: {cls.__name__}.from_pretrained refuses it: {outcome}")
            row({"tool": "SpecForge", "version": version, "format": "native", "drafter": name,
                                        "loads": False, "lossless": None, "as_trained": False,
                                        "ignores": f"refused: {outcome}"})
            continue
        missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
        mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
        state = model.state_dict()
        same = all(torch.equal(state[k], v) for k, v in tensors.items() if k in state)
        complete = not missing and not unexpected and not mismatched and same
        layout = (model.block_size == e["block_size"] and model.mask_token_id is not None
                  and list(model.target_layer_ids) == json.loads((Path(path) / "config.json").read_text())
                  ["dflash_config"]["target_layer_ids"])
        heads = (not dspark) or (model.markov_head is not None and model.confidence_head is not None
                                 and model.confidence_head_with_markov)
        n, lossless = manifest["num_prompts"], 0
        for i in range(n):   # SpecForge's own greedy speculative decoding (its DFlash schedule)
            prompt = ref[f"prompt.{i}"]
            got = model.spec_generate(target, prompt[None], manifest["new_tokens"], None, 0.0)[0, len(prompt):]
            lossless += got.tolist() == ref[f"greedy.{i}"].tolist()
        report(lossless == n, f"{name}: SpecForge's spec_generate (greedy) equals the target's greedy output "
                              f"({lossless}/{n} prompts)")
        if reduced:
            print(f"  {name}: {cls.__name__} loads with missing {missing or 'none'}, unexpected "
                  f"{unexpected or 'none'}, mismatched {mismatched or 'none'}")
        else:
            report(complete, f"{name}: {cls.__name__}.from_pretrained loads all {len(tensors)} tensors, values equal "
                             f"(missing {missing or 'none'}, unexpected {unexpected or 'none'}, mismatched "
                             f"{mismatched or 'none'})")
            report(layout, f"{name}: block_size {model.block_size} slots, target layers {model.target_layer_ids}, "
                           f"mask token {model.mask_token_id} as exported")
            if dspark:
                report(heads, f"{name}: the Markov head (rank {model.markov_head.markov_rank}) and the confidence "
                              f"head (with Markov features) are built from dflash_config")
        ignores = []
        if dspark and not reads_temperatures:
            ignores.append("confidence_temperatures")
        if dspark:   # its inference drafts from the mask slots after the anchor, as DFlash does
            ignores.append("sample_from_anchor in spec_generate (drafts block_size - 1 from the mask slots)")
        if reduced:
            ignores.append(f"reduced vocabulary (unread {unexpected})")
        ignores = "; ".join(ignores) or "none"
        row({"tool": "SpecForge", "version": version, "format": "native", "drafter": name,
                                    "loads": complete, "lossless": lossless == n,
                                    "as_trained": complete and layout and heads and not reduced, "ignores": ignores})
    found.finish()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: check_specforge.py OUT   (OUT written by tests/envs/compat/make_exports.py)")
    main(Path(sys.argv[1]))
