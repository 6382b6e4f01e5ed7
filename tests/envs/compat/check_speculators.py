"""vllm-project/speculators 0.9.0 on the exports (its own environment, ``.venv-speculators``, CPU).

Run after ``tests/envs/compat/make_exports.py`` wrote ``OUT`` (``make test-compat`` does):

    .venv-speculators/bin/python tests/envs/compat/check_speculators.py OUT

For every ``speculators/<drafter>`` export (DFlash, DSpark, EAGLE-3, full and reduced vocabulary):
``SpeculatorModelConfig.from_pretrained`` parses ``config.json`` with speculators' own (pydantic)
classes into ``DFlashSpeculatorConfig`` / ``DSparkSpeculatorConfig`` / ``Eagle3SpeculatorConfig``; the model class built from it
accepts every exported tensor with no missing key (beyond those speculators fills from the verifier:
``embed_tokens``, ``verifier_*``, a full-vocabulary ``lm_head``) and no unexpected one;
``SpeculatorModel.from_pretrained`` then loads the export and holds the exported values, its
``block_size`` and speculative tokens as trained. The native exports go through speculators'
auto-converter (``verifier=`` the target): it converts DFlash, and refuses DSpark.

Prints ``ok:``/``FAIL:`` lines, ``row:`` JSON lines for the README's compatibility table and
``N passed, M failed`` last; exits 1 on a failure.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from findings import Findings


def main(out: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    from importlib.metadata import version as pkg_version

    import speculators

    version = pkg_version("speculators")
    manifest = json.loads((out / "manifest.json").read_text())
    root = Path(speculators.__file__).parent
    reads_temperatures = [str(p.relative_to(root)) for p in root.rglob("*.py") if "confidence_temperatures" in p.read_text()]
    print(f"  files of speculators that read confidence_temperatures: {reads_temperatures or 'none'}")
    found = Findings(out, __file__)
    row, report = found.row, found.report

    for e in manifest["exports"]:
        name, path = e["drafter"], e["path"]
        tensors = load_file(str(Path(path) / "model.safetensors"))
        if e["format"] == "native":
            # speculators' own path for other formats: auto-convert with the verifier (cached under /tmp)
            try:
                with tempfile.TemporaryDirectory() as cache:
                    model = SpeculatorModel.from_pretrained(path, verifier=manifest["target"], cache_dir=cache)
                    state = model.state_dict()
                    same = all(torch.equal(state[k], v) for k, v in tensors.items() if k in state)
                    outcome, ok = f"auto-converted to {type(model).__name__}, tensors equal: {same}", same
            except Exception as exc:   # noqa: BLE001 - the refusal is the finding
                lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
                why = next((x for x in lines if "size mismatch" in x), lines[0])
                outcome, ok = f"converter refuses it: {type(exc).__name__}: {why[:240]}", False
            print(f"  native/{name}: SpeculatorModel.from_pretrained(verifier=target) {outcome}")
            row({"tool": "speculators", "version": version, "format": "native (auto-convert)",
                                        "drafter": name, "loads": ok, "lossless": None, "as_trained": ok,
                                        "ignores": "none" if ok else outcome})
            continue
        config = SpeculatorModelConfig.from_pretrained(path)
        want = {"dspark": "DSparkSpeculatorConfig", "eagle3": "Eagle3SpeculatorConfig"}.get(name.split("-")[0],
                                                                                            "DFlashSpeculatorConfig")
        report(type(config).__name__ == want, f"{name}: speculators parses config.json as {type(config).__name__}")
        model_class = SpeculatorModel.registered_model_class_from_config(config)
        fresh = model_class(config)
        missing, unexpected = fresh.load_state_dict(tensors, strict=False)
        filled = set(fresh._keys_to_ignore_on_load_missing)          # noqa: SLF001 - speculators' own list
        missing = sorted(set(missing) - filled)
        report(not missing and not unexpected, f"{name}: {model_class.__name__} takes all {len(tensors)} tensors "
                                               f"(missing {missing or 'none'}, unexpected {list(unexpected) or 'none'})")
        model = SpeculatorModel.from_pretrained(path)
        state = model.state_dict()
        same = all(torch.equal(state[k], v) for k, v in tensors.items())
        report(same, f"{name}: SpeculatorModel.from_pretrained holds every exported tensor bit-exact")
        heads = True
        if name.startswith("dspark"):
            heads = model.markov_head is not None and model.confidence_head is not None
            report(heads, f"{name}: the Markov and confidence heads are built")
        spec = config.speculators_config.proposal_methods[0].speculative_tokens
        if name.startswith("eagle3"):   # autoregressive: the drafted tokens are the proposal's speculative_tokens
            layers = list(config.eagle_aux_hidden_state_layer_ids)
            layout = spec == e["num_speculative_tokens"] and layers == [i + 1 for i in manifest["eagle3_layer_ids"]]
            report(layout, f"{name}: speculative_tokens {spec}, aux hidden state layers {layers} as trained")
        else:
            drafts = config.block_size if config.sample_from_anchor else config.block_size - 1
            layout = spec == drafts == e["num_speculative_tokens"] and model.block_size == e["block_size"]
            report(layout, f"{name}: block_size {model.block_size}, sample_from_anchor {config.sample_from_anchor}: "
                           f"{drafts} drafts = speculative_tokens {spec} as trained")
        vocab = True
        if e["draft_vocab_size"] and name.startswith("eagle3"):
            vocab = int(model.t2d.sum()) == e["draft_vocab_size"] and torch.equal(model.d2t, tensors["d2t"])
            report(vocab, f"{name}: reduced vocabulary {e['draft_vocab_size']}: t2d/d2t loaded as exported")
        elif e["draft_vocab_size"]:
            head = model.verifier_lm_head.weight
            vocab = model.use_draft_vocab and int(model.t2d.sum()) == e["draft_vocab_size"] and torch.equal(
                model.lm_head.weight, head)
            report(vocab, f"{name}: reduced vocabulary {e['draft_vocab_size']}: t2d/d2t loaded, lm_head equals the "
                          f"verifier's rows selected by t2d")
        row({"tool": "speculators", "version": version, "format": "speculators", "drafter": name,
                                    "loads": not missing and not unexpected and same and heads,
                                    "lossless": None, "as_trained": layout and vocab,
                                    "ignores": "confidence_temperatures" if name.startswith("dspark")
                                    and not reads_temperatures else "none"})
    found.finish()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: check_speculators.py OUT   (OUT written by tests/envs/compat/make_exports.py)")
    main(Path(sys.argv[1]))
