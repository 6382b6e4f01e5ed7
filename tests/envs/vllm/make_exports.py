"""Build tiny DFlash, DSpark and EAGLE-3 vLLM exports with the product's own stages, plus reference numbers.

Run in the main virtual environment (``make test-vllm`` does):

    .venv/bin/python tests/envs/vllm/make_exports.py OUT

Steps, all offline on CPU: build a small *trained* embedded target (``pipeline.embedded``, head_dim 32
because vLLM's CPU attention refuses 16) under ``OUT/embedded`` (reused when present); run the
``cache``, ``train``, ``calibrate`` and ``export`` stages on its stdlib chats for a DFlash drafter
(``sample_from_anchor=false``, the layout vLLM's DFlash drafts), a DSpark drafter (Markov head,
confidence head) and an EAGLE-3 drafter (``architecture: eagle3``, exported in the speculators eagle3 format); then write what ``check_export_vllm.py`` compares vLLM against:

- ``OUT/manifest.json``: target and export paths, ``num_speculative_tokens``, stage summaries;
- ``OUT/reference.safetensors``: prompts and the target's own greedy continuations (transformers,
  EOS ignored), the product's DFlash and EAGLE-3 drafters' greedy acceptance replayed on them, and the product's DSpark heads on fixed inputs (Markov bias ``W2 W1[x]`` and the
  confidence ``sigmoid`` as vLLM computes it from the exported, possibly folded, head).

Prints the DSpark calibration report (ECE per position before / after STS, and as vLLM sees it).

Why beside tests/envs/compat/: this is ``make test-vllm`` (in CI: vLLM's own loader and decoding on the
native exports); tests/envs/compat/ reuses these drafters for every third-party tool, by hand (``make test-compat``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "dspark-torch-extensions"))

BLOCK = 4          # drafted tokens per block gamma = vLLM num_speculative_tokens (the exports' block_size
                   # counts slots: 5 for the DFlash drafter's [anchor, mask x 4], 4 for DSpark's)
NEW_TOKENS = 48    # greedy tokens per reference prompt
NUM_PROMPTS = 4


def build_spec():
    """A small embedded build (4 layers, 220 k parameters, 500 steps of 16 x 128 tokens; about 2 min on 2 idle
    cores): 4 layers so that EAGLE-3 fuses three captured ones (0, 1, 2) below the last."""
    from pipeline.embedded import BuildSpec, TargetSpec

    return BuildSpec(vocab_size=512, max_train_chats=1200, max_heldout_chats=40, module_stride=2,
                     target=TargetSpec(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                                       intermediate_size=192, seq_len=128, batch_size=16, steps=500, lr=3e-3,
                                       warmup_steps=25, eval_tokens=16384, bf16_autocast=False))


def run_config(out: Path, paths):
    from pipeline.run import DEFAULT_CONFIG, load_config

    drafter = "num_layers: 1, block_size: %d, mask_token_id: 5" % BLOCK
    return load_config(DEFAULT_CONFIG, [
        f"target.path={paths.target_dir}", f"run_dir={out / 'run'}", f"data.train_files=[{paths.train_chats}]",
        "generate.enabled=true", "generate.max_new_tokens=96", "generate.max_rows=1200", "generate.rows_per_shard=200",
        "target.target_layer_ids=[0,1,2]", "data.max_length=384", "data.min_loss_tokens=8",
        "cache.rows_per_shard=200", "cache.num_workers=1", "~train.drafters.dflash", "~train.drafters.dspark",
        "~train.drafters.eagle3",
        f"++train.drafters.dflash={{{drafter}, sample_from_anchor: false, head: none, markov_rank: 0, "
        "confidence_head: false}",
        f"++train.drafters.dspark={{{drafter}, sample_from_anchor: true, head: markov, markov_rank: 32, "
        "confidence_head: true}",
        f"++train.drafters.eagle3={{{drafter}, architecture: eagle3, sample_from_anchor: true, head: none, "
        "markov_rank: 0, confidence_head: false}",
        "train.num_workers=1", "train.micro_batch_samples=8", "train.global_batch_samples=8", "train.epochs=4",
        "train.max_steps=600", "train.num_anchors=32", "train.checkpoint_every_steps=1000", "ray.num_cpus=2",
        "calibrate.bins=10"])


def greedy(model, prompt, n: int):
    """The target's own greedy continuation of ``prompt`` (list of ids), ``n`` tokens, EOS ignored."""
    import torch

    ids = torch.tensor([prompt])
    out, past = [], None
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


def replay_acceptance(target, drafter, layer_ids, prompts, continuations) -> list[int]:
    """Accepted drafts per position when the product's own drafter (DFlash or EAGLE-3) runs greedy speculative
    decoding the way vLLM schedules it: the first block is anchored at the first generated token
    with the prompt as context; after ``m`` accepted drafts the next anchor is the bonus token ``m + 1``
    positions on; blocks continue until ``NEW_TOKENS`` tokens are out (verified against the longer
    greedy continuation, so the last block is judged in full).

    Returns:
        ``[drafts, accepted at position 1, ..., accepted at position gamma]``.
    """
    import torch

    from pipeline.target_model.prefill import LayerTap

    tap = LayerTap(target, layer_ids)
    counts = [0] * (drafter.config.block_size + 1)
    for prompt, cont in zip(prompts, continuations):
        seq = torch.cat([prompt, cont])
        with torch.no_grad():
            tap.base(input_ids=seq[None])
        feats, pos, end = tap.features()[0], len(prompt), len(prompt) + NEW_TOKENS - 1
        while pos < end:
            ctx = drafter.encode_context(feats[:pos], tokens=seq[1:pos])   # EAGLE-3 reads the next tokens
            block = drafter.draft_block(ctx, int(seq[pos]), 0.0).tokens
            counts[0] += 1
            m = 0
            while m < len(block) and int(block[m]) == int(seq[pos + 1 + m]):
                counts[m + 1] += 1
                m += 1
            pos += m + 1
    return counts


def references(cfg, paths, folded: float | None) -> dict:
    """Prompts + greedy continuations, DFlash and EAGLE-3 acceptance counts, and the DSpark heads on fixed inputs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.drafters import load_trained_drafter

    tok = AutoTokenizer.from_pretrained(paths.target_dir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir, local_files_only=True).eval()
    rows = [json.loads(x) for x in paths.heldout_chats.read_text().splitlines()[:NUM_PROMPTS]]
    ref = {}
    for i, row in enumerate(rows):
        prompt = tok.apply_chat_template(row["messages"][:1], tokenize=True, add_generation_prompt=True,
                                         enable_thinking=False, return_dict=False)
        ref[f"prompt.{i}"] = torch.tensor(prompt)
        ref[f"greedy.{i}"] = torch.tensor(greedy(target, prompt, NEW_TOKENS + BLOCK + 1))
    for name in ("dflash", "eagle3"):
        drafter = load_trained_drafter(cfg, name, str(paths.target_dir))
        ref[f"{name}.acceptance"] = torch.tensor(replay_acceptance(
            target, drafter, cfg.target.target_layer_ids, [ref[f"prompt.{i}"] for i in range(len(rows))],
            [ref[f"greedy.{i}"] for i in range(len(rows))]))
    model = load_trained_drafter(cfg, "dspark", str(paths.target_dir), calibrated=True)  # the head export ships
    g = torch.Generator().manual_seed(0)
    V, H = model.embed_tokens.num_embeddings, model.fc.out_features
    prev = torch.randint(0, V, (16,), generator=g)
    hidden = torch.randn(16, H, generator=g)
    with torch.no_grad():
        e = model.markov_head.embed(prev)
        ref["dspark.prev"], ref["dspark.hidden"] = prev, hidden
        ref["dspark.markov_embed"] = e
        ref["dspark.bias"] = model.markov_head.bias(e)
        ref["dspark.confidence"] = torch.sigmoid(model.confidence_head(hidden, e) / (folded or 1.0))
    return {k: v.contiguous() for k, v in ref.items()}


def _table(name: str, rows: dict[str, list]) -> None:
    keys = list(rows)
    print(f"{name}: ECE per position k ({', '.join(keys)})")
    for k in range(len(rows[keys[0]])):
        print(f"  k={k + 1}  " + "  ".join(f"{rows[c][k]:.4f}" for c in keys))


def main(out: Path) -> None:
    from safetensors.torch import save_file

    from pipeline.stages.cache import run_cache
    from pipeline.stages.calibrate import run_calibrate
    from pipeline.embedded import EmbeddedSpecMismatch, ensure_embedded
    from pipeline.stages.export import run_export
    from pipeline.stages.generate import run_generate
    from pipeline.stages.train import run_train

    out.mkdir(parents=True, exist_ok=True)
    times = {}
    t0 = time.perf_counter()
    try:
        paths = ensure_embedded(out / "embedded", build_spec())
    except EmbeddedSpecMismatch as e:  # built by an older version of this script: rebuild
        print(f"rebuilding the target: {e}")
        shutil.rmtree(out / "embedded")
        paths = ensure_embedded(out / "embedded", build_spec())
    times["target"] = time.perf_counter() - t0
    cfg = run_config(out, paths)
    summaries = {}
    shutil.rmtree(out / "run", ignore_errors=True)  # every stage from scratch; the target build is reused
    stages = {"generate": run_generate, "cache": run_cache, "train": run_train, "calibrate": run_calibrate,
              "export": run_export}
    for name, fn in stages.items():
        t = time.perf_counter()
        summaries[name] = fn(cfg)
        times[name] = time.perf_counter() - t
    exported = summaries["export"]["drafters"]
    if set(exported) != {"dflash", "dspark", "eagle3"}:
        sys.exit(f"FAIL: expected the dflash, dspark and eagle3 exports, got {sorted(exported)}: {summaries['export']}")
    ds = exported["dspark"]
    save_file(references(cfg, paths, ds["folded_temperature"]), str(out / "reference.safetensors"))
    manifest = {"target": str(paths.target_dir), "num_prompts": NUM_PROMPTS, "new_tokens": NEW_TOKENS,
                "drafters": {n: {"path": e["path"], "architecture": e["architecture"],
                                 "num_speculative_tokens": e["num_speculative_tokens"], "block_size": e["block_size"],
                                 "folded_temperature": e["folded_temperature"]} for n, e in exported.items()},
                "target_metrics": json.loads(paths.metrics.read_text()).get("heldout_chat"),
                "stages": summaries, "seconds": {k: round(v, 1) for k, v in times.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    print("train:", {n: r.get("last", {}).get("tau_expected") for n, r in summaries["train"]["drafters"].items()},
          "(expected tau at the last step)")
    _table("dspark calibration", {"before": ds["ece_before"], "after STS": ds["ece_sts"], "vLLM view": ds["ece_vllm"]})
    print("dspark temperatures:", [round(t, 3) for t in summaries["calibrate"]["drafters"]["dspark"]["temperatures"]],
          "confidence export:", ds["confidence"], "folded T:", ds["folded_temperature"])
    print("seconds:", manifest["seconds"])
    print(f"exports written under {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_exports.py OUT_DIR")
    main(Path(sys.argv[1]).resolve())
