"""Exports of the ``make test-vllm`` drafters in every format, full and reduced vocabulary, plus references.

Run in the main virtual environment after ``tests/envs/vllm/make_exports.py VLLM_OUT`` (``make test-compat``
does both; it reuses ``VLLM_OUT`` when present):

    .venv/bin/python tests/envs/compat/make_exports.py VLLM_OUT OUT

Reads the trained DFlash and DSpark drafters of ``VLLM_OUT/run`` (the product's checkpoints) and writes,
with :func:`pipeline.stages.export_format.export_drafter`, ``OUT/<format>/<drafter>`` for both formats and four
drafters: ``dflash``, ``dspark``, ``eagle3`` and their reduced-vocabulary versions ``dflash-reduced`` /
``dspark-reduced`` / ``eagle3-reduced`` (an EAGLE-3 drafter exports the speculators eagle3 format whatever the format) (the same trained drafter restricted to the ``REDUCED`` most frequent
tokens of the first 300 training chats: ``lm_head`` and the Markov ``W2`` rows of those tokens,
``d2t``/``t2d``).
Each export is read back with :func:`pipeline.stages.export_format.load_export` and must draft exactly as the
drafter it came from. References in ``OUT/reference.safetensors``, for the tools' own checks:

- ``prompt.i`` / ``greedy.i``: the prompts and the target's own greedy continuations (transformers);
- ``zlab.<drafter>.acceptance.i``: tokens produced per verification step when the product's own
  drafter runs z-lab ``dflash_generate``'s greedy schedule (the first block anchored at the first
  generated token; after ``m`` accepted drafts the next anchor is the bonus token; the last block
  shrinks to the tokens still to produce) over the same prompts and ``NEW_TOKENS`` tokens;
- ``vllm.greedy.i`` / ``vllm.<drafter>.acceptance``: the longer continuations and the product's replay
  of vLLM's schedule (``tests/envs/vllm/make_exports.py``: drafts, then accepted tokens per position).

``OUT/manifest.json`` lists the exports (format, drafter, path, num_speculative_tokens, block_size)
and the target. Exits non-zero on a failed round trip.

Why beside tests/envs/vllm/: ``make test-vllm`` (in CI) checks vLLM on the native exports; this adds the
speculators format and reduced vocabularies for every third-party tool, by hand (``make test-compat``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "envs" / "vllm"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REDUCED = 256      # draft vocabulary of the reduced exports (the target has 512 tokens)
NEW_TOKENS = 40    # tokens z-lab dflash generates per prompt


def restrict_vocabulary(model, target_config, d2t):
    """The same drafter with the reduced output vocabulary ``d2t`` (:mod:`training.draft_vocab`):
    ``lm_head`` and the Markov ``W2`` keep the rows of the drafted target tokens, the rest is shared."""
    from training.draft_vocab import draft_to_target_ids
    from training.drafter import new_drafter

    config = dataclasses.replace(model.config, draft_vocab_size=int(d2t.shape[0]))
    reduced = new_drafter(config, target_config, model.embed_tokens.weight, model.target_lm_head_weight, d2t)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("lm_head.", "embed_tokens."))}
    if "markov_head.markov_w2.weight" in state:
        state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][draft_to_target_ids(d2t)]
    missing, unexpected = reduced.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight", "embed_tokens.weight", "target_lm_head", "d2t"}:
        sys.exit(f"FAIL: restricting the vocabulary left {missing} missing, {unexpected} unexpected")
    return reduced.eval()


def zlab_replay(drafter, features, seq, prompt_len: int, new_tokens: int) -> list[int]:
    """Tokens produced per verification step when ``drafter`` (the product's) runs z-lab
    ``dflash_generate``'s greedy schedule: ``verify_size = min(slots, max_length - start)`` slots,
    accepted drafts counted against the target's greedy sequence ``seq`` [prompt + continuation],
    ``produced = min(accepted + 1, max_length - start - 1)``.

    Args:
        drafter: a DFlash :class:`training.drafter.Drafter`. features: [len(seq), n_ids*H] the
            target's features of ``seq``. prompt_len, new_tokens: as ``dflash_generate``.
    Returns:
        the produced count of every step (z-lab's ``acceptance_lengths``).
    """
    full = drafter.config
    start, end, out = prompt_len, prompt_len + new_tokens, []
    try:
        while start + 1 < end:
            verify = min(full.slots, end - start)
            accepted = 0
            if verify > 1:   # the last block has fewer mask slots
                drafter.config = dataclasses.replace(full, block_size=verify - 1)
                block = drafter.draft_block(drafter.encode_context(features[:start]), int(seq[start]), 0.0).tokens
                while accepted < len(block) and int(block[accepted]) == int(seq[start + 1 + accepted]):
                    accepted += 1
            produced = min(accepted + 1, end - start - 1)
            out.append(produced)
            start += produced
    finally:
        drafter.config = full
    return out


def main(vllm_out: Path, out: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from make_exports import NEW_TOKENS as VLLM_TOKENS
    from make_exports import build_spec, replay_acceptance, run_config
    from pipeline.embedded import ensure_embedded
    from pipeline.stages.export_format import FORMATS, export_drafter, load_export
    from pipeline.target_model.prefill import LayerTap
    from training.draft_vocab import build_d2t, count_supervised_tokens
    from pipeline.drafters import load_trained_drafter

    paths = ensure_embedded(vllm_out / "embedded", build_spec())
    cfg = run_config(vllm_out, paths)
    target_dir = str(paths.target_dir)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    target_config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    chats = [json.loads(x) for x in paths.train_chats.read_text().splitlines()[:300]]
    ids = [torch.tensor(tok.apply_chat_template(c["messages"], tokenize=True, return_dict=False)) for c in chats]
    d2t = build_d2t(count_supervised_tokens(((i, torch.ones_like(i)) for i in ids), target_config.vocab_size), REDUCED)
    drafters = {}
    for name in ("dflash", "dspark", "eagle3"):
        drafters[name] = load_trained_drafter(cfg, name, target_dir)
        drafters[f"{name}-reduced"] = restrict_vocabulary(drafters[name], target_config, d2t)

    shutil.rmtree(out, ignore_errors=True)
    ref = load_file(str(vllm_out / "reference.safetensors"))
    num_prompts = sum(k.startswith("prompt.") for k in ref)
    check_features = torch.randn(30, drafters["dflash"].fc.in_features, generator=torch.Generator().manual_seed(0))
    exports = []
    for fmt in FORMATS:
        for name, model in drafters.items():
            if fmt == "native" and model.config.architecture == "eagle3":
                continue   # an EAGLE-3 drafter has one format, the speculators one
            path = out / fmt / name
            info = export_drafter(model, target_dir, str(path), fmt=fmt)
            back = load_export(str(path), target_dir)
            for pos in (4, 17, 29):   # round trip: the same drafts, logits |diff| 0
                toks = torch.arange(1, pos) % 97   # the next tokens an EAGLE-3 context reads (others ignore them)
                a = model.draft_block(model.encode_context(check_features[:pos], tokens=toks), pos, 1.0,
                                      torch.Generator().manual_seed(pos))
                b = back.draft_block(back.encode_context(check_features[:pos], tokens=toks), pos, 1.0,
                                     torch.Generator().manual_seed(pos))
                if not (torch.equal(a.tokens, b.tokens) and torch.equal(a.q, b.q)):
                    sys.exit(f"FAIL: {fmt}/{name} read back drafts differently at anchor {pos}")
            exports.append({"format": fmt, "drafter": name, "path": str(path),
                            "num_speculative_tokens": info["num_speculative_tokens"], "block_size": info["block_size"],
                            "draft_vocab_size": model.config.draft_vocab_size, "num_tensors": info["num_tensors"]})
            print(f"ok: {fmt}/{name}: block_size {info['block_size']}, {info['num_speculative_tokens']} drafts, "
                  f"{info['num_tensors']} tensors; read back, drafts equal (max |q diff| 0)")

    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    tap = LayerTap(target, cfg.target.target_layer_ids)
    refs = {}
    for i in range(num_prompts):
        prompt, cont = ref[f"prompt.{i}"], ref[f"greedy.{i}"]
        seq = torch.cat([prompt, cont])
        with torch.no_grad():
            tap.base(input_ids=seq[None])
        feats = tap.features()[0]
        refs[f"prompt.{i}"], refs[f"greedy.{i}"], refs[f"vllm.greedy.{i}"] = prompt, cont[:NEW_TOKENS].clone(), cont
        for name in ("dflash", "dflash-reduced"):
            refs[f"zlab.{name}.acceptance.{i}"] = torch.tensor(
                zlab_replay(drafters[name], feats, seq, len(prompt), NEW_TOKENS))
    for name in ("dflash", "dflash-reduced", "eagle3", "eagle3-reduced"):   # vLLM's schedule (tests/envs/vllm/make_exports.py), VLLM_TOKENS tokens
        refs[f"vllm.{name}.acceptance"] = torch.tensor(replay_acceptance(
            target, drafters[name], cfg.target.target_layer_ids, [ref[f"prompt.{i}"] for i in range(num_prompts)],
            [ref[f"greedy.{i}"] for i in range(num_prompts)]))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in refs.items()}, str(out / "reference.safetensors"))
    manifest = {"target": target_dir, "num_prompts": num_prompts, "new_tokens": NEW_TOKENS, "vllm_tokens": VLLM_TOKENS,
                "reduced_vocab_size": REDUCED, "eagle3_layer_ids": list(drafters["eagle3"].config.eagle3_layer_ids),
                "exports": exports}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"{len(exports)} exports and references written under {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_exports.py VLLM_OUT OUT   (VLLM_OUT written by tests/envs/vllm/make_exports.py)")
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
