"""The drafter model: parameter names, train/inference agreement, no leak, gradients, draft vocab."""
from __future__ import annotations

import pytest
import torch

from training.blocks import build_blocks, collate_samples
from training.draft_vocab import build_d2t, count_supervised_tokens, draft_to_target_ids
from training.drafter import Drafter, DrafterConfig
from training.losses import LossConfig

LAYER_IDS = (0, 2)
MASK = 511




def _drafter(target, d2t=None, **kw):
    kw = dict(dict(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=2, block_size=4,
                   markov_rank=8, num_anchors=16), **kw)
    torch.manual_seed(1)
    d = Drafter(DrafterConfig(**kw), target.config, target.model.embed_tokens.weight, target.lm_head.weight,
                d2t=d2t)
    if d.markov_head is not None:  # a non-zero Markov bias, so the head matters in every test
        torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=0.5)
    return d


def _blocks(d, batch, anchors):
    anchors = torch.tensor(anchors)
    return build_blocks(batch.input_ids, batch.loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool),
                        block_size=d.config.block_size, sample_from_anchor=d.config.sample_from_anchor,
                        mask_token_id=MASK)


def test_parameter_names_and_shapes_map_to_vllm(tiny_qwen3):
    d = _drafter(tiny_qwen3, num_layers=1)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items()}
    layer = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"} | {
        f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert set(shapes) == layer | {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight",
                                   "lm_head.weight", "markov_head.markov_w1.weight",
                                   "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                                   "confidence_head.proj.bias"}
    assert shapes["fc.weight"] == (64, 128) and shapes["layers.0.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["markov_head.markov_w1.weight"] == (512, 8)
    assert shapes["markov_head.markov_w2.weight"] == (512, 8)
    assert shapes["confidence_head.proj.weight"] == (1, 72)
    trainable = d.trainable_parameters()
    assert all(p.requires_grad for p in trainable)
    assert sum(p.numel() for p in trainable) == sum(p.numel() for p in d.parameters()) - 2 * 512 * 64
    assert d.embed_tokens.weight.data_ptr() == tiny_qwen3.model.embed_tokens.weight.data_ptr()
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_training_forward_equals_inference_draft(tiny_qwen3, drafter_samples, sample_from_anchor):
    d = _drafter(tiny_qwen3, markov_rank=0, sample_from_anchor=sample_from_anchor).eval()
    batch = collate_samples(drafter_samples[:1])
    a = 20
    slots = d(batch, _blocks(d, batch, [[a, a + 2, 9]]))
    rows = slots.block == 0
    assert slots.slot[rows].tolist() == [0, 1, 2, 3]
    p_train = torch.softmax(slots.hidden[rows] @ d.lm_head.weight.t(), -1)
    feats = batch.features[0]
    ctx = d.encode_context(feats[7:a], d.encode_context(feats[:7]))
    whole = d.encode_context(feats[:a])
    assert ctx.length == a and torch.allclose(ctx.keys[1], whole.keys[1], atol=1e-6)
    r = d.draft_block(ctx, batch.input_ids[0, a], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert r.tokens.shape == (4,) and r.q.shape == (4, 512)
    assert torch.allclose(r.q, p_train, atol=1e-5)
    assert torch.allclose(r.confidence_logits, slots.confidence_logits[rows], atol=1e-5)


def test_block_sees_nothing_at_or_after_its_anchor_nor_other_blocks(tiny_qwen3, drafter_samples):
    d = _drafter(tiny_qwen3, head_type="rnn")
    batch = collate_samples(drafter_samples[:1])
    a0 = 15
    h = d(batch, _blocks(d, batch, [[a0, a0 + 1]])).hidden
    batch.features[0, a0:] = torch.randn_like(batch.features[0, a0:])
    batch.input_ids[0, a0 + 1] = 3  # the anchor token of the overlapping block 1
    h2 = d(batch, _blocks(d, batch, [[a0, a0 + 1]])).hidden
    assert torch.allclose(h[:4], h2[:4], atol=1e-6)  # block 0 (4 valid slots) is untouched
    assert not torch.allclose(h[4:], h2[4:], atol=1e-3)  # block 1 did change


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_equals_dense_sdpa(tiny_qwen3, drafter_samples):
    batch = collate_samples(drafter_samples)
    sdpa, flex = _drafter(tiny_qwen3, attention="sdpa"), _drafter(tiny_qwen3, attention="flex")
    blocks = sdpa.make_blocks(batch, torch.Generator().manual_seed(0))
    with torch.no_grad():  # flex attention has no backward on CPU (eager, unfused)
        assert torch.allclose(sdpa(batch, blocks).hidden, flex(batch, blocks).hidden, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_training_step_equals_sdpa_on_gpu(tiny_qwen3, drafter_samples):
    """flex on CUDA against the sdpa reference on the CPU (sdpa with a mask is refused on CUDA:
    ``training.drafter.resolve_attention``); the same blocks, drawn on the CPU, for both."""
    from training.data import to_device

    batch = collate_samples(drafter_samples)
    grads = []
    for attention, device in (("sdpa", "cpu"), ("flex", "cuda")):
        d = _drafter(tiny_qwen3, attention=attention).to(device)
        blocks = d.make_blocks(batch, torch.Generator().manual_seed(0))
        out = d.loss(d(to_device(batch, torch.device(device)), to_device(blocks, torch.device(device))), LossConfig())
        out.loss.backward()
        grads.append((out.loss.detach().cpu(), d.layers[0].self_attn.q_proj.weight.grad.cpu()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-4, rtol=1e-3)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("to_backbone", [False, True])
def test_confidence_gradient_into_backbone_is_a_config_value(tiny_qwen3, drafter_samples, to_backbone):
    d = _drafter(tiny_qwen3, confidence_grad_to_backbone=to_backbone)
    batch = collate_samples(drafter_samples)
    slots = d(batch, d.make_blocks(batch, torch.Generator().manual_seed(0)))
    d.loss(slots, LossConfig(ce_weight=0.0, tv_weight=0.0, confidence_weight=1.0)).loss.backward()
    assert torch.count_nonzero(d.confidence_head.proj.weight.grad) == 72
    for name, p in d.named_parameters():
        if p.requires_grad and not name.startswith("confidence_head"):
            reached = p.grad is not None and bool(torch.count_nonzero(p.grad))
            if name.startswith(("layers.", "fc.", "markov_head.markov_w1")):
                assert reached == to_backbone, name
            else:  # norms and W2 only reach the loss through p_d, which c* is detached from
                assert not reached or to_backbone, name


def test_loss_with_all_supervision_masked_is_finite_with_zero_gradient(tiny_qwen3, drafter_samples):
    d = _drafter(tiny_qwen3, head_type="gated")
    s = dict(drafter_samples[0], loss_mask=torch.zeros(40, dtype=torch.uint8), last_hidden=torch.zeros(0, 64))
    batch = collate_samples([s])
    slots = d(batch, d.make_blocks(batch))
    assert slots.hidden.shape == (0, 64)
    out = d.loss(slots, LossConfig())
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in d.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_greedy_draft_is_one_hot_and_reproducible(tiny_qwen3, drafter_samples):
    d = _drafter(tiny_qwen3).eval()
    ctx = d.encode_context(drafter_samples[0]["features"][:12])
    r = d.draft_block(ctx, 7, temperature=0.0)
    assert torch.equal(r.q.sum(-1), torch.ones(4)) and torch.equal(r.q.argmax(-1), r.tokens)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(d.draft_block(ctx, 7, 0.8, g1).tokens, d.draft_block(ctx, 7, 0.8, g2).tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafted_blocks_carry_the_confidence_heads_exact_inputs(tiny_qwen3, drafter_samples, temperature):
    """``DraftResult.confidence_input`` is ``[h_k ; W1[x_{k-1}]]`` with the drafted previous tokens (the
    anchor first): the head on it gives the block's confidence logits (what the on-policy refit fits)."""
    d = _drafter(tiny_qwen3).eval()
    ctx = d.encode_context(drafter_samples[0]["features"][:12])
    r = d.draft_block(ctx, 7, temperature, torch.Generator().manual_seed(3))
    H = tiny_qwen3.config.hidden_size
    assert r.confidence_input.shape == (4, H + 8)
    prev = torch.cat([torch.tensor([7]), r.tokens[:-1]])
    assert torch.equal(r.confidence_input[:, H:], d.markov_head.embed(prev))
    assert torch.allclose(d.confidence_head(r.confidence_input, None), r.confidence_logits, atol=1e-6)
    plain = _drafter(tiny_qwen3, markov_rank=0).eval()
    assert plain.draft_block(ctx, 7, temperature, torch.Generator().manual_seed(3)).confidence_input.shape == (4, H)


def test_reduced_draft_vocabulary_is_fixed_across_resume(tiny_qwen3, drafter_samples):
    counts = count_supervised_tokens(((s["input_ids"], s["loss_mask"]) for s in drafter_samples), 512)
    d2t = build_d2t(counts, 32)
    d = _drafter(tiny_qwen3, d2t=d2t, draft_vocab_size=32)
    ids = draft_to_target_ids(d2t)
    assert torch.equal(d.lm_head.weight, tiny_qwen3.lm_head.weight[ids])
    assert torch.equal(d.state_dict()["d2t"], d2t)
    r = d.draft_block(d.encode_context(drafter_samples[0]["features"][:12]), 7, 1.0, torch.Generator().manual_seed(0))
    outside = torch.ones(512, dtype=torch.bool)
    outside[ids] = False
    assert torch.count_nonzero(r.q[:, outside]) == 0 and set(r.tokens.tolist()) <= set(ids.tolist())
    assert torch.allclose(r.q.sum(-1), torch.ones(4))
    batch = collate_samples(drafter_samples)
    out = d.loss(d(batch, d.make_blocks(batch)), LossConfig())
    assert torch.isfinite(out.loss)
    d.load_state_dict(d.state_dict())  # same d2t: fine
    other = dict(d.state_dict(), d2t=build_d2t(counts.flip(0), 32))
    with pytest.raises(ValueError, match="d2t"):
        d.load_state_dict(other)


def test_invalid_configs_are_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="ascending"):
        DrafterConfig(target_layer_ids=(2, 0), mask_token_id=MASK)
    with pytest.raises(ValueError, match="head_type"):
        DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, head_type="lstm")
    with pytest.raises(ValueError, match="<= 2"):
        _drafter(tiny_qwen3, target_layer_ids=(0, 3))
    with pytest.raises(ValueError, match="mask_token_id"):
        Drafter(DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=512), tiny_qwen3.config,
                tiny_qwen3.model.embed_tokens.weight, tiny_qwen3.lm_head.weight)
    with pytest.raises(ValueError, match="d2t"):
        _drafter(tiny_qwen3, draft_vocab_size=32)


def test_block_runner_closed_form_equals_the_training_c_star(tiny_qwen3, drafter_samples):
    """The block-level evaluator's logits are the drafter's own: its closed-form tau at T=1 equals
    the loss's ``tau_expected`` on the same anchors; paired drafters share the blocks."""
    from training.block_eval import summarise
    from training.block_runner import evaluate_blocks
    from training.blocks import sample_anchors

    drafters = {"dspark": _drafter(tiny_qwen3).eval(),
                "dflash": _drafter(tiny_qwen3, markov_rank=0, sample_from_anchor=False, block_size=6).eval(),
                "control": _drafter(tiny_qwen3, head_type="control").eval()}
    tally = evaluate_blocks(drafters, [drafter_samples], temperatures=[0.0, 1.0], num_anchors=16, seed=3)
    summary = summarise(tally, pairs=[("dspark", "dflash"), ("dspark", "control")])
    batch = collate_samples(drafter_samples)
    anchors, keep = sample_anchors(batch.loss_mask, 16, torch.Generator().manual_seed(3))
    for name, d in drafters.items():
        blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=d.config.block_size,
                              sample_from_anchor=d.config.sample_from_anchor, mask_token_id=MASK)
        with torch.no_grad():
            want = d.loss(d(batch, blocks), LossConfig()).metrics["tau_expected"]
        got = summary["drafters"][name][1.0]
        assert got["n"] == int(keep.sum()) == 32 and got["tau_expected"] == pytest.approx(float(want), abs=1e-5)
        assert 1.0 <= got["tau"] <= 1 + d.config.block_size
    assert summary["pairs"][("dspark", "dflash")][1.0]["n"] == 32


def test_init_from_target_gives_the_target_layers_context_keys_and_values(tiny_qwen3, drafter_samples, tmp_path):
    """``init: target``: at step 0 each draft layer's context keys/values are exactly those target
    layer ``target_layer_ids[-1] + 1`` computes from its input (the last captured feature)."""
    from training.loop import build_drafter_from

    tiny_qwen3.save_pretrained(tmp_path)
    cfg = DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=2, block_size=4,
                        markov_rank=8, init="target")
    d = build_drafter_from(cfg, str(tmp_path))
    assert d.init_layer == 3
    ids = drafter_samples[0]["input_ids"].long()
    with torch.no_grad():
        hs = tiny_qwen3(ids[None], output_hidden_states=True).hidden_states
        features = torch.cat([hs[i + 1] for i in LAYER_IDS], -1)
        ctx = d._fuse(features)
        layer = tiny_qwen3.model.layers[3]
        h = layer.input_layernorm(hs[3])  # the input of target layer 3 is the output of layer 2
        assert torch.allclose(ctx, h, atol=1e-6)
        cos, sin = d.rotary_emb(ctx, torch.arange(len(ids))[None])
        want_v = layer.self_attn.v_proj(h).view(1, len(ids), -1, 16).transpose(1, 2)
        for draft_layer in d.layers:
            k, v = d._context_kv(draft_layer, ctx, cos, sin)
            assert torch.allclose(v, want_v, atol=1e-6)
            assert torch.equal(draft_layer.mlp.up_proj.weight, layer.mlp.up_proj.weight)
        assert torch.equal(d.norm.weight, tiny_qwen3.model.norm.weight)
    random = build_drafter_from(DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=2,
                                              block_size=4, markov_rank=8), str(tmp_path))
    assert not torch.equal(random.layers[0].mlp.up_proj.weight, layer.mlp.up_proj.weight)
    with pytest.raises(ValueError, match="init must be one of"):
        DrafterConfig(target_layer_ids=LAYER_IDS, mask_token_id=MASK, init="copy")
