"""ops plan: per-token FLOPs / bytes counted from the shapes, the roofline bound, the CLI (fast: no Ray, no forward)."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from cache_schema import estimate_cache_bytes
from ops.__main__ import main as ops_main
from ops.plan import (CLUSTERS, H200_8, H200_64, Cluster, DrafterRecipe, Recipe, cache_per_token, drafter_params,
                      generate_per_token, project, render_plan, plan, train_per_token)
from pipeline.inference.roofline import ModelShape
from paths import REPO

RECIPE = REPO / "conf" / "qwen3_4b.yaml"
# Qwen/Qwen3-4B config.json (the fields the plan reads, as published on the Hugging Face hub)
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True, "attention_bias": False,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960}

# ---- a tiny made-up shape, every number written out by hand ------------------------------------------
TINY = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                  vocab_size=32, tie_embeddings=True, qk_norm=True)
TINY_DRAFTER = DrafterRecipe(name="d", num_layers=1, block_size=3, markov_rank=4)
TINY_RECIPE = Recipe(target=TINY, captured_layers=2, drafters=(TINY_DRAFTER,), num_anchors=4, max_length=16,
                     max_new_tokens=8, generate_batch=2, cache_rows_per_shard=2, cache_batch_tokens=32,
                     micro_batch_samples=1, global_batch_samples=2, epochs=3)
TINY_CLUSTER = Cluster(name="tiny", gpu="toy", gpus=2, gpus_per_node=1, peak_flops=1e4, hbm_bytes_per_s=1e3,
                       hbm_bytes=1e9, h2d_bytes_per_s=100.0, network_bytes_per_s=50.0, s3_get_per_s=10,
                       s3_put_per_s=5, mfu_generate=0.5, mfu_cache=0.5, mfu_train=0.25, mbu=0.5)
# H=8, q_dim=2*4=8, kv_dim=1*4=4, I=16, V=32
LAYER = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 2 * 4 + 3 * 8 * 16 + 2 * 8  # q, k, v, o, q/k norms, MLP, 2 norms = 600
N = 2 * LAYER + 8  # 2 layers + final norm = 1208
KV_PER_TOKEN = 2 * 2 * 4 * 2  # layers x (k, v) x kv_dim x bf16 = 32
CACHE_BPT = 2 * 8 * 2 + 8 * 2 * 1.0 + 4 + 1  # features 2 layers bf16 + last_hidden + ids + mask = 53
STAGE_ROW = re.compile(r"^(generate|cache|train)\s{2,}")


def stage_rows(text: str) -> list[list[str]]:
    """The table rows of a rendered plan (the stage column is padded to 'generate')."""
    return [line.split() for line in text.splitlines() if STAGE_ROW.match(line)]


def test_tiny_shape_parameter_counts():
    assert TINY.layer_params == LAYER == 600 and TINY.non_embedding_params == N
    assert TINY.embedding_params == 32 * 8 and TINY.kv_bytes_per_token == KV_PER_TOKEN
    p = drafter_params(TINY_RECIPE, TINY_DRAFTER)
    assert p == {"layers": 600, "fc": 2 * 8 * 8, "norms": 16, "markov_w1": 32 * 4, "markov_w2": 32 * 4,
                 "head_extra": 0, "confidence": 8 + 4 + 1, "total": 600 + 128 + 16 + 128 + 128 + 13}


def test_tiny_generate_counts_by_hand():
    g = generate_per_token(TINY_RECIPE, TINY_CLUSTER)
    c = 0 + 8 / 2  # prompt_tokens + max_new_tokens / 2
    assert g["detail"]["batch"] == 2 and g["detail"]["mean_context"] == c
    assert g["flops"] == pytest.approx(2 * (N + 32 * 8) + 4 * 2 * 8 * c)  # 2(N + VH) + 4 layers q_dim c = 3184
    assert g["bytes"]["hbm"] == pytest.approx((N + 32 * 8) * 2 / 2 + KV_PER_TOKEN * (c + 1))  # 1624


def test_tiny_cache_counts_by_hand():
    k = cache_per_token(TINY_RECIPE)
    keys = (16 + 1) / 2
    assert k["flops"] == pytest.approx(2 * N + 4 * 2 * 8 * keys)  # 2960
    captured = (2 + 1) * 8 * 2  # features + final hidden, bf16, copied to the host
    assert k["bytes"]["hbm"] == pytest.approx(N * 2 / 32 + KV_PER_TOKEN * keys / 128 + 2 * captured)
    assert k["bytes"]["pcie"] == captured + 16 and k["bytes"]["network"] == pytest.approx(CACHE_BPT)
    # one shard group of 2 samples x 16 tokens: group zarr.json + 8 arrays x (zarr.json + 1 object) + commit
    assert k["requests"]["s3_put"] == pytest.approx((1 + 8 * 2 + 1) / 32)
    assert k["requests"]["s3_get"] == pytest.approx(64 / 32)  # ops.estimate.WRITE_EXTRA_PER_SHARD


def test_tiny_train_counts_by_hand():
    t = train_per_token(TINY_RECIPE, TINY_DRAFTER)
    slots = 4 * 3 / 16  # anchors x block slots / tokens
    backbone = 6 * 600 + 3.5 * 4 * 1 * 8 * (16 * (1 - 1 / 2) + 3)  # 6 P_layer + attention (fwd + bwd)
    context = 6 * 1 * 2 * 8 * 4 + 4 * 2 * 8 * 8  # K/V injection + fc
    loss = 6 * 32 * 8 + 4 * 32 * 8 + 8 * 4 * 32 + 6 * (8 + 4)  # drafter / target logits, Markov W2, confidence
    assert t["flops"] == pytest.approx(slots * backbone + context + slots * loss)  # 7262
    h2d = 2 * 2 * 8 + 2 * 8 + 9
    trainable = 1013
    hbm = 3 * trainable * 2 / 16 + 30 * trainable / 32 + slots * (5 * 32 * 8 * 2 / 512 + 240 * 32) + 2 * h2d
    assert t["bytes"]["hbm"] == pytest.approx(hbm)
    assert t["bytes"]["pcie"] == pytest.approx(h2d) and t["bytes"]["network"] == pytest.approx(CACHE_BPT)
    per_sample = 4 + (4 * 16 + 16 + 2 * 16 * 16 + 2 * 8 * 16) / (2 * 2**20)  # one GET per array + its chunks
    assert t["requests"]["s3_get"] == pytest.approx((14 + 2 * per_sample) / 32)


def test_tiny_projection_times_are_work_over_the_ceilings():
    out = project(TINY_RECIPE, TINY_CLUSTER, tokens=2e9)
    assert list(out) == ["generate", "cache", "train"]
    cache = out["cache"]["s_per_resource"]
    assert cache["compute"] == pytest.approx((2 * N + 4 * 2 * 8 * 8.5) * 1e9 / (2 * 1e4 * 0.5))
    assert cache["network"] == pytest.approx(CACHE_BPT * 1e9 / (2 * 50.0))  # 2 nodes of 1 GPU
    assert cache["s3_put"] == pytest.approx(18 / 32 * 1e9 / 5)
    for stage, row in out.items():
        assert row["s_per_1e9_tokens"] == max(row["s_per_resource"].values())
        assert row["s_per_resource"][row["bound"]] == row["s_per_1e9_tokens"]
    assert out["train"]["passes"] == 3 and out["train"]["hours"] == pytest.approx(
        out["train"]["s_per_1e9_tokens"] * 2 * 3 / 3600)


# ---- the Qwen3-4B recipe --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_recipe() -> Recipe:
    from pipeline.run import load_config

    return Recipe.from_config(load_config(RECIPE), QWEN3_4B)


def test_qwen3_4b_shapes_are_counted(qwen_recipe):
    t = qwen_recipe.target
    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 2 * 128 + 3 * 2560 * 9728 + 2 * 2560
    assert t.non_embedding_params == 36 * layer + 2560
    # the model card: 4.0B parameters, 3.6B non-embedding
    assert abs(t.non_embedding_params / 3.6e9 - 1) < 0.02
    assert abs((t.non_embedding_params + t.embedding_params) / 4.0e9 - 1) < 0.02
    (d,) = qwen_recipe.drafters
    assert (d.num_layers, d.block_size, d.markov_rank) == (5, 7, 256)
    assert (qwen_recipe.num_anchors, qwen_recipe.captured_layers, qwen_recipe.max_length) == (512, 5, 4096)
    assert train_per_token(qwen_recipe, d)["detail"]["backbone_slots_per_token"] == 512 * 7 / 4096


def test_qwen3_4b_cache_bytes_per_token_is_the_cache_contracts(qwen_recipe):
    contract = estimate_cache_bytes(10**6, hidden_size=2560, num_target_layers=5, feature_dtype="bf16",
                                    supervised_fraction=1.0).bytes_per_token
    assert contract == 5 * 2560 * 2 + 2560 * 2 + 4 + 1 == 30_725
    k = cache_per_token(qwen_recipe)
    assert k["bytes"]["network"] == contract
    assert train_per_token(qwen_recipe, qwen_recipe.drafters[0])["bytes"]["network"] == contract
    half = cache_per_token(replace(qwen_recipe, supervised_fraction=0.5))["bytes"]["network"]
    assert half == contract - 2560  # half the last_hidden rows


def test_the_bound_moves_to_a_scarce_resource(qwen_recipe):
    base = project(qwen_recipe, H200_8)
    assert base["generate"]["bound"] == "hbm" and base["cache"]["bound"] == "compute"
    slow_net = project(qwen_recipe, replace(H200_8, network_bytes_per_s=1e6))
    assert slow_net["cache"]["bound"] == "network" and slow_net["train"]["bound"] == "network"
    assert slow_net["cache"]["s_per_1e9_tokens"] == pytest.approx(30_725 * 1e9 / 1e6)
    # one S3 prefix caps training's reads; spread over many, the GPUs bound it again
    assert base["train"]["bound"] == "s3_get"
    assert project(qwen_recipe, replace(H200_8, s3_prefixes=64))["train"]["bound"] == "compute"
    # 8x the GPUs: the GPU-bound stages take 1/8 the time
    wide = project(qwen_recipe, H200_64)
    assert wide["cache"]["s_per_1e9_tokens"] == pytest.approx(base["cache"]["s_per_1e9_tokens"] / 8)


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="mfu_train"):
        replace(H200_8, mfu_train=0.0)
    with pytest.raises(ValueError, match="gpus"):
        replace(H200_8, gpus=0)
    with pytest.raises(ValueError, match="supervised_fraction"):
        replace(TINY_RECIPE, supervised_fraction=1.5)
    with pytest.raises(ValueError, match="lacks"):
        ModelShape.from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="target_config"):
        project(object(), H200_8)
    with pytest.raises(ValueError, match="tokens"):
        project(TINY_RECIPE, H200_8, tokens=0)


def test_render_plan_has_a_row_per_stage_and_cluster():
    text = render_plan(plan(TINY_RECIPE, [TINY_CLUSTER, replace(TINY_CLUSTER, name="tiny2")]))
    for name in ("tiny:", "tiny2:"):
        assert name in text
    assert [r[0] for r in stage_rows(text)] == ["generate", "cache", "train"] * 2 * 2  # 2 tables per cluster


# ---- the CLI ------------------------------------------------------------------------------------------------

@pytest.fixture
def target_config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_4B))
    return path


def test_ops_plan_prints_a_row_per_stage(target_config, capsys):
    assert ops_main(["plan", str(RECIPE), "--target-config", str(target_config), "--cluster", "8xH200",
                     "--cluster", "64xH200", "--tokens", "2e9"]) == 0
    out = capsys.readouterr().out
    assert "8xH200:" in out and "64xH200:" in out and "30,725.0" in out
    rows = stage_rows(out)
    assert [r[0] for r in rows] == ["generate", "cache", "train"] * 4  # main and per-resource tables, 2 clusters
    assert {r[-1] for r in rows[:3]} <= {"compute", "hbm", "pcie", "network", "s3_put", "s3_get"}


def test_ops_plan_json_parses(target_config, capsys):
    assert ops_main(["plan", "--config", str(RECIPE), "--target-config", str(target_config), "--json",
                     "--cluster", "8xH200"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert list(p["clusters"]) == ["8xH200"] and p["target_config"] == str(target_config)
    stages = p["clusters"]["8xH200"]["stages"]
    assert set(stages) == {"generate", "cache", "train"}
    for row in stages.values():
        assert {"flops_per_token", "bytes_per_token", "s_per_1e9_tokens", "bound", "hours"} <= set(row)
    assert stages["cache"]["bytes_per_token"]["network"] == 30_725


def test_ops_plan_reads_config_json_from_a_local_target_folder(target_config, capsys):
    assert ops_main(["plan", str(RECIPE), f"target.path={target_config.parent}", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert set(p["clusters"]) == set(CLUSTERS) and p["target_config"] == str(target_config.parent / "config.json")


def test_ops_plan_without_a_target_config_is_a_usage_error(tmp_path, capsys):
    assert ops_main(["plan", str(RECIPE)]) == 2  # target.path Qwen/Qwen3-4B is a hub id, not a local folder
    assert "--target-config" in capsys.readouterr().err
    assert ops_main(["plan", str(RECIPE), "--target-config", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the target config" in capsys.readouterr().err
    assert ops_main(["plan", "train.epochs=2"]) == 2  # no config file
    assert "give the run's config file" in capsys.readouterr().err


def test_ops_plan_refuses_out_of_range_numbers(target_config, capsys):
    assert ops_main(["plan", str(RECIPE), "--target-config", str(target_config), "--tokens", "0"]) == 2
    assert ops_main(["plan", str(RECIPE), "--target-config", str(target_config), "--supervised-fraction", "2"]) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ops_main(["plan", str(RECIPE), "--cluster", "1xA100"])
    assert exc.value.code == 2
