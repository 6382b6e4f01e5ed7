"""Speculative decoding loop: greedy output equals the target's own; metrics; threshold policy."""
import pytest
import torch

from pipeline.config import DrafterSpec, RunConfig, SequentialHead
from pipeline.stages.evaluate import round_metrics
from pipeline.target_model.prefill import LayerTap
from pipeline.inference.speculate import Decoded, Round, plain_decode, speculative_decode, threshold_policy
from training.drafter import Drafter
from pipeline.drafters import drafter_config


@pytest.fixture(scope="module")
def setup(tiny_qwen3):
    cfg = RunConfig()
    spec = DrafterSpec(num_layers=1, block_size=4, mask_token_id=5, head=SequentialHead.markov, markov_rank=8)
    torch.manual_seed(1)
    m = tiny_qwen3
    drafter = Drafter(drafter_config(spec, cfg), m.config, m.model.embed_tokens.weight, m.lm_head.weight).eval()
    with torch.no_grad():  # a non-zero Markov bias, so the sequential head takes part
        drafter.markov_head.markov_w2.weight.normal_(0, 0.02)
    return m, drafter, LayerTap(m, cfg.target.target_layer_ids)


@pytest.mark.parametrize("threshold", [None, 0.5, 1.01])
def test_greedy_speculative_equals_target_greedy(setup, threshold):
    model, drafter, tap = setup
    prompt = [7, 8, 9, 10, 300, 41, 12]
    kw = dict(max_new_tokens=40, temperature=0.0, stop_ids=set())
    ref = plain_decode(model, prompt, generator=torch.Generator().manual_seed(0), **kw)
    policy = {} if threshold is None else {"policy": threshold_policy(threshold, None)}
    out = speculative_decode(model, drafter, prompt, tap=tap, generator=torch.Generator().manual_seed(0), **policy, **kw)
    assert out.tokens == ref.tokens and len(out.tokens) == 40
    verified = [r.verified for r in out.rounds]
    if threshold == 1.01:
        assert set(verified) == {0}  # nothing verified: plain decoding through the drafter loop
    elif threshold is None:
        assert set(verified) == {4}
    assert sum(r.accepted + 1 for r in out.rounds) + 1 >= 40


def test_threshold_policy_truncates_at_first_low_confidence():
    pol = threshold_policy(0.5, [1.0, 2.0, 1.0])
    z = torch.tensor([2.0, -0.5, 3.0])  # c = 0.88, sigmoid(-0.25) = 0.44 -> stop before position 2
    assert pol(z, 3) == 1
    assert threshold_policy(0.1, None)(z, 3) == 3
    assert threshold_policy(0.9, None)(z, 3) == 0
    assert pol(None, 3) == 3


def test_round_metrics_exact():
    rounds = [Round(4, 4, 4, None, 0.01, 0.02), Round(4, 4, 1, None, 0.01, 0.02), Round(4, 2, 2, None, 0.01, 0.02),
              Round(4, 4, 0, None, 0.01, 0.02)]
    m = round_metrics([Decoded(list(range(11)), rounds, seconds=2.0)], 4)
    assert m["tau"] == pytest.approx((5 + 2 + 3 + 1) / 4)
    assert m["verified_per_round"] == pytest.approx(3.5)
    # position 1: verified in all 4 rounds, accepted in 3; position 3: verified in 3 rounds
    assert m["survival"] == [0.75, 0.5, 1 / 3, 1 / 3]
    assert m["conditional_acceptance"] == [0.75, 2 / 3, 1.0, 1.0]  # pos 3: only round 1 reached it
    assert m["tokens_per_s"] == pytest.approx(5.5)
