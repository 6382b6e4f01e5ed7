"""GPU-path fixes of the training attention and optimizer, held in place on the CPU: the flex block
mask built from the anchors (shape-only tiles once per shape), padded static shapes for compiled
flex attention (a graph per bucket, the loss and gradients unchanged), Muon on the backbone's
hidden matrices only, and the DDP engine's model on the worker's device.

CUDA is stood in for as in ``tests/unit/training/test_gpu_path.py``: dynamo's ``eager`` backend for the
compiled flex graphs, the ``meta`` device for a device move."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from training.blocks import (_slot_tiles, block_mask_mod, build_blocks, collate_samples, flex_block_mask,
                             sample_anchors, static_shape)
from training.drafter import Drafter, DrafterConfig
from training.losses import LossConfig

pytestmark = pytest.mark.gpu_path

LAYER_IDS = (0, 2)
MASK = 511


def _drafter(target, **kw):
    kw = dict(dict(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=2, block_size=4, markov_rank=8,
                   num_anchors=12), **kw)
    torch.manual_seed(1)
    d = Drafter(DrafterConfig(**kw), target.config, target.model.embed_tokens.weight, target.lm_head.weight)
    torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=0.5)  # a non-zero Markov bias
    return d


def _few_blocks(d, batch, n: int):
    """Blocks at ``n`` anchors per sample, fewer than the config's ``num_anchors`` (so N is padded)."""
    anchors, keep = sample_anchors(batch.loss_mask, n, torch.Generator().manual_seed(0))
    return build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=d.config.block_size,
                        sample_from_anchor=d.config.sample_from_anchor, mask_token_id=MASK)


# -- 1. the block mask without a dense pass -------------------------------------------------------

@pytest.mark.parametrize("B,T,S,n,tile", [(2, 11, 4, 5, 8), (3, 37, 7, 9, 8), (1, 64, 3, 12, 16),
                                          (2, 30, 9, 4, 4), (2, 300, 7, 40, 128)])
def test_direct_block_mask_equals_create_block_mask(B, T, S, n, tile):
    """Tile for tile (partial and full, kv and q orders) the mask torch builds by evaluating the
    rule densely, for sorted anchors with dummies, unsorted anchors, ragged tiles and slot blocks
    wider than a tile (S = 9 > 4: full slot tiles)."""
    g = torch.Generator().manual_seed(T)
    lm = torch.rand(B, T, generator=g) < 0.8
    lm[:, :2] = True
    for anchors in (sample_anchors(lm, n, g)[0], torch.randint(0, T - 1, (B, n), generator=g)):
        N = anchors.shape[1]
        want = create_block_mask(block_mask_mod(anchors, T, S), B, None, N * S, T + N * S, device="cpu",
                                 BLOCK_SIZE=tile)
        got = flex_block_mask(anchors, T, S, tile=tile)
        assert torch.equal(got.to_dense(), want.to_dense())
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.seq_lengths == (N * S, T + N * S) and got.BLOCK_SIZE == (tile, tile)
    if S > tile:
        assert int(got.full_kv_num_blocks.sum()) > 0  # the case exercised the full slot tiles


def test_block_mask_tiles_are_built_once_per_shape():
    """The shape-only tiles are computed once per (T, N, S) and reused for every micro-step's
    anchors; the anchor-dependent rest is tensor ops (the dense rule is never evaluated)."""
    _slot_tiles.cache_clear()
    calls = []
    for seed in range(3):
        anchors = sample_anchors(torch.ones(2, 600, dtype=torch.bool), 50, torch.Generator().manual_seed(seed))[0]
        calls.append(flex_block_mask(anchors, 600, 7))
    assert _slot_tiles.cache_info().misses == 1 and _slot_tiles.cache_info().hits == 2
    flex_block_mask(anchors[:, :40], 600, 7)
    flex_block_mask(anchors, 700, 7)
    assert _slot_tiles.cache_info().misses == 3
    assert not torch.equal(calls[0].to_dense(), calls[1].to_dense())  # the context part follows the anchors


def test_static_shape_buckets():
    assert static_shape(40, 6, 12) == (512, 12)
    assert static_shape(512, 12, 12) == (512, 12)
    assert static_shape(513, 3, 512) == (1024, 512)
    assert static_shape(4096, 512, 512) == (4096, 512)
    assert static_shape(3000, 20, 16) == (4096, 20)  # more blocks than configured: kept
    assert len({static_shape(t, 512, 512) for t in range(2, 4097)}) == 4
    with pytest.raises(ValueError, match="must be >= 1"):
        static_shape(0, 1, 1)


# -- 2. padding changes nothing -------------------------------------------------------------------

def test_padding_keeps_the_loss_and_gradients(tiny_qwen3, drafter_samples):
    """sdpa on the CPU, float64: T 40 -> 512 and N 5 -> 12 (the config's num_anchors). The loss is
    bitwise equal; the gradients to float64 rounding (padding lengthens the sums of the matmuls,
    whose blocking then adds the same terms in another order)."""
    batch = collate_samples(drafter_samples)
    out = {}
    for pad in (False, True):
        d = _drafter(tiny_qwen3, attention="sdpa").double()
        blocks = _few_blocks(d, batch, 5)
        loss = d.loss(d(batch, blocks, static_shapes=pad), LossConfig()).loss
        loss.backward()
        out[pad] = loss.detach(), {n: p.grad for n, p in d.named_parameters() if p.requires_grad}
    assert blocks.anchors.shape == (2, 5) and torch.equal(out[False][0], out[True][0])
    for name, g in out[False][1].items():
        assert torch.allclose(out[True][1][name], g, rtol=1e-12, atol=1e-15), name
    assert any(g.abs().max() > 1e-3 for g in out[False][1].values())


def test_padding_is_off_on_the_cpu_default_path(tiny_qwen3, drafter_samples, monkeypatch):
    """``static_shapes=None`` pads only for compiled flex (CUDA): the CPU paths keep their shapes."""
    import training.drafter as drafter_mod

    batch = collate_samples(drafter_samples)
    seen = []
    real = drafter_mod.dense_block_mask
    monkeypatch.setattr(drafter_mod, "dense_block_mask",
                        lambda a, T, S: seen.append((tuple(a.shape), T)) or real(a, T, S))
    d = _drafter(tiny_qwen3)
    with torch.no_grad():
        d(batch, _few_blocks(d, batch, 5))
        d(batch, _few_blocks(d, batch, 5), static_shapes=True)
    assert seen == [((2, 5), 40), ((2, 12), 512)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_padded_flex_forward_equals_unpadded_sdpa(tiny_qwen3, drafter_samples):
    """Flex (eager on the CPU, forward only) at the padded shape, with the directly built mask."""
    batch = collate_samples(drafter_samples)
    sdpa, flex = _drafter(tiny_qwen3, attention="sdpa"), _drafter(tiny_qwen3, attention="flex")
    blocks = _few_blocks(sdpa, batch, 5)
    with torch.no_grad():
        want = sdpa(batch, blocks)
        got = flex(batch, blocks, static_shapes=True)
        assert torch.allclose(got.hidden, want.hidden, atol=1e-5)
        assert torch.allclose(flex.loss(got, LossConfig()).loss, sdpa.loss(want, LossConfig()).loss, atol=1e-6)


def test_compiled_flex_compiles_once_per_bucket(monkeypatch):
    """dynamo's eager backend stands in for inductor: 6 micro-batches of 3 context buckets give 3
    graphs, new anchors at a seen shape none; past the limit the call raises, not runs eager."""
    import torch._dynamo.exc

    import training.drafter as drafter_mod
    from training.drafter import compiled_flex_attention

    def call(T, N, seed, num_anchors=8):
        Tp, Np = static_shape(T, N, num_anchors)
        g = torch.Generator().manual_seed(seed)
        q, k, v = torch.randn(1, 2, Np * 3, 8, generator=g), *torch.randn(2, 1, 1, Tp + Np * 3, 8, generator=g)
        anchors = sample_anchors(torch.ones(1, T, dtype=torch.bool), N, g)[0]
        mask = flex_block_mask(torch.nn.functional.pad(anchors, (0, Np - N)), Tp, 3)
        with torch.no_grad():
            return compiled_flex_attention(q, k, v, mask, 0.3, backend="eager")

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        for seed, (T, N) in enumerate([(40, 8), (300, 5), (600, 8), (700, 7), (1500, 8), (1100, 6)]):
            call(T, N, seed)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        call(40, 8, 99)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
        monkeypatch.setattr(drafter_mod, "FLEX_GRAPH_LIMIT", 3)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            call(3000, 8, 7)  # a 4th bucket
    finally:
        torch._dynamo.reset()


# -- 3. Muon on the backbone's hidden matrices only ------------------------------------------------

MUON_NAMES = sorted({"fc.weight"} | {f"layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"}
                    | {f"layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")})


def _groups_by_name(model, groups) -> dict[str, list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in groups}


@pytest.mark.parametrize("head_type", ["markov", "gated"])
def test_muon_takes_the_backbone_matrices_and_adamw_the_rest(tiny_qwen3, monkeypatch, head_type):
    """DeepSpeedEngine under Muon: deepspeed.initialize (stopped after DeepSpeed's own tagging and
    its split into the Muon and AdamW groups) sees the Markov embedding, the Markov output and the
    confidence projection on AdamW. Before the fix DeepSpeed's name rule gave them Muon."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine as DSEngine

    from training.engine import DeepSpeedEngine

    class Stop(Exception):
        pass

    seen = {}

    def initialize(*, model, config, model_parameters, **_):
        deepspeed.set_optimizer_flags(DeepSpeedConfig(config), model)  # what deepspeed.initialize runs
        groups = DSEngine._muon_param_groups(model_parameters, config["optimizer"]["params"])  # its split
        seen.update(_groups_by_name(model, groups))
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # keeps the engine off dynamo's switch
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    model = _drafter(tiny_qwen3, head_type=head_type)
    with pytest.raises(Stop):
        DeepSpeedEngine(model, lr=1e-3, muon_lr=0.02, betas=(0.9, 0.95), weight_decay=0.0, total_steps=1,
                        warmup_ratio=0.0, zero_stage=2, bf16=False, micro_batch=1, accumulation=1, grad_clip=1.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert seen["muon-params"] == MUON_NAMES
    assert seen["adam-params"] == sorted(trainable - set(MUON_NAMES))
    head = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"}
    assert head <= set(seen["adam-params"])
    if head_type == "gated":
        assert "markov_head.gate_proj.weight" in seen["adam-params"]
    assert deepspeed.set_optimizer_flags.__module__ == "deepspeed"  # DeepSpeed's own again after init


def test_muon_selection_leaves_a_model_without_one_to_deepspeed(monkeypatch):
    """A model without ``muon_parameters()`` keeps DeepSpeed's rule (2-D, not embed / lm_head)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    from training.engine import deepspeed_config, muon_selection

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = DeepSpeedConfig(deepspeed_config(micro_batch=1, accumulation=1, grad_clip=1.0, zero_stage=2, bf16=False,
                                              lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=0.02))
    with muon_selection(model):
        deepspeed.set_optimizer_flags(config, model)
    assert [p.use_muon for p in model.parameters()] == [True, False, False, False]


# -- 4. DDP: the model on the worker's device ------------------------------------------------------

def test_worker_device_is_the_local_rank_gpu(monkeypatch):
    from training.engine import worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    assert worker_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_device() == torch.device("cpu")


def test_ddp_engine_moves_the_model_to_the_worker_device(tiny_qwen3, monkeypatch):
    """zero_stage=0: the CPU-built drafter goes to the worker's device (``meta`` standing in for
    ``cuda:LOCAL_RANK``) before DDP would wrap it; before the fix it stayed on the CPU."""
    import training.engine as engine_mod

    monkeypatch.setattr(engine_mod, "worker_device", lambda: torch.device("meta"))
    model = _drafter(tiny_qwen3)
    engine = engine_mod.make_engine(model, 0, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, total_steps=1,
                                    warmup_ratio=0.0, accumulation=1, grad_clip=1.0)
    assert engine.module is model and engine.device == torch.device("meta")
    assert {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()} == {"meta"}
