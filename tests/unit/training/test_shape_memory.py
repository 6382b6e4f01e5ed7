"""Memory of the steps that hold the target's frozen weights (issue #34 item 3): the drafter a
train worker builds (the tied embedding / lm_head held once, in the dtype the engine computes in)
and the export guard's initial state; each against a copy of the old code on the tiny target, same
numbers. The figures at the real width: ``bench/bench_shape_memory.py``."""
from __future__ import annotations

import types

import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import Qwen3Config, Qwen3ForCausalLM

from training.drafter import Drafter, DrafterConfig
from training.loop import build_drafter_from, compute_dtype
from training.target_weights import load_shared_weights

CFG = dict(target_layer_ids=(0, 2), mask_token_id=5, num_layers=1, block_size=4, markov_rank=8)


def _old_build(config, target_dir, d2t=None):
    """``training.loop.build_drafter_from`` before the fix (each frozen weight upcast on its own)."""
    from transformers import AutoConfig

    embed, lm_head = load_shared_weights(target_dir)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return Drafter(config, tc, embed.float(), lm_head.float(), d2t)


def _deepspeed_bf16_cast(model) -> None:
    """DeepSpeed's own bf16 parameter cast of its engine's module (the bf16 train worker)."""
    DeepSpeedEngine._cast_module_mixed_precision(types.SimpleNamespace(module=model), torch.bfloat16, None, False)


@pytest.fixture(scope="module")
def tied_target_dir(tmp_path_factory, tiny_qwen3) -> str:
    """The tiny Qwen3 with a tied embedding, stored in bf16 (as Qwen3-4B): no ``lm_head`` in its safetensors."""
    d = tmp_path_factory.mktemp("tied_target")
    torch.manual_seed(0)
    config = Qwen3Config(**{**tiny_qwen3.config.to_dict(), "tie_word_embeddings": True})
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(d)
    return str(d)


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _fp32_bytes(model) -> int:
    """Bytes of float32 parameter storages of ``model``, each storage once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.state_dict().values() if p.dtype == torch.float32}
    return sum(storages.values())


def test_a_bf16_train_worker_holds_the_tied_frozen_weight_once_in_bf16(tied_target_dir):
    """Built for a bf16 engine and cast by DeepSpeed, the tied embedding / lm_head is one bf16
    storage (old: two float32 copies, each cast to its own bf16 copy), the only float32 bytes left
    are none, and every value equals the old path's."""
    cfg = DrafterConfig(**CFG)
    torch.manual_seed(3)
    old = _old_build(cfg, tied_target_dir)
    torch.manual_seed(3)
    new = build_drafter_from(cfg, tied_target_dir, dtype=torch.bfloat16)
    assert _shared(new.embed_tokens.weight, new.lm_head.weight)
    assert new.embed_tokens.weight.dtype == torch.bfloat16
    trainable = sum(p.numel() for p in new.trainable_parameters())
    assert _fp32_bytes(new) == 4 * trainable  # before the engine's cast: only the trainable weights
    assert _fp32_bytes(old) == 4 * trainable + 4 * old.embed_tokens.weight.numel() * 2
    for m in (old, new):
        _deepspeed_bf16_cast(m)
    assert _shared(new.embed_tokens.weight, new.lm_head.weight)
    assert not _shared(old.embed_tokens.weight, old.lm_head.weight)
    assert _fp32_bytes(new) == 0
    assert new.state_dict().keys() == old.state_dict().keys()
    for k, v in old.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    frozen = {n for n, p in new.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"}  # both left out of checkpoints by name


@pytest.mark.parametrize("target", ["tied_target_dir", "tiny_target_dir"])
def test_a_float32_drafter_equals_the_old_build(target, request):
    """The float32 build (calibrate, evaluate, export, fp32 training) gives the old values, tied or not;
    tied, one float32 copy of the embedding instead of two."""
    target_dir = request.getfixturevalue(target)
    cfg = DrafterConfig(**CFG)
    torch.manual_seed(4)
    old = _old_build(cfg, target_dir)
    torch.manual_seed(4)
    new = build_drafter_from(cfg, target_dir)
    for k, v in old.state_dict().items():
        assert new.state_dict()[k].dtype == v.dtype == torch.float32 and torch.equal(new.state_dict()[k], v), k
    tied = target == "tied_target_dir"
    assert _shared(new.embed_tokens.weight, new.lm_head.weight) is tied
    embed = 4 * new.embed_tokens.weight.numel()
    assert _fp32_bytes(old) - _fp32_bytes(new) == (embed if tied else 0)


def test_the_reduced_vocabulary_shares_the_tied_target_lm_head(tied_target_dir):
    cfg = DrafterConfig(**CFG, draft_vocab_size=16)
    d2t = torch.arange(16) * 3
    new = build_drafter_from(cfg, tied_target_dir, d2t, dtype=torch.bfloat16)
    assert _shared(new.embed_tokens.weight, new.target_lm_head)
    old = _old_build(cfg, tied_target_dir, d2t)
    _deepspeed_bf16_cast(old)
    assert torch.equal(new.lm_head.weight, old.lm_head.weight)


@pytest.mark.parametrize(("bf16", "zero", "want"), [(True, 2, torch.bfloat16), (True, 0, torch.float32),
                                                    (False, 2, torch.float32)])
def test_compute_dtype(bf16, zero, want):
    assert compute_dtype(types.SimpleNamespace(bf16=bf16, zero_stage=zero)) is want


def test_the_export_guard_initial_state_is_the_old_one_without_a_float32_copy(tied_target_dir, monkeypatch):
    """:func:`pipeline.stages.export._fresh_state` gives the old state element for element, and the
    fresh drafter it builds ends with no float32 weight (old: its float32 weights and two float32
    embeddings stayed beside the rounded copy)."""
    import training.loop
    from pipeline.stages.export import _fresh_state

    cfg = DrafterConfig(**CFG)
    model = build_drafter_from(cfg, tied_target_dir, dtype=torch.bfloat16)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        old_fresh = _old_build(cfg, tied_target_dir)
    old = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in old_fresh.state_dict().items()}
    built = []
    monkeypatch.setattr(training.loop, "build_drafter_from",
                        lambda *a, **kw: built.append(build_drafter_from(*a, **kw)) or built[-1])
    new = _fresh_state(model, 11, tied_target_dir, torch.bfloat16)
    assert new.keys() == old.keys()
    for k, v in old.items():
        assert new[k].dtype == v.dtype and torch.equal(new[k], v), k
    assert _fp32_bytes(built[0]) == 0


def test_moving_the_drafter_keeps_the_tied_frozen_weight_one_storage(tied_target_dir):
    """``.to(...)`` (a device move on GPU; a dtype move stands in here) keeps embed and lm_head one tensor."""
    config = DrafterConfig(**CFG)
    model = build_drafter_from(config, tied_target_dir, dtype=torch.bfloat16)
    before = model.embed_tokens.weight.detach().clone()
    model.to(torch.float64)
    assert model.embed_tokens.weight.dtype == torch.float64 and model.lm_head.weight.dtype == torch.float64
    assert _shared(model.embed_tokens.weight, model.lm_head.weight)
    assert torch.equal(model.lm_head.weight, before.double()) and model.fc.weight.dtype == torch.float64
