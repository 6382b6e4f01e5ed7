"""``evaluate_blocks(sequential=True)`` drafts a sequential head's blocks slot by slot, as the drafter is
served: slot k's head is fed the token drawn at slot k - 1, not the cached one (the default, teacher
forcing, feeds the cached one; training/block_runner.py says why it stays the default). Checked against
a plain per-block loop written here from the formulas."""
from __future__ import annotations

import importlib.util

import torch

from training.block_eval import block_uniforms
from training.block_runner import block_slots, evaluate_blocks, slot_logits
from training.blocks import collate_samples, sample_anchors
from training.spec_sampling import temperature_probs
from paths import REPO

_spec = importlib.util.spec_from_file_location("bench_eval_memory",
                                               REPO / "bench" / "bench_eval_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

V, SEED, ANCHORS, MARKOV_SCALE = 60, 5, 9, 6.0


def _samples():
    """Random cache samples with a flat target (final hidden states scaled down), so blocks accept drafts."""
    samples = bench.random_samples(V, lengths=(40, 31), seed=0)
    for s in samples:
        s["last_hidden"] = (s["last_hidden"].float() * 0.05).bfloat16()
    return samples


def _reference_accepted(model, samples, T: float) -> torch.Tensor:
    """Accepted drafts per block, one block and one slot at a time: x_k drawn from
    softmax((U_k + W2 W1[x_{k-1}]) / T) by the inverse CDF of u_draw (argmax at T = 0), accepted iff
    u_accept q(x) < p(x) (x == argmax p at T = 0), the next slot fed x_k."""
    batch = collate_samples(samples)
    anchors, keep = sample_anchors(batch.loss_mask, ANCHORS, torch.Generator().manual_seed(SEED))
    kept = keep.flatten().nonzero().squeeze(1)
    u_draw, u_accept = block_uniforms(SEED, 0, kept.numel(), model.config.block_size)
    slots = block_slots(model, batch, anchors, keep)
    _, p_all = slot_logits(model, slots, torch.arange(slots.labels.numel()))
    head, w = model.markov_head, model.lm_head.weight
    out = []
    for i, b in enumerate(kept.tolist()):
        rows = (slots.block == b).nonzero().squeeze(1)
        rows = rows[slots.slot[rows].argsort()]
        prev, accepted = slots.prev_ids[rows[0]], 0
        for k, row in enumerate(rows.tolist()):
            q_logits = slots.hidden[row] @ w.t() + head.bias(head.embed(prev))
            p_logits = p_all[row]
            if T == 0:
                x = int(q_logits.argmax())
                ok = x == int(p_logits.argmax())
            else:
                q, p = temperature_probs(q_logits.double(), T), temperature_probs(p_logits.double(), T)
                cdf = q.cumsum(0)
                x = min(int(torch.searchsorted(cdf, u_draw[i, k] * cdf[-1], right=True)), V - 1)
                ok = bool(u_accept[i, k] * q[x] < p[x])
            if not ok:
                break
            accepted, prev = accepted + 1, torch.tensor(x)
        out.append(accepted)
    return torch.tensor(out)


def _drafter():
    model = bench.random_drafter(V, block_size=5, markov_rank=8, seed=2)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.mul_(MARKOV_SCALE)  # a head that matters: its bias moves q
    return model


def test_sequential_drafting_matches_the_per_block_loop_and_differs_from_teacher_forcing():
    model = _drafter()
    samples = _samples()
    seq = evaluate_blocks({"d": model}, [samples], temperatures=[0.0, 1.0], num_anchors=ANCHORS, seed=SEED,
                          sequential=True)
    tf = evaluate_blocks({"d": model}, [samples], temperatures=[0.0, 1.0], num_anchors=ANCHORS, seed=SEED,
                         sequential=False)
    for T in (0.0, 1.0):
        ref = _reference_accepted(model, samples, T)
        assert ref.numel() > 10 and torch.equal(seq.values("d", T, "tau") - 1, ref.double()), T
    at_1 = seq.values("d", 1.0, "tau") - 1
    assert at_1.mean() > 0.3  # the blocks accept drafts: the comparison is not vacuous
    assert not torch.equal(tf.values("d", 1.0, "tau") - 1, at_1)  # teacher forcing scores other blocks


def test_a_drafter_without_a_head_is_unchanged_and_records_carry_the_drawn_confidence():
    dflash = bench.random_drafter(V, block_size=5, markov_rank=0, confidence_head=False, seed=3)
    samples = _samples()
    kw = dict(temperatures=[0.0, 1.0], num_anchors=ANCHORS, seed=SEED)
    a, b = evaluate_blocks({"d": dflash}, [samples], sequential=True, **kw), evaluate_blocks({"d": dflash}, [samples], **kw)
    for T in (0.0, 1.0):
        assert torch.equal(a.values("d", T, "tau"), b.values("d", T, "tau"))
    model, rec = _drafter(), {}
    evaluate_blocks({"d": model}, [samples], records=rec, sequential=True, **kw)
    z0, z1 = torch.cat(rec[("d", 0.0)]["z"]), torch.cat(rec[("d", 1.0)]["z"])
    assert z0.shape == z1.shape and torch.equal(z0[:, 0], z1[:, 0])  # slot 1: the same (cached) x_0
    assert not torch.equal(z0, z1)  # later slots: each setting's own drawn x_{k-1}
