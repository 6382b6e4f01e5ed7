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


def test_chunking_changes_nothing_and_saves_no_slot_by_vocab_tensor():
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
            out = drafter_loss(s, **heads, draft_to_target=None, config=LossConfig(chunk_size=size))
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


def _rank_main(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    s, heads = _random_slots(8)  # blocks 0,1 (6 slots) on rank 0, block 2 (2 slots) on rank 1
    rows = slice(0, 6) if rank == 0 else slice(6, 8)
    local = _subset(s, rows, 0 if rank == 0 else 2, 2 if rank == 0 else 1)
    out = drafter_loss(local, **heads, draft_to_target=None, config=LossConfig(chunk_size=4))
    out.loss.backward()
    torch.save({"loss": out.loss.detach(), "metrics": out.metrics, "w2": heads["markov_w2"].grad,
                "hidden": local.hidden.grad}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_global_normalisation_two_gloo_ranks_equal_one_rank(tmp_path):
    s, heads = _random_slots(8)
    one = drafter_loss(s, **heads, draft_to_target=None, config=LossConfig(chunk_size=4))
    one.loss.backward()
    # fork: the children inherit the imported, warmed-up torch (spawn would re-import it twice)
    mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert (r0["loss"] + r1["loss"]).item() == pytest.approx(one.loss.item(), abs=1e-6)
    assert torch.allclose(r0["w2"] + r1["w2"], heads["markov_w2"].grad, atol=1e-6)
    assert torch.allclose(torch.cat([r0["hidden"], r1["hidden"]]), s.hidden.grad, atol=1e-6)
    for r in (r0, r1):
        for key in ("loss", "tau_expected", "acceptance_per_position", "confidence_error", "weight_sum"):
            assert torch.allclose(r["metrics"][key], one.metrics[key], atol=1e-6), key
