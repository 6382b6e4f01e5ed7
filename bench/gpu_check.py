"""GPU check: the product's own training, attention, prefill, cache-writer, block-evaluation and
speculative-decoding code at the Qwen3-4B recipe shape (pipeline/target_model/shapes/qwen3_4b.json and
conf/qwen3_4b.yaml; random weights) on one GPU, one JSON out (a section per item: ok, seconds, figures, error).

    make gpu-check       # python3 bench/gpu_check.py --out runs/gpu-check/gpu_check.json   (CUDA)
    make gpu-check-dry   # --dry: CPU, reduced shape (hidden 64, vocab 512, T=128), under a minute
    flags: --steps N (timed steps per micro-batch after a warm-up), --sections train,attention,... --block-ray

Sections (a failing one records its error, the others still run; exit 1 if any failed):
  train       Drafter + DeepSpeed ZeRO-2 (make_engine; world size 1; bf16 GPU / fp32 CPU), loop.micro_step on
              random cache-like samples at micro-batch 1, 2, 4 (dry 1, 2): step s, tokens/s, peak memory.
  attention   one batch: flex on the GPU (bf16, compiled) vs sdpa on a CPU fp32 copy (sdpa with a mask is
              refused on CUDA): loss and gradients to bf16 tolerance; dry: forward only (no CPU flex backward).
  prefill     random target through TargetPrefill vs a bare model(...) forward: tokens/s, ratio, MFU (GPU; peak
              roofline.H200); one shard through CacheRoot.write_shard: bytes/token vs estimate_cache_bytes.
  block_eval  block_runner.evaluate_blocks on a few prefilled blocks, T = 0 and 1, with the drafter as the
              evaluate stage prepares it (block_runner.eval_drafter: on the device, bf16 on a GPU).
  speculate   one round of speculate.speculative_decode on the device (the drafter from eval_drafter), at the
              shape's vocabulary.
  sps         inference.sps.profile_sps on the target (the evaluate stage's SPS curve when no
              evaluate.sps_table is given): steps/s at B = 1..512 tokens per step.

Nothing imported here loads Ray or vLLM ("ray_imported" / "vllm_imported" in the JSON; --block-ray makes their
import fail). On a GPU machine with only torch and transformers, carry in these wheels (pip download with
--python-version / --platform / --only-binary=:all: for that machine) and install them without dependencies:

    pip download --no-deps -d wheels/ zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 \
        einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0 \
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    pip wheel --no-deps --no-build-isolation -w wheels/ deepspeed==0.19.8  # PyPI has its sdist only; no ops built
    pip install --no-deps wheels/*
    python3 bench/gpu_check.py --out runs/gpu-check/gpu_check.json     # estimated 4-6 min on one H200

hydra-core / omegaconf / antlr4 are not needed (nothing here loads them; "third_party_modules" in the JSON lists
what the run imported). Triton (in torch's CUDA wheel) builds its launcher with the machine's C compiler, so
flex attention needs gcc / cc there; torch.utils.cpp_extension (imported by training.engine) needs setuptools.
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if "--block-ray" in sys.argv:  # as on the GPU machine: any import of them raises ImportError
    sys.modules["ray"] = sys.modules["vllm"] = None
DRY = "--dry" in sys.argv
os.environ["DS_ACCELERATOR"] = "cpu" if DRY else "cuda"  # the Makefile exports cpu: DeepSpeed reads it at import
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/dspark-torch-extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed  # noqa: E402

SHAPE_FILE = REPO / "pipeline/target_model/shapes/qwen3_4b.json"
RECIPE = REPO / "conf/qwen3_4b.yaml"
BF16_REL_TOL = 0.05  # relative gradient / loss error allowed between bf16 flex (GPU) and fp32 sdpa (CPU)


class Shape:
    """One run's sizes: the target's Qwen3Config ``tcfg``, the drafter's, and each section's batch."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    device = property(lambda s: "cuda" if s.gpu else "cpu")
    dtype = property(lambda s: torch.bfloat16 if s.gpu else torch.float32)


def make_shape(dry: bool, steps: int | None) -> Shape:
    from transformers import Qwen3Config

    if dry:
        tcfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           tie_word_embeddings=False)
        return Shape(gpu=False, tcfg=tcfg, ids=(0, 1, 2), mask=511, layers=2, block=7, rank=16, anchors=8, T=128,
                     batches=(1, 2), steps=steps or 2, lr=6e-4, prefill_samples=4, shard_samples=4, max_tokens=512,
                     attn_T=128, attn_anchors=8, eval_anchors=8, prompt_len=32)
    import yaml

    r = yaml.safe_load(RECIPE.read_text())  # the recipe's own numbers (conf/qwen3_4b.yaml)
    d, t = r["train"]["drafters"]["dspark"], r["train"]
    tcfg = Qwen3Config(**json.loads(SHAPE_FILE.read_text()))
    return Shape(gpu=True, tcfg=tcfg, ids=tuple(r["target"]["target_layer_ids"]), mask=d["mask_token_id"],
                 layers=d["num_layers"], block=d["block_size"], rank=d["markov_rank"],
                 anchors=t["num_anchors"], T=r["data"]["max_length"], batches=(1, 2, t["micro_batch_samples"]),
                 steps=steps or 3, lr=t["lr"], prefill_samples=8, shard_samples=2,
                 max_tokens=r["cache"]["max_tokens_per_batch"], attn_T=1024, attn_anchors=64, eval_anchors=8,
                 prompt_len=256)


def timed(S: Shape, fn):
    """``(seconds, fn())``, the device synchronised before and after."""
    sync = torch.cuda.synchronize if S.gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t0, r


def random_samples(S: Shape, n: int, T: int, seed: int, features: bool = True) -> list[dict]:
    """Cache-like sample mappings (collate_samples' keys): a prompt of T/8 unsupervised tokens, then supervised."""
    g = torch.Generator().manual_seed(seed)
    H, L, V = S.tcfg.hidden_size, len(S.ids), S.tcfg.vocab_size
    out = []
    for _ in range(n):
        mask = torch.ones(T, dtype=torch.uint8)
        mask[: T // 8] = 0
        out.append({"input_ids": torch.randint(0, V, (T,), generator=g, dtype=torch.int32), "loss_mask": mask})
        if features:
            out[-1].update(features=torch.randn(T, L * H, generator=g).bfloat16(),
                           last_hidden=torch.randn(int(mask[1:].sum()), H, generator=g).bfloat16())
    return out


def make_drafter(S: Shape, embed, lm_head, attention: str, device: str):
    from training.drafter import Drafter, DrafterConfig

    cfg = DrafterConfig(target_layer_ids=S.ids, mask_token_id=S.mask, num_layers=S.layers, block_size=S.block,
                        markov_rank=S.rank, num_anchors=S.anchors, attention=attention)
    with torch.device(device):
        return Drafter(cfg, S.tcfg, embed, lm_head)


def random_heads(S: Shape, device: str):
    torch.manual_seed(0)
    V, H = S.tcfg.vocab_size, S.tcfg.hidden_size
    embed = torch.randn(V, H, device=device) * S.tcfg.initializer_range
    return embed, (embed if S.tcfg.tie_word_embeddings else torch.randn(V, H, device=device) * 0.02)


def cast_params(module, dtype):
    """Parameters to ``dtype``, buffers kept (the RoPE ``inv_freq`` stays fp32), as DeepSpeed's bf16 and
    ``from_pretrained(dtype=...)`` do; ``module.to(dtype)`` would round ``inv_freq`` too."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module


def peak_memory(S: Shape) -> dict:
    if S.gpu:
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # process peak so far


def init_group(S: Shape) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if S.gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if S.gpu else "gloo", rank=0, world_size=1)


def sec_train(S: Shape, ctx: dict) -> dict:
    from training.engine import make_engine
    from training.loop import host_batch, micro_step
    from training.losses import LossConfig

    init_group(S)
    model = make_drafter(S, *random_heads(S, S.device), attention="auto", device=S.device)
    n_train = sum(p.numel() for p in model.trainable_parameters())
    engine = make_engine(model, 2, lr=S.lr, muon_lr=None, betas=(0.9, 0.999), weight_decay=0.0, total_steps=1000,
                         warmup_ratio=0.04, bf16=S.gpu, micro_batch=1, accumulation=1, grad_clip=1.0)
    samples = random_samples(S, max(S.batches), S.T, seed=1)
    out = {"trainable_params": n_train, "T": S.T, "num_anchors": S.anchors, "zero_stage": 2,
           "precision": "bf16" if S.gpu else "fp32", "engine_micro_batch": 1}
    for B in S.batches:  # one engine: its micro-batch setting is bookkeeping (accumulation 1: every call steps)
        batch = host_batch(samples[:B], pin=S.gpu)
        if S.gpu:
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for step in range(S.steps + 1):
            t, res = timed(S, lambda: micro_step(engine, batch, torch.Generator().manual_seed(step), LossConfig(), 1))
            times.append(t)
            losses.append(float(res.loss.detach()))
        step_s = statistics.median(times[1:])
        if not (all(math.isfinite(x) for x in losses) and step_s > 0):
            raise RuntimeError(f"micro-batch {B}: losses {losses}, step times {times}")
        out[f"mb{B}"] = {"warmup_s": times[0], "step_s": step_s, "step_s_all": times, "tokens_per_s": B * S.T / step_s,
                         "supervised_slots": float(res.metrics["supervised_slots"]), "loss": losses, **peak_memory(S)}
    engine = model = res = None  # noqa: F841 (freed before the next section)
    gc.collect()
    if S.gpu:
        torch.cuda.empty_cache()
    return out


def sec_attention(S: Shape, ctx: dict) -> dict:
    from training.blocks import collate_samples
    from training.data import to_device
    from training.losses import LossConfig

    S2 = copy.copy(S)
    S2.anchors = S.attn_anchors
    ref = make_drafter(S2, *random_heads(S, "cpu"), attention="sdpa", device="cpu")  # fp32 on the CPU
    cast_params(ref, S.dtype).float()  # the same (bf16-rounded on GPU) weights in both
    flex = cast_params(copy.deepcopy(ref), S.dtype).to(S.device)
    flex.config.attention = "flex"
    batch = collate_samples(random_samples(S, 1, S.attn_T, seed=2))
    blocks = ref.make_blocks(batch, torch.Generator().manual_seed(0))
    lc = LossConfig()
    grad = S.gpu  # torch has no CPU flex backward

    def run(model, device):
        slots = model(to_device(batch, device), to_device(blocks, device))
        out = model.loss(slots, lc, reduce=False)
        if grad:
            out.loss.backward()
        return slots.hidden.detach().float().cpu(), out

    with torch.set_grad_enabled(grad):
        t_ref, (hs, ls) = timed(S, lambda: run(ref, "cpu"))
        t_flex, (hf, lf) = timed(S, lambda: run(flex, S.device))
    a, b = float(ls.loss.detach()), float(lf.loss.detach())
    out = {"T": S.attn_T, "num_anchors": S.attn_anchors, "flex_device": S.device, "flex_dtype": str(S.dtype),
           "backward": grad, "loss_sdpa": a, "loss_flex": b, "loss_abs_diff": abs(a - b),
           "loss_rel_diff": abs(a - b) / max(abs(a), 1e-12), "hidden_max_abs_diff": float((hs - hf).abs().max()),
           "hidden_rel_err": float((hs - hf).norm() / hs.norm()), "sdpa_cpu_s": t_ref, "flex_s_incl_compile": t_flex}
    if not grad:
        if not out["loss_abs_diff"] < 1e-4:
            raise AssertionError(f"flex and sdpa forward losses differ by {out['loss_abs_diff']:.3g} (> 1e-4)")
        return out
    sums = {"d2": 0.0, "r2": 0.0, "f2": 0.0, "dot": 0.0}
    worst = (0.0, "")
    for (name, pr), pf in zip(ref.named_parameters(), flex.parameters()):
        if pr.grad is None and pf.grad is None:
            continue
        gr = pr.grad.double() if pr.grad is not None else torch.zeros_like(pr, dtype=torch.float64)
        gf = pf.grad.double().cpu() if pf.grad is not None else torch.zeros_like(gr)
        d2, r2 = float((gf - gr).square().sum()), float(gr.square().sum())
        for k, v in (("d2", d2), ("r2", r2), ("f2", float(gf.square().sum())), ("dot", float((gf * gr).sum()))):
            sums[k] += v
        if r2 > 0 and math.sqrt(d2 / r2) > worst[0]:
            worst = (math.sqrt(d2 / r2), name)
    rel = math.sqrt(sums["d2"] / max(sums["r2"], 1e-300))
    out.update(grad_rel_err=rel, grad_cosine=sums["dot"] / math.sqrt(max(sums["r2"] * sums["f2"], 1e-300)),
               worst_param=worst[1], worst_param_rel_err=worst[0], tolerance=BF16_REL_TOL)
    if not (rel < BF16_REL_TOL and out["loss_rel_diff"] < BF16_REL_TOL):
        raise AssertionError(f"flex (bf16, CUDA) vs sdpa (fp32, CPU): gradient rel. error {rel:.3g}, loss rel. "
                             f"diff {out['loss_rel_diff']:.3g} (tolerance {BF16_REL_TOL})")
    return out


def get_target(S: Shape, ctx: dict):
    """The random target (Qwen3ForCausalLM of the shape; bf16 on GPU, fp32 on CPU), built once."""
    if "target" not in ctx:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(1)
        with torch.device(S.device):  # dtype as load_target's from_pretrained: parameters only
            ctx["target"] = AutoModelForCausalLM.from_config(S.tcfg, dtype=S.dtype).eval()
    return ctx["target"]


def _rate(S: Shape, fn, tokens: int, reps: int = 3) -> float:
    """Tokens/s of ``fn`` over ``tokens``: the median of ``reps`` timed calls after a warm-up."""
    fn()
    return tokens / statistics.median(timed(S, fn)[0] for _ in range(reps))


def sec_prefill(S: Shape, ctx: dict) -> dict:
    from cache_schema import CacheSample, Fingerprint, estimate_cache_bytes, open_cache, shard_overhead_bytes
    from pipeline.inference.roofline import H200, ModelShape
    from pipeline.target_model.prefill import TargetPrefill, length_batches

    model = get_target(S, ctx)
    raw = random_samples(S, S.prefill_samples, S.T, seed=3, features=False)
    ids = [s["input_ids"].numpy() for s in raw]
    masks = [s["loss_mask"].numpy() for s in raw]
    batch = length_batches([len(x) for x in ids], S.max_tokens)[0]  # the cache stage's batching
    tokens = sum(len(ids[i]) for i in batch)
    x = torch.as_tensor(np.stack([ids[i] for i in batch]).astype(np.int64), device=S.device)
    attn = torch.ones_like(x)

    if S.gpu:
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():  # model(...) with its lm_head, and its base model alone
        bare_tps = _rate(S, lambda: model(input_ids=x, attention_mask=attn, use_cache=False), tokens)
        base_tps = _rate(S, lambda: model.model(input_ids=x, attention_mask=attn, use_cache=False), tokens)
    prefill = TargetPrefill(model, S.ids)  # after the bare timings: its hooks stay on the model
    outs = [None]

    def pre():
        outs[0] = prefill([ids[i] for i in batch], [masks[i] for i in batch])

    pre_tps = _rate(S, pre, tokens)
    ctx["tap"] = prefill.tap
    shape = ModelShape.from_config(S.tcfg.to_dict())
    flop_pre = 2 * shape.num_layers * shape.layer_matmul_params  # no lm_head in the prefill
    flop_bare = 2 * shape.matmul_params
    out = {"batch_samples": len(batch), "tokens": tokens,
           "attn_implementation": getattr(model.config, "_attn_implementation", None),
           "prefill_tokens_per_s": pre_tps, "bare_tokens_per_s": bare_tps, "bare_base_tokens_per_s": base_tps,
           "ratio": pre_tps / bare_tps, "ratio_vs_base": pre_tps / base_tps,
           "mfu_prefill": flop_pre * pre_tps / H200.peak_flops if S.gpu else None,
           "mfu_bare": flop_bare * bare_tps / H200.peak_flops if S.gpu else None,
           "mfu_prefill_incl_attention": (shape.flops_per_token(S.T // 2) - 2 * shape.vocab_size * shape.hidden_size)
           * pre_tps / H200.peak_flops if S.gpu else None,  # causal: mean context T/2
           "mfu_params_prefill": flop_pre // 2, "mfu_params_bare": flop_bare // 2,
           "mfu_peak_flops": H200.peak_flops, "target_params": sum(p.numel() for p in model.parameters()),
           **peak_memory(S)}
    samples = [CacheSample(input_ids=torch.as_tensor(ids[i]), loss_mask=torch.as_tensor(masks[i]), features=o.features,
                           last_hidden=o.last_hidden, sample_id=f"0-{i}", source=0, row=i,
                           content_hash=hashlib.sha256(ids[i].tobytes()).hexdigest())
               for i, o in zip(batch, outs[0])][: S.shard_samples]
    keys = ("input_ids", "loss_mask", "features", "last_hidden")
    ctx["samples"] = [{k: getattr(s, k) for k in keys} for s in samples]
    H, L = S.tcfg.hidden_size, len(S.ids)
    fp = Fingerprint(target={"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": S.tcfg.num_hidden_layers,
                             "vocab_size": S.tcfg.vocab_size}, embed_hash="", lm_head_hash="", tokenizer_hash="",
                     chat_template_hash="", target_layer_ids=tuple(S.ids), max_length=S.T, min_loss_tokens=1)
    with tempfile.TemporaryDirectory() as tmp:
        root = open_cache(f"{tmp}/cache", fp)
        t0 = time.perf_counter()
        rec = root.write_shard(0, samples, writer_id="gpu-check")
        write_s = time.perf_counter() - t0
    est = estimate_cache_bytes(rec.num_tokens, hidden_size=H, num_target_layers=L, num_samples=rec.num_samples,
                               supervised_fraction=rec.num_hidden_rows / rec.num_tokens)
    overhead = shard_overhead_bytes(hidden_size=H, target_layer_ids=tuple(S.ids))
    bpt, est_bpt = rec.total_bytes / rec.num_tokens, (est.total_bytes + overhead) / rec.num_tokens
    out["shard"] = {"samples": rec.num_samples, "tokens": rec.num_tokens, "hidden_rows": rec.num_hidden_rows,
                    "bytes": rec.total_bytes,
                    "bytes_per_token": bpt, "estimate_bytes_per_token": est_bpt,
                    "estimate_payload_bytes_per_token": est.bytes_per_token, "shard_overhead_bytes": overhead,
                    "rel_diff": bpt / est_bpt - 1, "write_s": write_s,
                    "write_mb_per_s": rec.total_bytes / write_s / 1e6}
    if not (pre_tps > 0 and bare_tps > 0 and abs(bpt / est_bpt - 1) < 0.01):
        raise AssertionError(f"prefill {pre_tps} / bare {bare_tps} tokens/s; shard {bpt:.1f} B/token, "
                             f"estimate {est_bpt:.1f}")
    return out


def drafter_on_target(S: Shape, ctx: dict):
    """A drafter sharing the random target's embedding / lm_head, fp32 on the CPU (built once); attention
    ``auto``, the recipe's: flex once :func:`eval_copy` puts it on a GPU, sdpa on the CPU."""
    if "drafter" in ctx:
        return ctx["drafter"]
    model = get_target(S, ctx)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    lm = embed if S.tcfg.tie_word_embeddings else model.get_output_embeddings().weight.detach().float().cpu()
    ctx["drafter"] = make_drafter(S, embed, lm, attention="auto", device="cpu").eval()
    return ctx["drafter"]


def eval_copy(S: Shape, ctx: dict):
    """The drafter as calibrate and evaluate run it (``block_runner.eval_drafter``: on the device, in the
    target's dtype on a GPU, the RoPE frequencies kept float32), a copy of the CPU one."""
    from training.block_runner import eval_drafter

    return eval_drafter(copy.deepcopy(drafter_on_target(S, ctx)), S.device, S.dtype if S.gpu else None)


def sec_block_eval(S: Shape, ctx: dict) -> dict:
    from training.block_eval import summarise
    from training.block_runner import evaluate_blocks

    drafter = eval_copy(S, ctx)
    samples = ctx.get("samples") or random_samples(S, 2, S.T, seed=4)
    t0 = time.perf_counter()
    tally = evaluate_blocks({"dspark": drafter}, [samples[:2]], temperatures=[0.0, 1.0], num_anchors=S.eval_anchors)
    seconds = time.perf_counter() - t0
    summ = summarise(tally)["drafters"]["dspark"]
    out = {"device": str(S.device), "samples": len(samples[:2]), "num_anchors": S.eval_anchors, "eval_s": seconds,
           "vocab": S.tcfg.vocab_size, "by_temperature": {str(t): {k: v[k] for k in ("n", "tau", "tau_expected")}
                                                         for t, v in summ.items()}}
    if not all(v["n"] > 0 and v["tau"] >= 1 for v in out["by_temperature"].values()):
        raise AssertionError(f"block evaluation figures: {out['by_temperature']}")
    return out


def sec_speculate(S: Shape, ctx: dict) -> dict:
    from pipeline.inference.speculate import speculative_decode
    from pipeline.target_model.prefill import LayerTap

    model = get_target(S, ctx)
    drafter = eval_copy(S, ctx)
    tap = ctx.get("tap") or LayerTap(model, S.ids)
    samples = ctx.get("samples") or random_samples(S, 1, S.T, seed=5)
    prompt = samples[0]["input_ids"][: S.prompt_len].tolist()
    gen = torch.Generator(device=S.device).manual_seed(0)
    dec = speculative_decode(model, drafter, prompt, tap=tap, max_new_tokens=2, temperature=1.0, stop_ids=set(),
                             generator=gen)  # the prefill's token, then exactly one round
    if len(dec.rounds) != 1:
        raise AssertionError(f"expected one round, got {len(dec.rounds)}")
    r = dec.rounds[0]
    return {"prompt_tokens": len(prompt), "vocab": drafter.lm_head.weight.shape[0], "gamma": r.gamma,
            "verified": r.verified, "accepted": r.accepted, "draft_s": r.draft_s, "verify_s": r.verify_s,
            "emitted": len(dec.tokens), "seconds": dec.seconds, "confidence_logits": r.confidence_logits}


def sec_sps(S: Shape, ctx: dict) -> dict:
    from pipeline.inference.sps import profile_sps

    batch = (1, 4, 16, 64, 256, 512) if S.gpu else (1, 4, 16)
    curve = profile_sps(get_target(S, ctx), batch, context=128, repeats=3)
    return {"batch_tokens": list(curve.batch_tokens), "steps_per_s": [float(v) for v in curve.steps_per_s],
            "tokens_per_s": [float(b * v) for b, v in zip(curve.batch_tokens, curve.steps_per_s)]}


SECTIONS = {"train": sec_train, "attention": sec_attention, "prefill": sec_prefill, "block_eval": sec_block_eval,
            "speculate": sec_speculate, "sps": sec_sps}


def clean(obj):
    """JSON-safe: non-finite floats become null, tuples lists, anything else its str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj if obj is None or isinstance(obj, (bool, int, str)) else str(obj)


def third_party() -> list[str]:
    stdlib = set(sys.stdlib_module_names)
    tops = {m.split(".")[0] for m, mod in list(sys.modules.items()) if mod is not None}
    own = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    return sorted(t for t in tops - stdlib - own if not t.startswith("_"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, reduced shape")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per micro-batch (default 3; dry 2)")
    ap.add_argument("--out", default="runs/gpu-check/gpu_check.json")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--block-ray", action="store_true", help="make importing ray / vllm fail (as on the GPU machine)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import transformers

    result = {"dry": args.dry, "torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry else "cpu",
              "cuda": torch.version.cuda, "ds_accelerator": os.environ["DS_ACCELERATOR"], "sections": {}}
    if not args.dry and not torch.cuda.is_available():
        result["error"] = "no CUDA device: run with --dry on a CPU machine"
        out_path.write_text(json.dumps(result, indent=1))
        print(result["error"], file=sys.stderr)
        return 1
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    S = make_shape(args.dry, args.steps)
    result["shape"] = clean({k: v for k, v in vars(S).items() if k != "tcfg"} | {
        "hidden": S.tcfg.hidden_size, "vocab": S.tcfg.vocab_size, "target_layers": S.tcfg.num_hidden_layers})
    ctx: dict = {}
    for name in [s for s in args.sections.split(",") if s]:
        t0 = time.perf_counter()
        try:
            entry = {"ok": True, **SECTIONS[name](S, ctx)}
        except Exception as exc:  # recorded; the other sections still run
            entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        entry["seconds"] = time.perf_counter() - t0
        result["sections"][name] = clean(entry)
        status = "ok" if entry["ok"] else "FAILED " + entry["error"][:300]
        print(f"{name}: {status} ({entry['seconds']:.1f} s)", flush=True)
        out_path.write_text(json.dumps(result, indent=1))  # after every section: a killed run keeps what it did
        gc.collect()  # a failed section's tensors too
        if S.gpu:
            torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    ds = sys.modules.get("deepspeed")
    result.update(wall_s=time.perf_counter() - t_start, ray_imported=sys.modules.get("ray") is not None,
                  deepspeed=getattr(ds, "__version__", None),
                  vllm_imported=sys.modules.get("vllm") is not None, third_party_modules=third_party(),
                  ok=all(s["ok"] for s in result["sections"].values()))
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path} ({result['wall_s']:.1f} s): {'all ok' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
