"""GPU-path fixes held in place on the CPU: the batch hand-off to the model's device, fp32
gradient accumulation under bf16, and no sdpa-with-a-mask on CUDA.

There is no second device here, so the ``meta`` device stands in for CUDA where a device move is
checked (a tensor moved there keeps its shape and dtype and has no data), and the CUDA-only
branches (pinned memory) are driven with torch's pin / copy calls recorded."""
from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from training.blocks import Blocks, DraftBatch, collate_samples
from training.drafter import Drafter, DrafterConfig
from training.losses import LossConfig

pytestmark = pytest.mark.gpu_path

LAYER_IDS = (0, 2)
MASK = 511
META = torch.device("meta")




def _drafter(target, **kw):
    kw = dict(dict(target_layer_ids=LAYER_IDS, mask_token_id=MASK, num_layers=1, block_size=4, markov_rank=8,
                   num_anchors=6), **kw)
    torch.manual_seed(1)
    return Drafter(DrafterConfig(**kw), target.config, target.model.embed_tokens.weight, target.lm_head.weight)


def _tensors(obj) -> dict[str, torch.Tensor]:
    """Every tensor field of a DraftBatch / Blocks by name."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), torch.Tensor)}


class _Stop(Exception):
    pass


def _record_forward(model) -> dict:
    """Replace ``model.forward`` by one that records what reaches it (device, shape, dtype of every
    tensor of the batch and the blocks) and stops the step."""
    seen = {}

    def forward(batch, blocks):
        for kind, obj in (("batch", batch), ("blocks", blocks)):
            for k, v in _tensors(obj).items():
                seen[f"{kind}.{k}"] = (v.device.type, tuple(v.shape), v.dtype)
        raise _Stop

    model.forward = forward
    return seen


# -- 1. inputs reach the engine's device ---------------------------------------------------------

def test_to_device_moves_every_tensor_of_nested_batches_to_the_models_device(tiny_qwen3, drafter_samples):
    from training.data import module_device, to_device

    model = _drafter(tiny_qwen3).to(META)
    batch = collate_samples(drafter_samples)
    blocks = model.make_blocks(batch, torch.Generator().manual_seed(0))  # config only: the CPU batch
    device = module_device(model)
    assert device.type == "meta"
    moved = to_device({"batch": batch, "nested": [(blocks,)], "step": 3, "name": "x"}, device)
    assert type(moved["batch"]) is DraftBatch and type(moved["nested"][0][0]) is Blocks
    assert moved["step"] == 3 and moved["name"] == "x"
    for src, dst in ((batch, moved["batch"]), (blocks, moved["nested"][0][0])):
        src_t, dst_t = _tensors(src), _tensors(dst)
        assert set(dst_t) == set(src_t) and len(src_t) >= 6
        for k, t in src_t.items():
            assert t.device.type == "cpu"  # the source is left alone
            assert dst_t[k].device.type == "meta", k
            assert (dst_t[k].shape, dst_t[k].dtype) == (t.shape, t.dtype), k
    assert moved["batch"].features.dtype == torch.bfloat16 and moved["batch"].input_ids.dtype == torch.int64
    assert moved["nested"][0][0].sample_from_anchor is blocks.sample_from_anchor
    assert moved["nested"][0][0].slots == blocks.slots == 4


def test_to_device_on_the_cpu_is_a_no_op(drafter_samples):
    """A CPU model: the same objects and tensors come back, so every CPU figure stays bit-identical."""
    from training.data import module_device, to_device

    batch = collate_samples(drafter_samples)
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert to_device(batch, torch.device("cpu")) is batch
    assert to_device(batch, "cpu").features is batch.features
    nested = {"b": batch, "l": [batch.lengths]}
    assert to_device(nested, "cpu") is nested


def test_to_device_towards_cuda_pins_then_copies_without_blocking(drafter_samples, monkeypatch):
    """The CUDA branch, driven on the CPU: each CPU tensor not yet pinned is pinned, then copied
    with ``non_blocking=True``; an already pinned one is not pinned again."""
    from training.data import to_device

    batch = collate_samples(drafter_samples)
    pinned, copies = [], []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: self is batch.lengths)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(tuple(self.shape)) or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False, **k:
                        copies.append((torch.device(device).type, non_blocking)) or self)
    to_device(batch, torch.device("cuda"))
    assert len(pinned) == 5  # every tensor but the already pinned lengths
    assert sorted(pinned) == sorted(tuple(t.shape) for k, t in _tensors(batch).items() if k != "lengths")
    assert copies == [("cuda", True)] * 6


def test_host_batch_pins_the_collated_batch_for_a_cuda_model(drafter_samples, monkeypatch):
    from training.loop import host_batch

    plain = host_batch(drafter_samples, pin=False)
    ref = collate_samples(drafter_samples)
    assert all(torch.equal(t, _tensors(ref)[k]) for k, t in _tensors(plain).items())
    pinned = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(self.dtype) or self)
    host_batch(drafter_samples, pin=True)
    assert sorted(map(str, pinned)) == sorted(str(t.dtype) for t in _tensors(ref).values())


def test_prefetcher_collates_on_its_own_thread():
    """The pinning (and the collation before it) run on the prefetch thread, ahead of the step."""
    from training.data import Prefetcher

    class Reader:
        shards = [0]
        records = {0: SimpleNamespace(num_samples=6)}

        def sample(self, i):
            return SimpleNamespace(input_ids=torch.tensor([i]), loss_mask=None, features=None, last_hidden=None,
                                   sample_id=f"s{i}")

    threads = []

    def collate(drafter_samples):
        threads.append(threading.get_ident())
        return [s["sample_id"] for s in drafter_samples]

    feed = Prefetcher(Reader(), [(0, k) for k in (5, 4, 3, 2, 1, 0)], 2, 0, 3, collate=collate)
    items = list(feed)
    assert [ids for _, ids in items] == [["s5", "s4"], ["s3", "s2"], ["s1", "s0"]]
    assert [[int(s["input_ids"]) for s in drafter_samples] for drafter_samples, _ in items] == [[5, 4], [3, 2], [1, 0]]
    assert len(threads) == 3 and set(threads) == {feed._thread.ident} != {threading.get_ident()}


def test_micro_step_hands_the_model_its_inputs_on_the_models_device(tiny_qwen3, drafter_samples):
    """The loop's micro-step with a model on ``meta``: what reaches the forward is on ``meta``
    (before the fix the CPU batch reached it as it was)."""
    from training.engine import make_engine
    from training.loop import micro_step

    model = _drafter(tiny_qwen3).to(META)
    engine = make_engine(model, 0, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, total_steps=1, warmup_ratio=0.0,
                         accumulation=1, grad_clip=1.0)
    seen = _record_forward(model)
    batch = collate_samples(drafter_samples)
    with pytest.raises(_Stop):
        micro_step(engine, batch, torch.Generator().manual_seed(0), LossConfig(), 1)
    blocks = _drafter(tiny_qwen3).make_blocks(batch, torch.Generator().manual_seed(0))
    expected = {f"{kind}.{k}": ("meta", tuple(v.shape), v.dtype)
                for kind, obj in (("batch", batch), ("blocks", blocks)) for k, v in _tensors(obj).items()}
    assert seen == expected
    assert seen["batch.features"] == ("meta", (2, 40, 128), torch.bfloat16)
    assert seen["blocks.input_ids"] == ("meta", (2, 6, 4), torch.int64)


def test_validation_hands_the_model_its_inputs_on_the_models_device(tiny_qwen3, drafter_samples):
    from training.validation import validate

    model = _drafter(tiny_qwen3).to(META)
    seen = _record_forward(model)
    reader = SimpleNamespace(sample=lambda j: SimpleNamespace(**drafter_samples[j]))
    with pytest.raises(_Stop):
        validate(model, reader, [[0, 1]], LossConfig(), rank=0, world=1)
    assert seen and {dev for dev, _, _ in seen.values()} == {"meta"}
    assert seen["batch.features"] == ("meta", (2, 40, 128), torch.bfloat16)
    assert seen["batch.last_hidden"][1:] == ((34 + 18, 64), torch.bfloat16)  # supervised rows of both drafter_samples


# -- 2. gradient accumulation in fp32 under bf16 ---------------------------------------------------

DS_ARGS = dict(micro_batch=2, accumulation=4, grad_clip=1.0, zero_stage=2, lr=1e-3, betas=(0.9, 0.95),
               weight_decay=0.01)


@pytest.mark.parametrize("muon_lr", [None, 0.02])
def test_deepspeed_config_accumulates_bf16_gradients_in_fp32(muon_lr):
    from deepspeed.runtime.config import DeepSpeedConfig, DtypeEnum

    from training.engine import deepspeed_config

    bf16 = deepspeed_config(bf16=True, muon_lr=muon_lr, **DS_ARGS)
    assert bf16["bf16"] == {"enabled": True}
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    parsed = DeepSpeedConfig(bf16)  # what DeepSpeed's engine reads (get_data_types)
    assert parsed.bfloat16_config.enabled and DtypeEnum(parsed.grad_accum_dtype).value is torch.float32
    fp32 = deepspeed_config(bf16=False, muon_lr=muon_lr, **DS_ARGS)
    assert "data_types" not in fp32 and fp32["bf16"] == {"enabled": False}
    assert DeepSpeedConfig(fp32).grad_accum_dtype is None  # DeepSpeed's default: the model dtype, fp32
    assert {k: v for k, v in bf16.items() if k != "data_types"} == {**fp32, "bf16": {"enabled": True}}


def test_deepspeed_config_in_fp32_is_the_one_before_the_fix():
    """fp32 training: the config DeepSpeed gets is exactly what it was."""
    from training.engine import deepspeed_config

    assert deepspeed_config(bf16=False, **DS_ARGS) == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}, "steps_per_print": 10**9,
        "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True}
    muon = deepspeed_config(bf16=False, muon_lr=0.02, **DS_ARGS)
    assert muon["gradient_clipping"] == 0.0 and muon["optimizer"] == {"type": "Muon", "params": {
        "muon_lr": 0.02, "adam_lr": 1e-3, "betas": [0.9, 0.95], "momentum": 0.95, "weight_decay": 0.01,
        "torch_adam": True}}


# -- 3. no sdpa with a boolean mask on CUDA -------------------------------------------------------

def test_sdpa_with_a_mask_is_refused_on_cuda_and_allowed_on_the_cpu():
    from training.drafter import resolve_attention

    with pytest.raises(ValueError, match=r"attention='sdpa' on CUDA.*math kernel.*use flex attention: "
                                         r"DrafterConfig.attention='flex'"):
        resolve_attention("sdpa", "cuda")
    assert resolve_attention("sdpa", "cpu") == "sdpa"
    assert resolve_attention("flex", "cuda") == "flex"
    assert resolve_attention("flex", "cpu") == "flex"
    assert resolve_attention("auto", "cuda") == "flex"
    assert resolve_attention("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of"):
        resolve_attention("math", "cpu")


def test_the_forward_refuses_sdpa_on_cuda_once_before_any_layer(tiny_qwen3, drafter_samples, monkeypatch):
    """The training forward asks :func:`resolve_attention` once, with its weights' device type; on
    CUDA (the device type stood in for here) the refusal comes before the first layer runs."""
    import training.drafter as drafter_mod
    from training.drafter import resolve_attention

    model = _drafter(tiny_qwen3, attention="sdpa", num_layers=2)
    batch = collate_samples(drafter_samples)
    blocks = model.make_blocks(batch, torch.Generator().manual_seed(0))
    asked, computed = [], []
    model.fc.register_forward_pre_hook(lambda *a: computed.append("fc"))  # the forward's first compute
    monkeypatch.setattr(drafter_mod, "resolve_attention", lambda a, d: asked.append((a, d)) or resolve_attention(a, d))
    with torch.no_grad():
        model(batch, blocks)
    assert asked == [("sdpa", "cpu")] and computed == ["fc"]  # once per forward, not per layer (2 layers)
    monkeypatch.setattr(drafter_mod, "resolve_attention", lambda a, d: resolve_attention(a, "cuda"))
    with pytest.raises(ValueError, match="use flex attention"):
        model(batch, blocks)
    assert computed == ["fc"]  # refused before the fusion of the features, let alone a layer
