"""The EAGLE-3 drafter: training-time test equals autoregressive drafting, config checks, learning, paired eval."""
from __future__ import annotations

import math

import pytest
import torch

from training.blocks import build_blocks, collate_samples
from training.block_eval import summarise
from training.block_runner import evaluate_blocks
from training.drafter import DrafterConfig, new_drafter
from training.eagle3 import Eagle3Drafter
from training.losses import LossConfig

LAYER_IDS = (0, 1, 2)
MASK = 511


@pytest.fixture(scope="module")
def samples3(cache_samples_of):
    """Two cache samples of ``tiny_qwen3`` with the features of layers 0, 1 and 2."""
    return cache_samples_of(LAYER_IDS, 3)


def _eagle3(target, **kw):
    kw = dict(dict(target_layer_ids=LAYER_IDS, mask_token_id=MASK, architecture="eagle3", num_layers=1,
                   block_size=4, markov_rank=0, confidence_head=False, num_anchors=8), **kw)
    torch.manual_seed(1)
    return new_drafter(DrafterConfig(**kw), target.config, target.model.embed_tokens.weight,
                       target.lm_head.weight)


def _autoregressive(d, features, ids, a, gamma):
    """Hidden states [gamma, H] of drafting after anchor ``a`` the way an inference engine does: a KV cache
    of the context entries (row t: features at t, token x_{t+1}) for t < a, then one entry per step, each
    step fed its previous pre-norm output and the data's next token, attending to every cached entry."""
    layer = d.layers[0]
    g = d._fuse(features[None, :a].float())[0]
    keys, values, outs = [], [], []

    def entry(tok, hid, pos):
        cos, sin = d.rotary_emb(hid[None, None], torch.tensor([[pos]]))
        q, k, v = layer.project(d.embed_tokens(torch.tensor([[tok]])), hid[None, None], cos, sin)
        keys.append(k)
        values.append(v)
        K, V = torch.cat(keys, 2), torch.cat(values, 2)
        rep = q.shape[1] // K.shape[1]
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        att = torch.softmax((q @ K.transpose(-1, -2)) * layer.head_dim ** -0.5, -1)
        return layer.finish(att @ V, hid[None, None])[0, 0]

    for t in range(a):
        hid = entry(int(ids[t + 1]), g[t], t)
    outs.append(hid)
    for k in range(1, gamma):
        hid = entry(int(ids[a + k]), hid, a - 1 + k)
        outs.append(hid)
    return d.norm(torch.stack(outs))


def test_config_refuses_what_eagle3_is_not():
    base = dict(target_layer_ids=LAYER_IDS, mask_token_id=MASK, architecture="eagle3", num_layers=1,
                markov_rank=0, confidence_head=False)
    DrafterConfig(**base)
    for bad in (dict(num_layers=2), dict(sample_from_anchor=False), dict(markov_rank=8),
                dict(confidence_head=True), dict(target_layer_ids=(0, 2)), dict(init="target")):
        with pytest.raises(ValueError, match="eagle3 drafter"):
            DrafterConfig(**{**base, **bad})
    with pytest.raises(ValueError, match="architecture must be one of"):
        DrafterConfig(**{**base, "architecture": "medusa"})
    assert DrafterConfig(**{**base, "target_layer_ids": (1, 9, 17, 25, 33)}).eagle3_layer_ids == (1, 17, 33)


def test_parameter_names_are_vllm_eagle3s(tiny_qwen3):
    d = _eagle3(tiny_qwen3)
    assert isinstance(d, Eagle3Drafter)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    assert shapes == {
        "fc.weight": (64, 192), "norm.weight": (64,), "embed_tokens.weight": (512, 64), "lm_head.weight": (512, 64),
        "layers.0.self_attn.q_proj.weight": (64, 128), "layers.0.self_attn.k_proj.weight": (32, 128),
        "layers.0.self_attn.v_proj.weight": (32, 128), "layers.0.self_attn.o_proj.weight": (64, 64),
        "layers.0.mlp.gate_proj.weight": (128, 64), "layers.0.mlp.up_proj.weight": (128, 64),
        "layers.0.mlp.down_proj.weight": (64, 128), "layers.0.input_layernorm.weight": (64,),
        "layers.0.hidden_norm.weight": (64,), "layers.0.post_attention_layernorm.weight": (64,)}
    assert not d.lm_head.weight.requires_grad and not d.embed_tokens.weight.requires_grad
    assert {id(p) for p in d.muon_parameters()} == {id(d.fc.weight)} | {
        id(p) for p in d.layers.parameters() if p.ndim == 2}


def test_training_time_test_equals_autoregressive_drafting(tiny_qwen3, samples3):
    """Every slot of the batched forward (step 1 causal over all rows, steps 2..gamma at the anchors) equals
    drafting the block one entry at a time with a KV cache, at anchors near the start, middle and end."""
    d = _eagle3(tiny_qwen3).eval()
    with torch.no_grad():  # non-trivial norms, so a wrong norm placement shows
        for n in (d.norm, d.layers[0].hidden_norm, d.layers[0].input_layernorm):
            n.weight.uniform_(0.5, 1.5)
    batch = collate_samples(samples3)
    anchors = torch.tensor([[6, 20, 35], [13, 22, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=4, sample_from_anchor=True,
                          mask_token_id=MASK)
    with torch.no_grad():
        slots = d(batch, blocks)
    checked = 0
    for b in range(2):
        for n in range(3):
            if not keep[b, n]:
                continue
            a = int(anchors[b, n])
            rows = slots.block == b * 3 + n
            k = int(rows.sum())
            assert k == int(blocks.valid[b, n].sum()) >= 1
            with torch.no_grad():
                want = _autoregressive(d, batch.features[b], batch.input_ids[b], a, k)
            assert torch.allclose(slots.hidden[rows], want, atol=1e-5), (b, a)
            checked += k
    assert checked >= 15
    assert slots.labels[slots.block == 1].tolist() == batch.input_ids[0, 21:25].tolist()


def test_the_loss_trains_every_step_and_learns(tiny_qwen3, samples3):
    d = _eagle3(tiny_qwen3)
    batch = collate_samples(samples3)
    blocks = d.make_blocks(batch, torch.Generator().manual_seed(0))
    cfg = LossConfig(decay_lambda=-1 / math.log(0.8))
    out = d.loss(d(batch, blocks), cfg)
    out.loss.backward()
    layer = d.layers[0]
    for p in (d.fc.weight, layer.self_attn.q_proj.weight, layer.hidden_norm.weight, layer.mlp.down_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    # a later step's loss reaches step 1's weights only through the fed-back output: its gradient is non-zero
    d.zero_grad()
    slots = d(batch, blocks)
    later = slots.slot == 3
    (slots.hidden[later] ** 2).sum().backward()
    assert d.fc.weight.grad.abs().sum() > 0
    opt = torch.optim.AdamW(d.trainable_parameters(), lr=3e-3)
    seen = []
    for _ in range(40):
        opt.zero_grad()
        out = d.loss(d(batch, blocks), cfg)
        out.loss.backward()
        opt.step()
        seen.append((float(out.metrics["loss"]), float(out.metrics["tau_expected"])))
    assert seen[-1][0] < 0.9 * seen[0][0] and seen[-1][1] > seen[0][1] + 0.3  # measured: 0.791 -> 0.654, 4.11 -> 4.53


def test_paired_block_evaluation_beside_dspark(tiny_qwen3, samples3):
    """EAGLE-3 runs in the paired block-level evaluation beside a DSpark drafter on the same blocks: same
    block count, and an identical copy of it ties exactly (same uniforms)."""
    from training.drafter import Drafter

    e3 = _eagle3(tiny_qwen3)
    twin = _eagle3(tiny_qwen3)
    twin.load_state_dict(e3.state_dict())
    ds = Drafter(DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=1, block_size=4,
                               markov_rank=8), tiny_qwen3.config, tiny_qwen3.model.embed_tokens.weight,
                 tiny_qwen3.lm_head.weight)
    tally = evaluate_blocks({"eagle3": e3, "twin": twin, "dspark": ds}, [samples3], temperatures=[0.0, 1.0],
                            num_anchors=8)
    s = summarise(tally, pairs=[("eagle3", "dspark"), ("eagle3", "twin")])  # raises unless the blocks are the same
    for T in s["temperatures"]:
        e, dsp = s["drafters"]["eagle3"][T], s["drafters"]["dspark"][T]
        assert e["n"] == dsp["n"] >= 10
        assert 1.0 <= e["tau"] <= 5.0 and e["tau"] == s["drafters"]["twin"][T]["tau"]
        assert s["pairs"][("eagle3", "twin")][T]["ratio"] == 1.0 and s["pairs"][("eagle3", "twin")][T]["se"] == 0.0
        assert math.isfinite(s["pairs"][("eagle3", "dspark")][T]["se"])


def test_decoding_loop_drafts_as_the_training_forward_and_stays_lossless(tiny_qwen3, samples3):
    """draft_block on a context built in two chunks drafts what the KV-cached reference gives for the tokens it
    drew (T = 0 and T = 1), commits the context rows once; greedy speculative decoding with it equals the
    target's greedy decoding."""
    from pipeline.inference.speculate import plain_decode, speculative_decode
    from pipeline.target_model.prefill import LayerTap

    d = _eagle3(tiny_qwen3).eval()
    feats, ids, a = samples3[0]["features"], samples3[0]["input_ids"].long(), 20
    for T in (0.0, 1.0):
        ctx = d.encode_context(feats[:7].float(), tokens=ids[1:7])
        ctx = d.encode_context(feats[7:a].float(), ctx, tokens=ids[7:a])
        assert ctx.length == a and ctx.keys is None and ctx.pending.shape[0] == a
        r = d.draft_block(ctx, int(ids[a]), T, torch.Generator().manual_seed(0))
        assert ctx.keys.shape[2] == a and ctx.pending.shape[0] == 0 and r.tokens.shape == (4,)
        drawn = torch.cat([ids[:a + 1], r.tokens])
        with torch.no_grad():
            want = torch.softmax(_autoregressive(d, feats, drawn, a, 4) @ d.lm_head.weight.t(), -1)
        if T == 0:
            assert r.tokens.tolist() == want.argmax(-1).tolist()
        else:
            assert torch.allclose(r.q, want, atol=1e-5)
        with pytest.raises(ValueError, match="waiting rows"):
            d.draft_block(ctx, 3)
    # a round that accepted 3 drafts: the context continues exactly as one built from scratch at the new anchor
    ctx = d.encode_context(feats[:a].float(), tokens=ids[1:a])
    d.draft_block(ctx, int(ids[a]))
    d.encode_context(feats[a:a + 4].float(), ctx, tokens=ids[a + 1:a + 4])
    fresh = d.encode_context(feats[:a + 4].float(), tokens=ids[1:a + 4])
    r1, r2 = d.draft_block(ctx, int(ids[a + 4]), 1.0, torch.Generator().manual_seed(1)), \
        d.draft_block(fresh, int(ids[a + 4]), 1.0, torch.Generator().manual_seed(1))
    assert torch.allclose(r1.q, r2.q, atol=1e-5) and torch.allclose(ctx.keys, fresh.keys, atol=1e-5)
    prompt = ids[:12].tolist()
    tap = LayerTap(tiny_qwen3, LAYER_IDS)
    kw = dict(max_new_tokens=24, temperature=0.0, stop_ids=set())
    ref = plain_decode(tiny_qwen3, prompt, generator=torch.Generator().manual_seed(0), **kw)
    out = speculative_decode(tiny_qwen3, d, prompt, tap=tap, generator=torch.Generator().manual_seed(0), **kw)
    assert out.tokens == ref.tokens and len(out.rounds) >= 1


def test_export_is_speculators_eagle3_and_round_trips_to_pretrained(tmp_path, tiny_target_dir, samples3):
    """Whatever export.format, an eagle3 drafter exports in the speculators eagle3 format (the keys vLLM reads,
    vLLM's tensor names and shapes); load_export and init: pretrained give back its weights and the same
    block-level tau at step 0; an eagle3 export is refused as a DFlash drafter's starting point."""
    import json

    from pipeline.drafters import build_drafter, prepare_pretrained
    from pipeline.errors import ConfigError
    from pipeline.run import DEFAULT_CONFIG, load_config
    from pipeline.stages.export_format import EAGLE3_ARCH, export_drafter, load_export
    from training.drafter import FROZEN_STATE

    def cfg(run, *extra):
        return load_config(DEFAULT_CONFIG, [f"target.path={tiny_target_dir}", f"run_dir={tmp_path / run}",
                                            "train.drafters.eagle3.block_size=4", *extra])

    c = cfg("a")
    torch.manual_seed(7)
    model = build_drafter(c.train.drafters["eagle3"], c, tiny_target_dir)
    assert isinstance(model, Eagle3Drafter) and model.config.eagle3_layer_ids == (0, 1, 2)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = export_drafter(model, tiny_target_dir, str(tmp_path / "export"), fmt="native")
    assert out["format"] == "speculators" and out["architecture"] == EAGLE3_ARCH and out["num_speculative_tokens"] == 4
    conf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["norm_before_residual"] is False
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and conf["draft_vocab_size"] == 512
    assert conf["transformer_layer_config"]["model_type"] == "llama"
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "export" / "model.safetensors")))
    assert names == {k for k in model.state_dict() if k != "embed_tokens.weight"}  # lm_head always: speculators needs it
    exported = load_export(str(tmp_path / "export"), tiny_target_dir)
    c = cfg("b", "train.drafters.eagle3.init=pretrained", f"train.drafters.eagle3.pretrained_path={tmp_path / 'export'}")
    prepare_pretrained(c, "eagle3", tiny_target_dir)
    step0 = build_drafter(c.train.drafters["eagle3"], c, tiny_target_dir).eval()
    theirs = exported.state_dict()
    ours = {k: v for k, v in step0.state_dict().items() if k not in FROZEN_STATE}
    assert all(torch.equal(v, theirs[k]) for k, v in ours.items()) and all(
        torch.equal(v, model.state_dict()[k]) for k, v in ours.items())
    tally = evaluate_blocks({"exported": exported, "step0": step0}, [samples3], temperatures=[0.0, 1.0], num_anchors=6)
    for T in (0.0, 1.0):
        a, b = tally.values("exported", T, "tau"), tally.values("step0", T, "tau")
        assert a.numel() > 6 and torch.equal(a, b)
    c = cfg("c", "train.drafters.dspark.init=pretrained", f"train.drafters.dspark.pretrained_path={tmp_path / 'export'}")
    with pytest.raises(ConfigError, match="architecture: the export has eagle3, the config says dflash"):
        prepare_pretrained(c, "dspark", tiny_target_dir)


def test_run_config_names_what_an_eagle3_drafter_needs():
    from pipeline.errors import ConfigError
    from pipeline.run import DEFAULT_CONFIG, load_config

    with pytest.raises(ConfigError, match=r"train.drafters.eagle3.architecture: eagle3 is one decoder layer.*"
                                          r"\{'num_layers': 2, 'init': 'target'\}"):
        load_config(DEFAULT_CONFIG, ["train.drafters.eagle3.num_layers=2", "train.drafters.eagle3.init=target"])
    with pytest.raises(ConfigError, match=r"target.target_layer_ids needs >= 3 ids \(got \[0, 2\]\)"):
        load_config(DEFAULT_CONFIG, ["target.target_layer_ids=[0,2]"])
    cfg = load_config(DEFAULT_CONFIG, [])
    assert cfg.train.drafters["eagle3"].architecture.value == "eagle3"


def test_block_pairs_put_eagle3_below_both_dflash_backbones(tiny_qwen3):
    from pipeline.stages.evaluate import block_pairs
    from training.drafter import Drafter

    def dflash_backbone(**kw):
        return Drafter(DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=1, **kw),
                       tiny_qwen3.config, tiny_qwen3.model.embed_tokens.weight, tiny_qwen3.lm_head.weight)

    drafters = {"dflash": dflash_backbone(markov_rank=0, sample_from_anchor=False), "dspark": dflash_backbone(markov_rank=8),
                "eagle3": _eagle3(tiny_qwen3)}
    assert block_pairs(drafters) == [("dspark", "dflash"), ("dflash", "eagle3"), ("dspark", "eagle3")]
