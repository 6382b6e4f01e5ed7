"""Roofline model of the serving cost curve (pipeline.inference.roofline): hand-computed values on a
tiny made-up shape, the Qwen3-4B shape on an H200, regimes, and the scheduler simulator's input."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeline.inference.roofline import (H200, Accelerator, DrafterShape, ModelShape, draft_step_seconds,
                                         regime, sps_curve, verify_step_seconds)
from pipeline.inference.scheduler import SPSCurve, simulate
from paths import REPO

# Qwen3-4B config.json (the numbers of the public model card; tests/fixtures/qwen3_4b/ holds only the
# tokenizer config, so the model config is written out here)
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}

# A tiny made-up model: H = 4, 2 layers, 2 query heads / 1 KV head of head_dim 2, I = 8, V = 10, tied.
TINY = {"model_type": "qwen3", "hidden_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": 8, "vocab_size": 10,
        "tie_word_embeddings": True}
# achieved 2e4 * 0.5 = 1e4 FLOP/s and 1250 * 0.8 = 1000 bytes/s, 0.01 s per forward
TINY_ACC = Accelerator("tiny", peak_flops=2e4, hbm_bandwidth=1250.0, compute_efficiency=0.5,
                       bandwidth_efficiency=0.8, step_overhead_s=0.01)


@pytest.fixture(scope="module")
def qwen():
    target = ModelShape.from_config(QWEN3_4B)
    return target, DrafterShape.from_target(target, num_layers=5, num_features=5, markov_rank=256)


# ---------------------------------------------------------------- hand-computed tiny case

def test_tiny_shape_counts_by_hand():
    s = ModelShape.from_config(TINY)
    # one layer's matmuls: q, k, v, o = H hd (2 heads + 2 kv) = 4*2*(4+2) = 48; MLP 3 H I = 96
    assert s.layer_matmul_params == 48 + 96
    # + two RMSNorms (2 H = 8) + Qwen3 q/k norms (2 hd = 4) = 156
    assert s.layer_params == 144 + 8 + 4
    assert s.matmul_params == 2 * 144 + 10 * 4                    # layers + lm_head V H = 328
    assert s.param_count == 10 * 4 + 2 * 156 + 4                  # tied embedding + layers + final norm = 356
    assert s.weight_bytes == 356 * 2                              # bf16, the tied matrix read once = 712
    assert s.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2              # 2 x layers x kv x hd x 2 bytes = 16
    assert s.flops_per_token(3) == 2 * 328 + 4 * 2 * 2 * 2 * 3    # 656 + attention 96 = 752
    untied = ModelShape.from_config({**TINY, "tie_word_embeddings": False})
    assert untied.param_count == 356 + 40 and untied.weight_bytes == 712   # the input embedding is gathered


def test_tiny_verify_step_and_regime_by_hand():
    s = ModelShape.from_config(TINY)
    # R = 2, context 3: memory = (712 weights + 2 * 3 * 16 KV) / 1000 = 0.808 s for any l
    # compute = 2 l * 752 / 1e4: l = 3 -> 0.4512 s (memory-bound), l = 6 -> 0.9024 s (compute-bound)
    assert verify_step_seconds(s, TINY_ACC, 2, 3, 3) == pytest.approx(0.808 + 0.01)
    assert verify_step_seconds(s, TINY_ACC, 2, 6, 3) == pytest.approx(0.9024 + 0.01)
    low, high = regime(s, TINY_ACC, 2, 3, 3), regime(s, TINY_ACC, 2, 6, 3)
    assert (low.bound, high.bound) == ("memory", "compute")
    assert (low.compute_s, low.memory_s) == (pytest.approx(0.4512), pytest.approx(0.808))
    # ridge T* = 808 bytes * 1e4 FLOP/s / (1000 bytes/s * 752 FLOPs) = 10.7447 tokens per step
    assert low.ridge_tokens == pytest.approx(808 * 1e4 / (1000 * 752))
    assert low.ridge_tokens_per_request == pytest.approx(808 * 1e4 / (1000 * 752) / 2)
    assert low.fits                                               # no capacity given: infinite


def test_tiny_draft_step_by_hand():
    d = DrafterShape.from_target(ModelShape.from_config(TINY), num_layers=1, num_features=2, markov_rank=3)
    # R = 2 blocks of S = 2 slots over context 3; n = 1 layer, F = 2, r = 3.
    # per slot: 2 n 144 = 288 + attention 4 n heads hd c = 48 + lm_head 2 V H = 80 + conf 2 (H + r + 1) = 16
    per_slot = 288 + 48 + 80 + 16
    # per new context token (S + 1 = 3 per request): fc 2 F H^2 = 64 + their K, V 4 n H kv hd = 32
    flops = 2 * 2 * per_slot + 2 * 3 * (64 + 32)                 # 2304 FLOPs -> 0.2304 s
    weights = (156 + 2 * 16 + 10 * 4 + 4 + (4 + 3 + 1)) * 2      # layer, fc, lm_head, norm, conf = 480 B
    kv = 2 * 3 * (2 * 1 * 1 * 2 * 2)                              # R c x 8 B per token = 48 B
    parallel = max(flops / 1e4, (weights + kv) / 1000)           # memory-bound: 0.528 s
    markov = max(2 * 2 * 3 * 10 / 1e4, 10 * 3 * 2 / 1000)        # W2 read per slot: 0.06 s
    expect = parallel + 2 * markov + 0.01
    assert expect == pytest.approx(0.658)
    assert draft_step_seconds(d, TINY_ACC, 2, 2, 3) == pytest.approx(expect)
    dflash = DrafterShape.from_target(ModelShape.from_config(TINY), num_layers=1, num_features=2,
                                      markov_rank=0, confidence_head=False)
    assert draft_step_seconds(dflash, TINY_ACC, 2, 2, 3) < expect


def test_tiny_sps_curve_by_hand():
    s = ModelShape.from_config(TINY)
    d = DrafterShape.from_target(s, num_layers=1, num_features=2, markov_rank=3)
    curve = sps_curve(s, d, TINY_ACC, 2, 7, 3, block_size=2)
    assert isinstance(curve, SPSCurve)
    assert curve.batch_tokens.tolist() == [2, 4, 6, 8, 10, 12, 14]        # B = R x l
    # l <= 5 memory-bound: 1 / (0.658 + 0.818); l = 6, 7: compute 2 l 752 / 1e4 + 0.01
    expect = [1 / (0.658 + 0.818)] * 5 + [1 / (0.658 + 0.9024 + 0.01), 1 / (0.658 + 1.0528 + 0.01)]
    assert curve.steps_per_s.tolist() == pytest.approx(expect)
    default = sps_curve(s, d, TINY_ACC, 2, 3, 3)                           # block_size = 3 - 1 = 2
    assert default.steps_per_s.tolist() == pytest.approx(expect[:3])


# ---------------------------------------------------------------- Qwen3-4B on an H200

def test_qwen3_4b_shape(qwen):
    target, drafter = qwen
    assert target.param_count == pytest.approx(4.02e9, rel=0.01)
    # tied embedding V H + 36 x (attention H hd (2*32 + 2*8) + MLP 3 H I + norms 2 H + q/k norms 2 hd) + norm H
    layer = 2560 * 128 * 80 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128
    assert target.param_count == 151936 * 2560 + 36 * layer + 2560 == 4_022_468_096
    assert target.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    assert target.weight_bytes == 2 * target.param_count                  # tied: the one matrix is the lm_head
    assert drafter.backbone.num_layers == 5 and drafter.backbone.kv_bytes_per_token == 2 * 5 * 8 * 128 * 2


def test_more_tokens_never_faster(qwen):
    target, drafter = qwen
    for R in (1, 16, 256):
        for c in (0, 1024, 4096):
            t = [verify_step_seconds(target, H200, R, l, c) for l in range(1, 17)]
            assert all(b >= a for a, b in zip(t, t[1:]))
            assert verify_step_seconds(target, H200, R, 8, c + 1) >= t[7]
            assert verify_step_seconds(target, H200, R + 1, 8, c) >= t[7]
            raw = [1 / (draft_step_seconds(drafter, H200, R, 7, c) + x) for x in t[:8]]
            assert all(b <= a for a, b in zip(raw, raw[1:]))
            assert sps_curve(target, drafter, H200, R, 8, c).steps_per_s.tolist() == pytest.approx(raw)


def test_memory_bound_at_one_request_compute_bound_at_256(qwen):
    target, _ = qwen
    for c in (1024, 2048):
        one = [verify_step_seconds(target, H200, 1, l, c) for l in (1, 8)]
        assert one[1] <= 1.10 * one[0]                                      # nearly flat from 1 to 8 tokens
        assert regime(target, H200, 1, 8, c).bound == "memory"
        assert regime(target, H200, 1, 8, c).ridge_tokens > 100             # ~140 tokens per step
        many = regime(target, H200, 256, 8, c)
        assert many.bound == "compute" and many.ridge_tokens_per_request < 8 and many.fits
        assert verify_step_seconds(target, H200, 256, 8, c) > 1.4 * verify_step_seconds(target, H200, 256, 1, c)


def test_sps_curve_feeds_the_scheduler_simulator(qwen):
    target, drafter = qwen
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.6, 1.0, size=(200, 7))
    outcomes = np.cumprod(rng.uniform(size=conf.shape) < conf, axis=1).astype(np.int8)
    flat = sps_curve(target, drafter, H200, 1, 8, 1024)                    # gamma = 7: l = 1..8
    res = simulate(outcomes, conf, flat, concurrency=(1,), n_steps=100, seed=1)
    json.dumps(res, allow_nan=False)
    low = res["results"][0]
    # memory-bound: verifying the whole block is free, the scheduler admits it all
    assert low["best_fixed_gamma"] == 7 and low["ratio_scheduler"] == pytest.approx(1.0)
    steep = sps_curve(target, drafter, H200, 256, 8, 1024)
    high = simulate(outcomes, conf, steep, concurrency=(256,), n_steps=4, seed=1)["results"][0]
    assert high["ratio_scheduler"] >= 1.0 and high["scheduler"]["verified_per_request"] < 7


# ---------------------------------------------------------------- errors and purity

def test_input_errors_name_the_fix(qwen):
    target, drafter = qwen
    for args, what in (((0, 8, 1024), "batch_requests must be an integer >= 1"),
                       ((1, 0, 1024), r"tokens_per_request must be an integer >= 1 \(1 \+ drafts verified\)"),
                       ((1, 8, -1), "context must be an integer >= 0"), ((1.5, 8, 0), "batch_requests"),
                       ((True, 8, 0), "batch_requests")):
        with pytest.raises(ValueError, match=what):
            verify_step_seconds(target, H200, *args)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        draft_step_seconds(drafter, H200, 1, 0, 10)
    with pytest.raises(ValueError, match="max_tokens"):
        sps_curve(target, drafter, H200, 1, 0, 10)
    with pytest.raises(ValueError, match=r"config lacks \['vocab_size'\]: pass the target's HF config.json"):
        ModelShape.from_config({k: v for k, v in QWEN3_4B.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1"):
        ModelShape.from_config({**QWEN3_4B, "num_hidden_layers": 0})
    with pytest.raises(ValueError, match="markov_rank must be an integer >= 0"):
        DrafterShape.from_target(target, markov_rank=-1)
    with pytest.raises(ValueError, match=r"compute_efficiency must be a fraction of the peak in \(0, 1\]"):
        Accelerator("x", 1e12, 1e12, 1.5, 0.8, 0.0)
    for bad in (0.0, float("nan")):
        with pytest.raises(ValueError, match="peak_flops must be > 0"):
            Accelerator("x", bad, 1e12, 0.5, 0.8, 0.0)
    with pytest.raises(ValueError, match="step_overhead_s must be >= 0 seconds"):
        Accelerator("x", 1e12, 1e12, 0.5, 0.8, -1e-6)


def test_h200_constants_and_module_imports_no_torch():
    assert (H200.peak_flops, H200.hbm_bandwidth, H200.hbm_bytes) == (989e12, 4.8e12, 141e9)
    assert H200.flops == pytest.approx(0.6 * 989e12) and H200.bandwidth == pytest.approx(0.8 * 4.8e12)
    code = "import sys, pipeline.inference.roofline; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_qwen3_4b_h200_curves_by_hand():
    """The shipped Qwen3-4B config on one H200 at 1,024 cached tokens, verify costs computed by hand:
    weights 2 x 4,022,468,096 B; KV 147,456 B per token; 8,648,523,776 FLOPs per token
    (2 x 4,022,272,000 matmul parameters + 4 x 36 x 32 x 128 x 1,024); achieved 5.934e14 FLOP/s and
    3.84e12 B/s; 200 us per forward."""
    from pipeline.inference.roofline import qwen3_4b_h200_curves
    from pipeline.inference.scheduler import adaptive_can_pay

    target = ModelShape.from_config(QWEN3_4B)
    drafter = DrafterShape.from_target(target)
    curves = qwen3_4b_h200_curves([1, 256])
    per_token = 2 * 4_022_272_000 + 4 * 36 * 32 * 128 * 1024
    assert target.flops_per_token(1024) == per_token == 8_648_523_776
    # R = 1, l = 8: memory-bound, (8,044,936,192 + 1,024 x 147,456) B / 3.84e12 B/s + 200 us = 2.3343 ms
    verify_1 = (2 * 4_022_468_096 + 1024 * 147_456) / 3.84e12 + 200e-6
    assert verify_1 == pytest.approx(2.3343e-3, rel=1e-4)
    assert verify_step_seconds(target, H200, 1, 8, 1024) == pytest.approx(verify_1)
    draft_1 = draft_step_seconds(drafter, H200, 1, 7, 1024)
    assert float(curves[1](8)) == pytest.approx(1 / (draft_1 + verify_1)) and float(curves[1](1)) == float(curves[1](8))
    # R = 256, l = 8: compute-bound, 256 x 8 x 8,648,523,776 FLOPs / 5.934e14 FLOP/s + 200 us = 30.05 ms
    verify_256 = 256 * 8 * per_token / (0.6 * 989e12) + 200e-6
    assert verify_256 == pytest.approx(30.049e-3, rel=1e-4)
    assert (2 * 4_022_468_096 + 256 * 1024 * 147_456) / 3.84e12 < verify_256 - 200e-6     # memory 12.2 ms
    assert float(curves[256](2048)) == pytest.approx(1 / (draft_step_seconds(drafter, H200, 256, 7, 1024) + verify_256))
    # the scheduler's regime: flat at R = 1 (fixed-block fallback), 1.94x spread at R = 256 (adaptive)
    assert not adaptive_can_pay(curves[1], 1, 7) and adaptive_can_pay(curves[256], 256, 7)
    assert float(curves[256](256) / curves[256](2048)) == pytest.approx(1.94, abs=0.01)


def test_scheduler_headroom_bench_sharper_estimators_gain_more_up_to_the_oracle():
    """bench/bench_scheduler_headroom.py: on the H200 model, Algorithm 1 gains with the estimator's
    separation, never past the oracle, and a near-perfect estimator comes close to it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_scheduler_headroom", REPO / "bench" / "bench_scheduler_headroom.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.headroom(bench.SERVING_RATES, [0.5, 2.0, 6.0], n_blocks=4_000, seed=1, concurrency=(16, 128))
    aucs = [r["survival_auc"] for r in rows]
    assert aucs[0] < aucs[1] < aucs[2] and 0.55 < aucs[0] < 0.7 and aucs[2] > 0.99
    assert rows[0]["per_slot_auc"] == pytest.approx(0.6382, abs=1e-4)   # Phi(0.5 / sqrt 2)
    gains = [r["ratio"][128] for r in rows]
    assert gains[0] < gains[1] < gains[2] <= rows[0]["oracle"][128] + 1e-9
    assert gains[2] > 0.97 * rows[0]["oracle"][128] and rows[0]["oracle"][128] > 1.2
    assert all(r["ratio"][16] == pytest.approx(1.0) for r in rows)   # memory-bound: the whole block
