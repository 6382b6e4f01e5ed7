"""Calibrate stage: per-block confidence/c* collection and STS wiring (the stage end to end:
tests/integration/test_calibrate_stage.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.stages.calibrate import (ConfidenceSet, calibrate_drafter, collect_confidence, load_confidence,
                                realised_confidence, save_confidence)
from pipeline.errors import PipelineError
from pipeline.target_model.prefill import TargetPrefill
from training.target_weights import load_shared_weights
from training.blocks import collate_samples
from training.drafter import Drafter, DrafterConfig
from training.losses import LossConfig, confidence_labels, expected_tau

IDS = [0, 2]


@pytest.fixture(scope="module")
def held_out(tiny_target_dir):
    """Five cache-like samples prefilled by the tiny target (features of layers 0 and 2)."""
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 512, (n,), generator=g).numpy() for n in (30, 41, 25, 36, 33)]
    masks = [np.r_[np.zeros(6, np.uint8), np.ones(len(x) - 6, np.uint8)] for x in ids]
    outs = TargetPrefill(target, IDS)(ids, masks)
    return [{"input_ids": torch.as_tensor(x), "loss_mask": torch.as_tensor(m), "features": o.features,
             "last_hidden": o.last_hidden} for x, m, o in zip(ids, masks, outs)]


@pytest.fixture(scope="module")
def drafter(tiny_target_dir):
    embed, lm_head = load_shared_weights(tiny_target_dir)
    tc = AutoConfig.from_pretrained(tiny_target_dir, local_files_only=True)
    torch.manual_seed(0)
    model = Drafter(DrafterConfig(target_layer_ids=IDS, mask_token_id=5, num_layers=1, block_size=4,
                                  markov_rank=8, num_anchors=6), tc, embed, lm_head)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(0, 0.5)   # a non-zero Markov bias, as after training
        model.confidence_head.proj.weight.normal_(0, 0.5)
    return model.eval()


def test_collect_matches_the_inference_path_per_block(drafter, held_out):
    batches = [held_out[:3], held_out[3:]]
    data = collect_confidence(drafter, batches, LossConfig(), seed=7)
    # the rows are the blocks of each batch in (sample, anchor) order, blocks with a valid slot only
    rows = []
    for i, samples in enumerate(batches):
        batch = collate_samples(samples)
        blocks = drafter.make_blocks(batch, torch.Generator().manual_seed(7 + i))
        for b in range(len(samples)):
            for n in range(blocks.anchors.shape[1]):
                if blocks.valid[b, n, 0]:
                    rows.append((samples[b], int(blocks.anchors[b, n]), blocks.valid[b, n]))
    assert data.num_blocks == len(rows) == 5 * 6          # every sample has >= 6 anchor candidates
    assert data.z.shape == data.y.shape == data.valid.shape == (30, 4)
    assert torch.equal(data.valid, torch.stack([v for _, _, v in rows]))
    assert not data.valid[:, 0].logical_not().any() and (data.y[~data.valid] == 0).all()
    assert ((data.y >= 0) & (data.y <= 1)).all()
    # slot 1 of each row recomputed through the inference path: confidence logit and c* = 1 - TV
    for r in (0, 11, 29):
        sample, a, _ = rows[r]
        ctx = drafter.encode_context(sample["features"][:a].float())
        res = drafter.draft_block(ctx, int(sample["input_ids"][a]), temperature=1.0)
        sup_row = int(sample["loss_mask"][1:a + 2].sum()) - 1       # last_hidden row of position a
        p_t = torch.softmax(sample["last_hidden"][sup_row].float() @ drafter.lm_head.weight.t(), -1)
        c_star = 1 - 0.5 * (res.q[0] - p_t).abs().sum()
        assert float(data.z[r, 0]) == pytest.approx(float(res.confidence_logits[0]), abs=1e-4)
        assert float(data.y[r, 0]) == pytest.approx(float(c_star), abs=1e-4)
    again = collect_confidence(drafter, batches, LossConfig(), seed=7)
    assert torch.equal(again.z, data.z) and torch.equal(again.y, data.y)
    assert not torch.equal(collect_confidence(drafter, batches, LossConfig(), seed=8).z, data.z)


def test_realised_labels_are_the_drafters_own_acceptance(drafter, held_out):
    # the same blocks as the teacher-forced set; at T = 0 a draft is accepted iff its argmax is the
    # target's, so the realised survival is the running product of the greedy labels c*(T=0)
    batches = [held_out[:3], held_out[3:]]
    expected = collect_confidence(drafter, batches, LossConfig(), seed=7)
    data, tau_expected = realised_confidence(drafter, batches, sampling=0.0, num_anchors=6, seed=7)
    assert torch.equal(data.valid, expected.valid) and torch.equal(data.batch, expected.batch)
    assert torch.allclose(data.z, expected.z, atol=1e-5)
    assert tau_expected == pytest.approx(float(expected_tau(expected.y, expected.valid).mean()), rel=1e-5)
    greedy = []
    for i, samples in enumerate(batches):
        batch = collate_samples(samples)
        blocks = drafter.make_blocks(batch, torch.Generator().manual_seed(7 + i))
        slots = drafter(batch, blocks)
        g = confidence_labels(slots.hidden, slots.bias_features, slots.target_hidden, lm_head=drafter.lm_head.weight,
                              markov_w2=drafter.markov_head.markov_w2.weight,
                              target_lm_head=drafter.target_lm_head_weight, draft_to_target=None, sampling=0.0,
                              chunk_size=64)
        grid = torch.zeros(slots.num_blocks, 4)
        grid[slots.block, slots.slot] = g
        greedy.append(grid[blocks.valid.view(-1, 4)[:, 0]])
    survival = torch.cumprod(torch.cat(greedy), 1) * data.valid
    assert torch.equal(data.y, survival) and 0 < data.y[:, 0].sum() < data.num_blocks
    assert ((data.y[:, 1:] <= data.y[:, :-1]) | ~data.valid[:, 1:]).all()          # prefix-closed 0/1
    report = calibrate_drafter(data, n_bins=10, grid_step=0.05, label="realised")
    assert report["label"] == "realised_acceptance"


def test_collect_refuses_a_drafter_without_confidence_head(tiny_target_dir, held_out):
    embed, lm_head = load_shared_weights(tiny_target_dir)
    tc = AutoConfig.from_pretrained(tiny_target_dir, local_files_only=True)
    model = Drafter(DrafterConfig(target_layer_ids=IDS, mask_token_id=5, num_layers=1, block_size=4, markov_rank=0,
                                  confidence_head=False), tc, embed, lm_head)
    with pytest.raises(PipelineError, match="no confidence head"):
        collect_confidence(model, [held_out], LossConfig(), seed=0)


def test_calibrate_drafter_recovers_known_temperatures():
    # logits twice too sharp at every position (labels = the true acceptance): STS finds T = 2
    g = torch.Generator().manual_seed(1)
    c = torch.rand(4000, 3, generator=g) * 0.9 + 0.05
    valid = torch.ones(4000, 3, dtype=torch.bool)
    valid[:1000, 2] = False
    batch = torch.arange(4000) // 100                 # 40 batches: even ones fit, odd ones report
    report = calibrate_drafter(ConfidenceSet(2 * torch.logit(c), c, valid, batch), n_bins=10, grid_step=0.05)
    assert report["temperatures"] == pytest.approx([2.0, 2.0, 2.0], abs=0.01)
    assert report["global_temperature"] == pytest.approx(2.0, abs=0.011)
    assert report["fit_blocks"] == report["report_blocks"] == 2000
    assert [p["n"] for p in report["positions"]] == [2000, 2000, 1500]   # the report half only
    assert report["num_blocks"] == 4000 and report["label"] == "expected_acceptance" and report["n_bins"] == 10
    assert report["sts"]["at_bounds"] == [] and report["sts"]["min_blocks"] == 200
    for p in report["positions"]:
        assert p["after"]["ece"] < 0.01 < p["before"]["ece"] and p["global"]["ece"] < 0.01


def test_refit_and_gate_prompts_come_after_the_sts_and_block_level_samples_when_there_are_enough():
    """The refit and gate prompts are conversations neither STS (``calibrate.max_samples``) nor the
    block-level evaluation (``evaluate.block_samples``, the first held-out samples too) reads, when the
    held-out shards hold them; else the first ones (the tiny default: 128 held-out samples for all)."""
    from types import SimpleNamespace

    from pipeline.stages.calibrate import HeldoutSelection, prompt_start, sample_prompts

    def cfg(refit, gate, blocks):
        return SimpleNamespace(calibrate=SimpleNamespace(refit_prompts=refit, gate_prompts=gate),
                               evaluate=SimpleNamespace(block_samples=blocks))

    recipe = HeldoutSelection(shards=(30, 31), samples_used=256, samples_available=2048)  # Qwen3-4B: 16 x 128
    assert prompt_start(cfg(128, 128, 256), recipe) == 256
    assert prompt_start(cfg(128, 128, 1024), recipe) == 1024
    assert prompt_start(cfg(1024, 1024, 256), recipe) == 0          # 1,792 left past them: too few
    tiny = HeldoutSelection(shards=(22, 23), samples_used=128, samples_available=128)
    assert prompt_start(cfg(64, 64, 128), tiny) == 0

    class Reader:  # CacheReader.sample_tokens of two shards: (input_ids, loss_mask) per sample
        def sample_tokens(self, shards):
            assert list(shards) == [7, 8]
            for i in range(6):  # sample 3 has no supervised token
                mask = torch.zeros(5 + i, dtype=torch.uint8)
                mask[2 + i % 2:] = i != 3
                yield torch.arange(100 * i, 100 * i + 5 + i, dtype=torch.int32), mask
    assert sample_prompts(Reader(), [7, 8], 2, 3) == [[200, 201], [400, 401], [500, 501, 502]]
    assert sample_prompts(Reader(), [7, 8], 0, 1) == [[0, 1]]


def test_refit_pools_the_serving_setting_and_greedy_rounds(monkeypatch):
    """The refit decodes its prompts at the head's serving setting and greedily (``calibrate.refit_greedy``)
    and fits one head on both settings' rows. Toy case with a known answer: at the serving setting a
    slot is accepted when feature 0 is high, greedily when feature 1 is; a head fitted on both ranks
    both settings' slots, one fitted on the serving rounds alone does not rank the greedy ones."""
    from types import SimpleNamespace

    import pipeline.stages.calibrate as cal
    from training.spec_sampling import Sampling
    from training.sts import auc

    serving = Sampling(0.7, 0.8, 20)
    cfg = lambda greedy: SimpleNamespace(calibrate=SimpleNamespace(refit_greedy=greedy, refit_max_new_tokens=8),
                                         train=SimpleNamespace(seed=3))
    assert cal.refit_settings(cfg(True), serving) == [serving, Sampling(0.0)]
    assert cal.refit_settings(cfg(False), serving) == [serving]
    assert cal.refit_settings(cfg(True), Sampling(0.0, 0.8, 20)) == [Sampling(0.0, 0.8, 20)]  # greedy already
    assert cal.refit_settings(cfg(True), 1.0) == [Sampling(1.0), Sampling(0.0)]  # a plain temperature

    def rows(setting, n=4000, prompts=40):
        g = torch.Generator().manual_seed(int(setting.temperature * 10))
        x = torch.randn(n, 3, generator=g)
        signal = x[:, 1] if setting.temperature == 0 else x[:, 0]
        y = (signal + 0.5 * torch.randn(n, generator=g) > 0).float()
        return x, y, torch.arange(n) % prompts, torch.zeros(n)

    calls = []

    def onpolicy(target, tap, stop, drafter, prompts, *, sampling, max_new_tokens, seed):
        calls.append((sampling, max_new_tokens, seed))
        return rows(sampling)

    monkeypatch.setattr(cal, "onpolicy_rounds", onpolicy)
    heads = {}
    for greedy in (True, False):
        model = SimpleNamespace(confidence_head=SimpleNamespace(proj=torch.nn.Linear(3, 1)))
        calls.clear()
        out = cal.refit_confidence_head(cfg(greedy), model, None, None, set(), [[1]] * 40, serving, "digest")
        settings = [serving, Sampling(0.0)] if greedy else [serving]
        assert calls == [(s, 8, 3) for s in settings]
        assert out["settings"] == [s.to_dict() for s in settings]
        assert out["slots_per_setting"] == [4000] * len(settings) and out["slots"] == 4000 * len(settings)
        assert out["adopted"] and out["heldout_auc"]["trained"] == 0.5 and out["replaces"] == "digest"
        by_setting = out["heldout_auc_by_setting"]                # held-out prompts, per setting
        assert len(by_setting) == len(settings) and all(a["trained"] == 0.5 for a in by_setting)
        assert by_setting[0]["refit"] > 0.75 and (not greedy or by_setting[1]["refit"] > 0.75)
        torch.testing.assert_close(model.confidence_head.proj.weight.data, out["weight"])
        heads[greedy] = out["weight"][0], out["bias"]
    for setting in (serving, Sampling(0.0)):
        x, y, _, _ = rows(setting)
        score = lambda greedy: auc(x @ heads[greedy][0] + heads[greedy][1], y > 0.5)
        assert score(True) > 0.75                             # the pooled head ranks both settings' slots
        if setting.temperature == 0:
            assert score(False) < 0.6                         # the serving-only head misses greedy acceptance


def test_confidence_set_round_trip():
    data = ConfidenceSet(torch.randn(5, 3), torch.rand(5, 3), torch.tensor([[1, 1, 0]] * 5, dtype=torch.bool))
    save_confidence("memory://cal/confidence.safetensors", data)
    back = load_confidence("memory://cal/confidence.safetensors")
    assert torch.equal(back.z, data.z) and torch.equal(back.y, data.y) and torch.equal(back.valid, data.valid)
