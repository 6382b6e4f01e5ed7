"""The confidence head's label at the serving sampling setting (issue #36 item 2): ``c*`` at T, top-p, top-k."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ConfigError, confidence_sampling
from pipeline.drafters import drafter_config
from pipeline.run import load_config
from training.heads import ConfidenceHead
from training.losses import LossConfig, SupervisedSlots, confidence_labels, drafter_loss
from training.sts import auc
from training.spec_sampling import Sampling

V = 10


def _labels(zd, zt, sampling):
    """confidence_labels with identity heads: the hidden states are the logits themselves."""
    eye = torch.eye(V, dtype=torch.float64)
    return confidence_labels(zd, None, zt, lm_head=eye, markov_w2=None, target_lm_head=eye, draft_to_target=None,
                             sampling=sampling, chunk_size=7)


def test_labels_at_one_zero_and_top_k():
    g = torch.Generator().manual_seed(0)
    zd, zt = torch.randn(50, V, generator=g, dtype=torch.float64), torch.randn(50, V, generator=g, dtype=torch.float64)
    pd, pt = torch.softmax(zd, -1), torch.softmax(zt, -1)
    assert torch.allclose(_labels(zd, zt, 1.0), (1 - 0.5 * (pd - pt).abs().sum(-1)).float(), atol=1e-6)
    greedy = (zd.argmax(-1) == zt.argmax(-1)).float()
    assert 0 < greedy.sum() < 50
    assert torch.equal(_labels(zd, zt, 0.0), greedy)
    assert torch.equal(_labels(zd, zt, Sampling(0.7, 1.0, 1)), greedy)       # top-k 1 is greedy at any T
    # T = 0.5, top-k 3: both distributions sharpened then truncated to their own 3 best tokens
    def trunc(z):
        p = torch.softmax(z / 0.5, -1)
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, p.topk(3).indices, True)
        return torch.where(keep, p, 0) / torch.where(keep, p, 0).sum(-1, keepdim=True)
    hand = torch.minimum(trunc(zd), trunc(zt)).sum(-1).float()
    assert torch.allclose(_labels(zd, zt, Sampling(0.5, 1.0, 3)), hand, atol=1e-6)


def _slots(zd, zt, kind_feature, conf_logits):
    M = zd.shape[0]
    hidden = torch.cat([zd, kind_feature], -1).float()
    return SupervisedSlots(hidden=hidden, bias_features=None, confidence_logits=conf_logits,
                           labels=zt.argmax(-1), slot=torch.zeros(M, dtype=torch.long), block=torch.arange(M),
                           target_hidden=torch.cat([zt, torch.zeros_like(kind_feature)], -1).float(),
                           num_blocks=M, block_size=1)


def _toy(n=200, seed=0):
    """Two kinds of slots. A: target and drafter near-uniform and alike (c*(1) ~ 0.99, greedy agreement
    a coin toss); B: both peaked on token 0, the drafter sharper (c*(1) ~ 0.71, greedy agreement 1)."""
    g = torch.Generator().manual_seed(seed)
    zt_a = 0.1 * torch.randn(n, V, generator=g)
    zd_a = zt_a + 0.1 * torch.randn(n, V, generator=g)
    peak = torch.zeros(n, V)
    peak[:, 0] = 1
    zt_b, zd_b = 3 * peak, 6 * peak
    kind = torch.cat([torch.tensor([[1.0, 0.0]]).expand(n, 2), torch.tensor([[0.0, 1.0]]).expand(n, 2)])
    return torch.cat([zd_a, zd_b]), torch.cat([zt_a, zt_b]), kind


def _train_head(zd, zt, kind, sampling, steps=120):
    torch.manual_seed(0)
    head = ConfidenceHead(V + 2)
    opt = torch.optim.Adam(head.parameters(), lr=0.3)
    eye = torch.cat([torch.eye(V), torch.zeros(V, 2)], 1)
    for _ in range(steps):
        slots = _slots(zd, zt, kind, None)
        slots.confidence_logits = head(slots.hidden, None)
        out = drafter_loss(slots, lm_head=eye, target_lm_head=eye, markov_w2=None, draft_to_target=None,
                           config=LossConfig(ce_weight=0.0, tv_weight=0.0), confidence_sampling=sampling)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return head


def test_a_head_trained_on_matched_labels_learns_greedy_acceptance():
    zd, zt, kind = _toy()
    n = zd.shape[0] // 2
    greedy = (zd.argmax(-1) == zt.argmax(-1)).float()
    c1 = _labels(zd.double(), zt.double(), 1.0)
    assert 0.2 < float(greedy[:n].mean()) < 0.8 and float(greedy[n:].mean()) == 1.0
    assert float(c1[:n].mean()) > 0.95 and 0.65 < float(c1[n:].mean()) < 0.75
    hidden = _slots(zd, zt, kind, None).hidden
    matched, t1 = _train_head(zd, zt, kind, 0.0), _train_head(zd, zt, kind, 1.0)
    with torch.no_grad():
        c_matched, c_t1 = torch.sigmoid(matched(hidden, None)), torch.sigmoid(t1(hidden, None))
    # the BCE minimiser over a per-kind constant is each kind's mean label: greedy agreement when matched
    assert float(c_matched[:n].mean()) == pytest.approx(float(greedy[:n].mean()), abs=0.03)
    assert float(c_matched[n:].mean()) > 0.97
    assert float(c_t1[:n].mean()) == pytest.approx(float(c1[:n].mean()), abs=0.03)
    assert float(c_t1[n:].mean()) == pytest.approx(float(c1[n:].mean()), abs=0.03)
    # ranked against greedy outcomes: matched labels rank B (always accepted) above A, T = 1 labels the reverse
    assert auc(c_matched, greedy > 0.5) > 0.75 > 0.25 > auc(c_t1, greedy > 0.5)


def test_the_option_changes_only_the_confidence_term():
    zd, zt, kind = _toy(n=50, seed=3)
    eye = torch.cat([torch.eye(V), torch.zeros(V, 2)], 1)
    conf = torch.linspace(-2, 2, zd.shape[0])
    outs, grads = {}, {}
    for s in (1.0, Sampling(1.0), 0.0, Sampling(0.7, 0.8, 20)):
        slots = _slots(zd, zt, kind, conf.clone().requires_grad_())
        slots.hidden.requires_grad_()
        out = drafter_loss(slots, lm_head=eye, target_lm_head=eye, markov_w2=None, draft_to_target=None,
                           config=LossConfig(), confidence_sampling=s)
        out.loss.backward()
        outs[s], grads[s] = out, (slots.hidden.grad, slots.confidence_logits.grad)
    base = outs[1.0]
    slots = _slots(zd, zt, kind, conf.clone().requires_grad_())
    slots.hidden.requires_grad_()
    default = drafter_loss(slots, lm_head=eye, target_lm_head=eye, markov_w2=None, draft_to_target=None,
                           config=LossConfig())
    assert default.loss.item() == base.loss.item()                     # the default path: bit for bit
    assert outs[Sampling(1.0)].loss.item() == base.loss.item()
    for s in (0.0, Sampling(0.7, 0.8, 20)):
        o = outs[s]
        assert torch.equal(o.c_star, base.c_star)                        # c*, CE, TV and their gradients stay
        for m in ("ce", "tv", "tau_expected"):
            assert float(o.metrics[m]) == float(base.metrics[m])
        assert torch.equal(grads[s][0], grads[1.0][0])
        label = _labels(zd.double(), zt.double(), s)
        w = torch.ones_like(conf)
        bce = (w * F.binary_cross_entropy_with_logits(conf, label, reduction="none")).sum() / w.sum()
        assert float(o.metrics["confidence_bce"]) == pytest.approx(float(bce), rel=1e-5)
        assert abs(float(o.metrics["confidence_bce"]) - float(base.metrics["confidence_bce"])) > 0.05
        assert not torch.allclose(grads[s][1], grads[1.0][1])


def test_config_keys_reach_the_drafter_and_are_validated(tmp_path):
    cfg = load_config("conf/tiny.yaml", [f"run_dir={tmp_path}"])
    spec = cfg.train.drafters["dspark"]
    assert confidence_sampling(spec, cfg) == (0.7, 0.8, 20)  # the default: the generate stage's setting
    c = drafter_config(spec, cfg)
    assert c.confidence_sampling == Sampling(0.7, 0.8, 20) and c.confidence_sampling.truncates
    cfg = load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", "generate.temperature=0.6", "generate.top_k=0"])
    assert drafter_config(cfg.train.drafters["dspark"], cfg).confidence_sampling == Sampling(0.6, 0.8, 0)
    cfg = load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", "train.drafters.dspark.confidence_temperature=1"])
    c = drafter_config(cfg.train.drafters["dspark"], cfg)
    assert c.confidence_sampling == 1.0 and not c.confidence_sampling.truncates
    cfg = load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", "train.drafters.dspark.confidence_temperature=0",
                                         "train.drafters.dspark.confidence_top_k=5"])
    assert drafter_config(cfg.train.drafters["dspark"], cfg).confidence_sampling == Sampling(0.0, 1.0, 5)
    for key, value in (("confidence_temperature", -1), ("confidence_top_p", 0), ("confidence_top_k", -2),
                       ("confidence_calibration", "bogus")):
        with pytest.raises(ConfigError, match=f"train.drafters.dspark.{key}"):
            load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", f"train.drafters.dspark.{key}={value}"])
