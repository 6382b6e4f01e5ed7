"""DSpark loss: c*, tau, exact loss values, chunking, reduced vocabulary, global normalisation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.losses import (LossConfig, SupervisedSlots, conditional_acceptance, drafter_loss,
                             expected_tau, position_weights)


def test_c_star_reference_values():
    p = torch.tensor([0.2, 0.3, 0.5])
    assert conditional_acceptance(p, p).item() == pytest.approx(1.0, abs=1e-7)
    assert conditional_acceptance(torch.tensor([1.0, 0, 0]), torch.tensor([0, 1.0, 0])).item() == 0.0
    assert conditional_acceptance(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])).item() == 0.5


def test_expected_tau_and_position_weights():
    c = torch.tensor([[0.5, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    assert expected_tau(c, valid).tolist() == [2.0, 3.0]  # 1 + .5 + .25 + .25 ; 1 + 1 + 1
    w = position_weights(torch.tensor([0, 1, 4]), 4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-1.0)]))
    assert position_weights(torch.tensor([0, 3]), float("inf")).tolist() == [1.0, 1.0]


def _slots(hidden, target_hidden, labels, slot, block, conf=None, u=None, num_blocks=1, gamma=2):
    return SupervisedSlots(hidden=hidden, bias_features=u, confidence_logits=conf, labels=labels,
                           slot=slot, block=block, target_hidden=target_hidden, num_blocks=num_blocks,
                           block_size=gamma)


def test_loss_exact_value_and_metrics():
    # identity heads: logits = hidden. Slot k=1: p_d = p_t = uniform; slot k=2: p_d uniform,
    # p_t = [.5, .25, .25] -> TV = 1/3, c* = 5/6. CE = log 3 both; confidence logit 0 -> BCE = log 2.
    eye = torch.eye(3)
    hidden = torch.zeros(2, 3)
    target = torch.log(torch.tensor([[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]]))
    s = _slots(hidden, target, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([0, 0]),
               conf=torch.zeros(2))
    out = drafter_loss(s, lm_head=eye, target_lm_head=eye, markov_w2=None, draft_to_target=None,
                       config=LossConfig())
    e = math.exp(-0.25)
    want = 0.1 * math.log(3) + math.log(2) + 0.9 * (1 / 3) * e / (1 + e)
    assert out.loss.item() == pytest.approx(want, abs=1e-6)
    assert out.c_star.tolist() == pytest.approx([1.0, 5 / 6], abs=1e-6)
    m = out.metrics
    assert m["loss"].item() == pytest.approx(want, abs=1e-6)
    assert m["acceptance_per_position"].tolist() == pytest.approx([1.0, 5 / 6], abs=1e-6)
    assert m["tau_expected"].item() == pytest.approx(1 + 1 + 5 / 6, abs=1e-6)
    assert m["confidence_error"].item() == pytest.approx((0.5 + 1 / 3) / 2, abs=1e-6)
    assert m["supervised_slots"].item() == 2 and m["weight_sum"].item() == pytest.approx(1 + e)


def test_reduced_vocab_tv_counts_outside_mass_and_ce_skips_undrafted_labels():
    target_head = torch.eye(4)
    draft_ids = torch.tensor([0, 2])
    s = _slots(torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([1, 2]), torch.tensor([0, 0]),
               torch.tensor([0, 1]), num_blocks=2)
    out = drafter_loss(s, lm_head=target_head[draft_ids], target_lm_head=target_head, markov_w2=None,
                       draft_to_target=draft_ids, config=LossConfig())
    # p_d = [.5, .5] on ids 0, 2; p_t uniform over 4: TV = .25 + .25 + .5 (outside) = 1
    assert out.c_star.tolist() == [0.5, 0.5]
    assert out.loss.item() == pytest.approx((0.1 * math.log(2) + 0.9 * 2) / 2, abs=1e-6)


def test_all_supervision_masked_gives_finite_zero_loss_and_zero_gradient():
    hidden = torch.zeros(0, 8, requires_grad=True)
    u = torch.zeros(0, 4, requires_grad=True)
    w2 = torch.randn(50, 4, requires_grad=True)
    conf = torch.zeros(0, requires_grad=True)
    s = _slots(hidden, torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
               torch.zeros(0, dtype=torch.long), conf=conf, u=u, num_blocks=3, gamma=4)
    out = drafter_loss(s, lm_head=torch.randn(50, 8), target_lm_head=torch.randn(50, 8), markov_w2=w2,
                       draft_to_target=None, config=LossConfig())
    assert torch.isfinite(out.loss) and out.loss.item() == 0.0
    out.loss.backward()
    assert torch.equal(w2.grad, torch.zeros_like(w2))


def _random_slots(M, H=8, R=4, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g, requires_grad=True)
    u = torch.randn(M, R, generator=g, requires_grad=True)
    conf = torch.randn(M, generator=g, requires_grad=True)
    slot = torch.arange(M) % 3
    s = _slots(hidden, torch.randn(M, H, generator=g), torch.randint(0, V, (M,), generator=g), slot,
               torch.arange(M) // 3, conf=conf, u=u, num_blocks=(M + 2) // 3, gamma=3)
    heads = dict(lm_head=torch.randn(V, H, generator=g), target_lm_head=torch.randn(V, H, generator=g),
                 markov_w2=torch.randn(V, R, generator=g, requires_grad=True))
    return s, heads


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpointed"])
def test_chunking_changes_nothing_and_saves_no_slot_by_vocab_tensor(fused):
    V, chunk = 50, 5
    results = []
    for size in (chunk, 1000):
        s, heads = _random_slots(37, V=V)
        params = {id(t.untyped_storage()) for t in heads.values()}
        rows = []

        def pack(t):
            if t.ndim == 2 and t.shape[-1] == V and id(t.untyped_storage()) not in params:
                rows.append(t.shape[0])
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = drafter_loss(s, **heads, draft_to_target=None, config=LossConfig(chunk_size=size, fused=fused))
        out.loss.backward()
        assert sum(rows) <= chunk  # no [slots, V] activation is kept for backward
        results.append((out.loss.detach(), s.hidden.grad, s.bias_features.grad, heads["markov_w2"].grad,
                        s.confidence_logits.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


def test_confidence_loss_sends_no_gradient_through_c_star():
    s, heads = _random_slots(9)
    out = drafter_loss(s, **heads, draft_to_target=None,
                       config=LossConfig(ce_weight=0.0, tv_weight=0.0, confidence_weight=1.0))
    out.loss.backward()
    assert torch.count_nonzero(s.confidence_logits.grad) == 9
    assert torch.count_nonzero(s.hidden.grad) == 0 and torch.count_nonzero(heads["markov_w2"].grad) == 0


def test_rejects_missing_markov_w2():
    s, heads = _random_slots(3)
    heads["markov_w2"] = None
    with pytest.raises(ValueError, match="markov_w2"):
        drafter_loss(s, **heads, draft_to_target=None, config=LossConfig())


def _subset(s, rows, block_base, num_blocks):
    return _slots(s.hidden.detach()[rows].clone().requires_grad_(), s.target_hidden[rows], s.labels[rows],
                  s.slot[rows], s.block[rows] - block_base, s.confidence_logits.detach()[rows].clone()
                  .requires_grad_(), s.bias_features.detach()[rows].clone().requires_grad_(),
                  num_blocks=num_blocks, gamma=3)


def _rank_main(rank, world, init_file, out_dir, fused):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    s, heads = _random_slots(8)  # blocks 0,1 (6 slots) on rank 0, block 2 (2 slots) on rank 1
    rows = slice(0, 6) if rank == 0 else slice(6, 8)
    local = _subset(s, rows, 0 if rank == 0 else 2, 2 if rank == 0 else 1)
    out = drafter_loss(local, **heads, draft_to_target=None, config=LossConfig(chunk_size=4, fused=fused))
    out.loss.backward()
    torch.save({"loss": out.loss.detach(), "metrics": out.metrics, "w2": heads["markov_w2"].grad,
                "hidden": local.hidden.grad}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "checkpointed"])
def test_global_normalisation_two_gloo_ranks_equal_one_rank(tmp_path, fused):
    s, heads = _random_slots(8)
    one = drafter_loss(s, **heads, draft_to_target=None, config=LossConfig(chunk_size=4, fused=fused))
    one.loss.backward()
    # fork: the children inherit the imported, warmed-up torch (spawn would re-import it twice)
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path), fused), nprocs=2, join=True,
                       start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert (r0["loss"] + r1["loss"]).item() == pytest.approx(one.loss.item(), abs=1e-6)
    assert torch.allclose(r0["w2"] + r1["w2"], heads["markov_w2"].grad, atol=1e-6)
    assert torch.allclose(torch.cat([r0["hidden"], r1["hidden"]]), s.hidden.grad, atol=1e-6)
    for r in (r0, r1):
        for key in ("loss", "tau_expected", "acceptance_per_position", "confidence_error", "weight_sum"):
            assert torch.allclose(r["metrics"][key], one.metrics[key], atol=1e-6), key


def _fused_case(M, *, markov=True, conf=True, draft_ids=None, ignored=(), dtype=torch.float64, H=8, R=4,
                V=50, seed=0):
    """Fresh leaf slots and heads (same values for the same seed): labels over the target vocabulary,
    ``ignored`` rows set to IGNORE_LABEL; ``draft_ids`` [V_draft] for a reduced vocabulary."""
    from training.blocks import IGNORE_LABEL

    g = torch.Generator().manual_seed(seed)
    Vd = V if draft_ids is None else len(draft_ids)
    target_head = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (M,), generator=g)
    labels[list(ignored)] = IGNORE_LABEL
    hidden, target_hidden = torch.randn(2, M, H, generator=g, dtype=dtype)
    s = _slots(hidden.requires_grad_(), target_hidden, labels, torch.arange(M) % 3, torch.arange(M) // 3,
               conf=torch.randn(M, generator=g).requires_grad_() if conf else None,
               u=torch.randn(M, R, generator=g, dtype=dtype).requires_grad_() if markov else None,
               num_blocks=(M + 2) // 3, gamma=3)
    heads = dict(lm_head=target_head if draft_ids is None else target_head[draft_ids], target_lm_head=target_head,
                 markov_w2=torch.randn(Vd, R, generator=g, dtype=dtype).requires_grad_() if markov else None,
                 draft_to_target=draft_ids)
    return s, heads


def _loss_and_grads(case: dict, config: LossConfig, grad_scale: float = 3.0):
    """drafter_loss on a fresh ``_fused_case(**case)``, backward of ``loss * grad_scale`` (the DeepSpeed
    ``loss * world`` convention); returns the output and the gradients by name."""
    s, heads = _fused_case(**case)
    out = drafter_loss(s, **heads, config=config)
    (out.loss * grad_scale).backward()
    leaves = {"hidden": s.hidden, "bias_features": s.bias_features, "markov_w2": heads["markov_w2"],
              "confidence_logits": s.confidence_logits}
    return out, {k: t.grad for k, t in leaves.items() if t is not None}


FUSED_CASES = {
    "markov_confidence_chunks_ignored": dict(M=37, ignored=(2, 11, 30)),
    "dflash_no_heads": dict(M=20, markov=False, conf=False),
    "reduced_vocab": dict(M=23, draft_ids=torch.tensor([0, 3, 4, 7, 9, 12, 20, 21, 33, 40, 41, 49]), ignored=(5,)),
    "float32": dict(M=16, dtype=torch.float32),
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_loss_equals_checkpointed_loss_metrics_and_gradients(name):
    case = FUSED_CASES[name]
    tight = case.get("dtype", torch.float64) == torch.float64
    tol = dict(rtol=1e-10, atol=1e-12) if tight else dict(rtol=1e-4, atol=1e-6)
    tol32 = dict(rtol=1e-6, atol=1e-7) if tight else dict(rtol=1e-5, atol=1e-6)  # c*, metrics: float32
    fused, g_fused = _loss_and_grads(case, LossConfig(chunk_size=6, fused=True))
    ckpt, g_ckpt = _loss_and_grads(case, LossConfig(chunk_size=6, fused=False))
    assert fused.loss.requires_grad and fused.loss.item() > 0
    torch.testing.assert_close(fused.loss, ckpt.loss, **tol)
    torch.testing.assert_close(fused.c_star, ckpt.c_star, **tol32)
    assert fused.c_star.dtype == torch.float32 and fused.c_star.min() < 1
    assert fused.metrics.keys() == ckpt.metrics.keys()
    for key in fused.metrics:
        torch.testing.assert_close(fused.metrics[key], ckpt.metrics[key], **tol32, equal_nan=True, msg=key)
    assert g_fused.keys() == g_ckpt.keys()
    for key in g_fused:
        assert g_fused[key].dtype == g_ckpt[key].dtype
        assert torch.count_nonzero(g_fused[key]) > 0, key
        torch.testing.assert_close(g_fused[key], g_ckpt[key], **tol, msg=key)


def test_fused_loss_under_no_grad_equals_checkpointed_and_builds_no_graph():
    case = FUSED_CASES["reduced_vocab"]
    with torch.no_grad():
        outs = [drafter_loss(s, **heads, config=LossConfig(chunk_size=4, fused=fused))
                for fused in (True, False) for s, heads in [_fused_case(**case)]]
    assert not outs[0].loss.requires_grad
    torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(outs[0].stats, outs[1].stats, rtol=0, atol=0)


def test_fused_backward_does_no_vocabulary_projection():
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for fused in (True, False):
        s, heads = _fused_case(37, dtype=torch.float32)
        out = drafter_loss(s, **heads, config=LossConfig(chunk_size=8, fused=fused))
        with FlopCounterMode(display=False) as counter:
            out.loss.backward()
        flops[fused] = counter.get_total_flops()
    assert flops[True] == 0  # only scales the gradients saved by the forward
    assert flops[False] >= 2 * 2 * 37 * 50 * 8  # recomputes lm_head h and the target's, then d/dh


def test_fused_loss_rejects_a_trainable_lm_head():
    s, heads = _fused_case(4)
    heads["lm_head"] = heads["lm_head"].clone().requires_grad_()
    with pytest.raises(ValueError, match="fused=False"):
        drafter_loss(s, **heads, config=LossConfig())
    drafter_loss(s, **heads, config=LossConfig(fused=False)).loss.backward()
    assert heads["lm_head"].grad is not None


@pytest.mark.parametrize("weights", [(0.0, 1.0), (0.3, 0.7)], ids=["tv_only", "ce_and_tv"])
def test_fused_closed_form_gradient_matches_finite_differences(weights):
    # d tv / dz = p (s - <s, p>), d ce / dz = p - onehot(y), through lm_head, W2 u and a reduced vocabulary
    s, heads = _fused_case(5, conf=False, H=4, R=3, V=9, draft_ids=torch.tensor([0, 2, 3, 5, 8]), ignored=(1,),
                           seed=3)
    config = LossConfig(ce_weight=weights[0], tv_weight=weights[1], chunk_size=2, fused=True)

    def loss(hidden, u, w2):
        s2 = _slots(hidden, s.target_hidden, s.labels, s.slot, s.block, u=u, num_blocks=s.num_blocks, gamma=3)
        return drafter_loss(s2, **{**heads, "markov_w2": w2}, config=config).loss

    assert torch.autograd.gradcheck(loss, (s.hidden, s.bias_features, heads["markov_w2"]), eps=1e-6, atol=1e-7,
                                    fast_mode=True)
