"""Export formats (no vLLM needed): names, shapes, dtypes and config keys vLLM 0.32, speculators 0.9,
z-lab dflash and SpecForge read; refusals; each format read back into the product's drafter."""
from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors.torch import load, load_file
from transformers import AutoConfig

from pipeline.stages.export_format import FORMATS, ExportError, check_tensors, export_drafter, expected_tensors, load_export
from training.target_weights import load_shared_weights
from training.draft_vocab import build_d2t
from training.drafter import Drafter, DrafterConfig

# vLLM Qwen3DSparkModel / DFlashDraftModel checkpoint names (issue 6), written out by hand
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
         "input_layernorm.weight", "post_attention_layernorm.weight"]
BACKBONE = {f"layers.{i}.{n}" for i in range(2) for n in LAYER} | {"fc.weight", "hidden_norm.weight", "norm.weight"}
DSPARK = BACKBONE | {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                     "confidence_head.proj.weight", "confidence_head.proj.bias"}


def _drafter(target_dir, *, seed=0, train=True, **kw) -> Drafter:
    """A drafter on the tiny target; ``train`` moves every trainable tensor off its initial value,
    as training would (deterministic)."""
    embed, lm_head = load_shared_weights(target_dir)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    args = dict(target_layer_ids=[0, 2], mask_token_id=5, num_layers=2, block_size=4, markov_rank=8)
    args.update(kw)
    d2t = None
    if args.get("draft_vocab_size"):
        d2t = build_d2t(torch.arange(tc.vocab_size).flip(0), args["draft_vocab_size"])
    torch.manual_seed(seed)
    model = Drafter(DrafterConfig(**args), tc, embed, lm_head, d2t)
    if train:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.trainable_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model.eval()


def _export(model, target_dir, out: Path, **kw):
    info = export_drafter(model, target_dir, str(out), **kw)
    return info, json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def test_dspark_export_names_shapes_dtypes_and_config(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir)
    info, cfg, t = _export(model, tiny_target_dir, tmp_path / "dspark", temperatures=[1.0, 1.5, 2.0, 0.8],
                           fold_tolerance=0.02)
    assert set(t) == DSPARK                                  # no model. prefix, no embed_tokens/lm_head/d2t
    assert t["fc.weight"].shape == (64, 128) and t["layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert t["layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert t["markov_head.markov_w1.weight"].shape == (512, 8) and t["markov_head.markov_w2.weight"].shape == (512, 8)
    assert t["confidence_head.proj.weight"].shape == (1, 72) and t["confidence_head.proj.bias"].shape == (1,)
    assert {v.dtype for v in t.values()} == {torch.float32}
    state = model.state_dict()
    assert all(torch.equal(t[k], state[k]) for k in t)     # temperatures spread 2.5x: nothing folded
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 4 and cfg["hidden_size"] == 64
    assert cfg["target_layer_ids"] == [0, 2]                 # DeepSpec ids as trained; vLLM adds 1
    assert (cfg["mask_token_id"], cfg["markov_rank"], cfg["block_size"]) == (5, 8, 4)
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is True and cfg["tie_word_embeddings"] is False
    assert cfg["confidence_temperatures"] == [1.0, 1.5, 2.0, 0.8] and cfg["confidence_temperature_folded"] is None
    assert "quantization_config" not in cfg and "layer_types" not in cfg
    # SpecForge reads the DSpark keys from dflash_config, with projector_type; sample_from_anchor stays out
    # of it: vLLM's DFlash speculator, which its DSpark one extends, refuses it there at engine start
    assert cfg["dflash_config"] == {
        "mask_token_id": 5, "target_layer_ids": [0, 2], "markov_rank": 8,
        "enable_confidence_head": True, "confidence_head_with_markov": True, "block_size": 4,
        "projector_type": "dspark", "attention_mode": "gqa"}
    assert info["num_speculative_tokens"] == 4 and info["block_size"] == 4   # [anchor, mask x 3]: 4 drafts
    assert cfg["enable_thinking"] is None and info["enable_thinking"] is None  # the template's default mode
    assert info["confidence"] == "config" and info["num_tensors"] == len(DSPARK) and info["dropped"] == []
    assert {k: v[0] for k, v in expected_tensors(cfg).items()} == {k: tuple(v.shape) for k, v in t.items()}


def test_dflash_export_drops_confidence_head(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir, markov_rank=0, sample_from_anchor=False, block_size=3)
    info, cfg, t = _export(model, tiny_target_dir, tmp_path / "dflash")
    assert set(t) == BACKBONE
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 2], "sample_from_anchor": False}
    # block_size counts the slots, anchor included ([anchor, mask x 3]): every tool drafts 3 from it
    assert cfg["block_size"] == 4 and info["num_speculative_tokens"] == 3
    assert "markov_rank" not in cfg and "confidence_temperatures" not in cfg
    assert info["dropped"] == ["confidence_head.proj.weight", "confidence_head.proj.bias"]
    assert info["confidence"] == "none"


def test_reduced_vocabulary_ships_lm_head_d2t_and_t2d(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir, draft_vocab_size=100)
    _, cfg, t = _export(model, tiny_target_dir, tmp_path / "reduced")
    assert set(t) == DSPARK | {"lm_head.weight", "d2t", "t2d"}
    drafted = torch.arange(100) + t["d2t"]                   # the 100 draft ids' target ids
    assert t["t2d"].dtype == torch.bool and t["t2d"].shape == (512,) and int(t["t2d"].sum()) == 100
    assert t["t2d"][drafted].all() and torch.equal(t["t2d"].nonzero().flatten(), drafted)
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 512
    assert t["d2t"].dtype == torch.int64 and t["lm_head.weight"].shape == (100, 64)
    assert t["markov_head.markov_w1.weight"].shape == (512, 8) and t["markov_head.markov_w2.weight"].shape == (100, 8)
    _, lm_head = load_shared_weights(tiny_target_dir)
    assert torch.equal(t["lm_head.weight"], lm_head[drafted])


def test_global_temperature_folds_exactly_and_keeps_per_position_temperatures(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir)
    T_k, T = [0.8, 1.6, 2.4, 3.1], 1.7                    # spread 4x: the global T still folds
    info, cfg, t = _export(model, tiny_target_dir, tmp_path / "g", temperatures=T_k, global_temperature=T,
                           fold_tolerance=0.02)
    assert info["confidence"] == "folded" and info["folded_temperature"] == cfg["confidence_temperature_folded"] == T
    assert cfg["confidence_temperatures"] == pytest.approx([x / T for x in T_k])
    x = torch.randn(64, 72, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    exported = torch.sigmoid(x @ t["confidence_head.proj.weight"].double().t() + t["confidence_head.proj.bias"].double())
    head = model.confidence_head.proj
    trained = x @ head.weight.detach().double().t() + head.bias.detach().double()
    assert float((exported - torch.sigmoid(trained / T)).abs().max()) < 1e-6       # vLLM's raw sigmoid
    residual = torch.tensor(cfg["confidence_temperatures"], dtype=torch.float64)
    z_folded = x @ t["confidence_head.proj.weight"].double().t() + t["confidence_head.proj.bias"].double()
    assert float((torch.sigmoid(z_folded / residual) - torch.sigmoid(trained / torch.tensor(T_k, dtype=torch.float64))
                  ).abs().max()) < 1e-6                                         # runtimes reading the key


def test_equal_temperatures_fold_into_the_head(tiny_target_dir):
    model = _drafter(tiny_target_dir)
    info = export_drafter(model, tiny_target_dir, "memory://export-fold", temperatures=[1.5, 1.51, 1.49, 1.5],
                          fold_tolerance=0.02)
    fs = fsspec.filesystem("memory")
    cfg = json.loads(fs.cat_file("/export-fold/config.json"))
    t = load(fs.cat_file("/export-fold/model.safetensors"))
    T = (1.5 * 1.51 * 1.49 * 1.5) ** 0.25
    assert info["confidence"] == "folded" and info["folded_temperature"] == pytest.approx(T)
    assert cfg["confidence_temperature_folded"] == pytest.approx(T)
    assert cfg["confidence_temperatures"] == pytest.approx([1.5 / T, 1.51 / T, 1.49 / T, 1.5 / T])
    x = torch.randn(10, 72, generator=torch.Generator().manual_seed(3))
    raw = x @ t["confidence_head.proj.weight"].t() + t["confidence_head.proj.bias"]
    trained = model.confidence_head.proj(x).detach()
    torch.testing.assert_close(torch.sigmoid(raw), torch.sigmoid(trained / T))  # vLLM's raw sigmoid is calibrated


def test_refuses_missing_nan_and_untrained_tensors(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir)
    info, cfg, t = _export(model, tiny_target_dir, tmp_path / "ok")
    expected = expected_tensors(cfg)
    missing = {k: v for k, v in t.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(ExportError, match=r"missing layers\.1\.mlp\.up_proj\.weight"):
        check_tensors(missing, expected)
    nan = dict(t, **{"fc.weight": t["fc.weight"].clone().index_fill_(0, torch.tensor([3]), float("nan"))})
    with pytest.raises(ExportError, match=r"fc\.weight holds NaN"):
        check_tensors(nan, expected)
    with pytest.raises(ExportError, match=r"unexpected markov_head\.gate_proj\.weight"):
        check_tensors(dict(t, **{"markov_head.gate_proj.weight": torch.ones(8, 80)}), expected)
    with pytest.raises(ExportError, match=r"fc\.weight is \(64, 64\)"):
        check_tensors(dict(t, **{"fc.weight": torch.ones(64, 64)}), expected)
    check_tensors(t, expected)                                  # the complete export passes
    # untrained: init constants (norms 1, markov_w2 0, bias 0), and a tensor equal to a fresh same-seed init
    fresh = _drafter(tiny_target_dir, train=False)
    with pytest.raises(ExportError, match=r"norm\.weight still holds its initial value") as err:
        export_drafter(fresh, tiny_target_dir, str(tmp_path / "fresh"))
    assert "markov_head.markov_w2.weight still holds" in str(err.value)
    assert "fc.weight" not in str(err.value)                    # random init: only caught against `initial`
    assert not (tmp_path / "fresh").exists()                    # nothing written on refusal
    half = _drafter(tiny_target_dir)
    half.fc.weight.data.copy_(fresh.fc.weight.data)
    with pytest.raises(ExportError, match=r"fc\.weight still holds its initial value") as err:
        export_drafter(half, tiny_target_dir, str(tmp_path / "half"), initial=fresh.state_dict())
    assert str(err.value).count("still holds") == 1


def test_refuses_drafters_vllm_cannot_serve(tiny_target_dir, tmp_path):
    with pytest.raises(ExportError, match="only the vanilla Markov head"):
        export_drafter(_drafter(tiny_target_dir, head_type="gated"), tiny_target_dir, str(tmp_path / "g"))
    with pytest.raises(ExportError, match="retrain it with sample_from_anchor=false"):
        export_drafter(_drafter(tiny_target_dir, markov_rank=0), tiny_target_dir, str(tmp_path / "d"))
    with pytest.raises(ExportError, match="3 temperatures for block size 4"):
        export_drafter(_drafter(tiny_target_dir), tiny_target_dir, str(tmp_path / "t"), temperatures=[1, 1, 1])


def test_speculators_format_config(tiny_target_dir, tmp_path):
    model = _drafter(tiny_target_dir, draft_vocab_size=100)
    info, cfg, t = _export(model, tiny_target_dir, tmp_path / "spec", fmt="speculators", verifier="org/target",
                           temperatures=[1.0, 1.5, 2.0, 0.8])
    assert set(t) == DSPARK | {"lm_head.weight", "d2t", "t2d"} and info["format"] == "speculators"
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    assert cfg["speculators_config"] == {
        "algorithm": "dspark", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
        "verifier": {"name_or_path": "org/target", "architectures": ["Qwen3ForCausalLM"]}}
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3]           # speculators counts the embedding as 0
    assert (cfg["block_size"], cfg["sample_from_anchor"], cfg["draft_vocab_size"]) == (4, True, 100)
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["mask_token_id"]) == (8, "vanilla", 5)
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 512
    assert "target_layer_ids" not in cfg and "dflash_config" not in cfg
    assert cfg["sliding_window_non_causal"] is True      # vLLM: causal = not this, for every layer
    assert cfg["confidence_temperatures"] == [1.0, 1.5, 2.0, 0.8]
    dflash = _drafter(tiny_target_dir, markov_rank=0, sample_from_anchor=False, block_size=3)
    _, dcfg, _ = _export(dflash, tiny_target_dir, tmp_path / "spec-dflash", fmt="speculators")
    assert dcfg["speculators_model_type"] == "dflash" and dcfg["block_size"] == 4
    assert dcfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert dcfg["draft_vocab_size"] == 512 and "markov_rank" not in dcfg
    with pytest.raises(ExportError, match=r"export.format='eagle' is not one of \['native', 'speculators'\]"):
        export_drafter(dflash, tiny_target_dir, str(tmp_path / "x"), fmt="eagle")


def _draft(model, features):
    """One block at T = 1 after 20 context positions: (tokens, q [gamma, V], confidence logits)."""
    r = model.draft_block(model.encode_context(features), 7, 1.0, torch.Generator().manual_seed(3))
    return r.tokens, r.q, r.confidence_logits


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_back_as_the_trained_drafter(tiny_target_dir, tmp_path, fmt):
    """Round trip: export -> load_export gives the same tensors and the same drafts (|diff| 0)."""
    features = torch.randn(20, 128, generator=torch.Generator().manual_seed(7))
    variants = {"dspark": {}, "dspark-reduced": {"draft_vocab_size": 100},
                "dflash": {"markov_rank": 0, "sample_from_anchor": False, "block_size": 3},
                "dflash-reduced": {"markov_rank": 0, "sample_from_anchor": False, "block_size": 3,
                                   "draft_vocab_size": 100}}
    for name, kw in variants.items():
        model = _drafter(tiny_target_dir, **kw)
        export_drafter(model, tiny_target_dir, str(tmp_path / name), fmt=fmt)
        back = load_export(str(tmp_path / name), str(tiny_target_dir))
        assert back.config.block_size == model.config.block_size and back.config.slots == model.config.slots
        mine, theirs = model.state_dict(), back.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name   # every tensor the export holds
        (tok, q, conf), (tok2, q2, conf2) = _draft(model, features), _draft(back, features)
        assert torch.equal(tok, tok2) and float((q - q2).abs().max()) == 0.0, name   # same drafts, |diff| 0
        if kw.get("markov_rank", 8):                   # DFlash exports drop the confidence head
            assert torch.equal(conf, conf2), name
