"""init: pretrained: a published drafter in each export format starts training where the export
stands (its weights, and the block-level tau at step 0 equal to the exported drafter's); a drafter of
another layout is refused naming each field and the key to set."""
import pytest
import torch

from pipeline.drafters import build_drafter, prepare_pretrained
from pipeline.errors import ConfigError
from pipeline.run import DEFAULT_CONFIG, load_config
from pipeline.stages.export_format import export_drafter, load_export
from training.block_runner import evaluate_blocks
from training.drafter import FROZEN_STATE as FROZEN


def _cfg(tiny_target_dir, run_dir, *extra):
    return load_config(DEFAULT_CONFIG, [f"target.path={tiny_target_dir}", f"run_dir={run_dir}",
                                        "target.target_layer_ids=[0,2]", "train.drafters.dspark.markov_rank=16",
                                        "train.drafters.dspark.block_size=4", "train.drafters.dflash.block_size=4",
                                        "train.drafters.dspark.init=random", "train.drafters.dflash.init=random",
                                        "~train.drafters.eagle3", *extra])


def _published(cfg, name, tiny_target_dir, out, fmt):
    """A drafter as someone else trained it: every trainable weight moved off its initial value."""
    torch.manual_seed(7)
    model = build_drafter(cfg.train.drafters[name], cfg, tiny_target_dir)
    with torch.no_grad():
        for k, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    export_drafter(model, tiny_target_dir, str(out), fmt=fmt)
    return model


@pytest.mark.parametrize("fmt", ["native", "speculators"])  # native = vLLM's, z-lab dflash's and SpecForge's layout
@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_round_trip_export_then_pretrained_init_gives_the_same_step_zero_tau(tmp_path, tiny_target_dir,
                                                                             drafter_samples, fmt, name):
    cfg = _cfg(tiny_target_dir, tmp_path / "a")
    _published(cfg, name, tiny_target_dir, tmp_path / "export", fmt)
    exported = load_export(str(tmp_path / "export"), tiny_target_dir)
    cfg = _cfg(tiny_target_dir, tmp_path / "b", f"train.drafters.{name}.init=pretrained",
               f"train.drafters.{name}.pretrained_path={tmp_path / 'export'}")
    info = prepare_pretrained(cfg, name, tiny_target_dir)
    # tiny.yaml's dflash has a confidence head; vLLM's DFlash format drops it: it starts fresh
    assert info["fresh"] == (["confidence_head"] if name == "dflash" else [])
    step0 = build_drafter(cfg.train.drafters[name], cfg, tiny_target_dir).eval()  # what the workers build
    assert step0.config.init == "pretrained" and step0.config.init_path == info["init_url"]
    theirs = exported.state_dict()
    ours = {k: v for k, v in step0.state_dict().items() if k not in FROZEN and not k.startswith("confidence_head")}
    assert ours.keys() <= theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    if name == "dflash":
        step0.confidence_head = None  # what the export serves: no head (the paired tally compares drafts only)
    tally = evaluate_blocks({"exported": exported, "step0": step0}, [drafter_samples], temperatures=[0.0, 1.0],
                            num_anchors=6, seed=3, records={})
    for T in (0.0, 1.0):
        a, b = tally.values("exported", T, "tau"), tally.values("step0", T, "tau")
        assert a.numel() > 6 and torch.equal(a, b)


def test_another_layout_is_refused_naming_the_fields(tmp_path, tiny_target_dir):
    cfg = _cfg(tiny_target_dir, tmp_path / "a")
    _published(cfg, "dspark", tiny_target_dir, tmp_path / "export", "native")
    cfg = _cfg(tiny_target_dir, tmp_path / "b", "train.drafters.dspark.init=pretrained",
               f"train.drafters.dspark.pretrained_path={tmp_path / 'export'}", "train.drafters.dspark.block_size=5",
               "target.target_layer_ids=[0,1]")
    with pytest.raises(ConfigError) as e:
        prepare_pretrained(cfg, "dspark", tiny_target_dir)
    msg = str(e.value)
    assert "block_size: the export has 4, the config says 5 (set train.drafters.dspark.block_size=4)" in msg
    assert "target_layer_ids: the export has [0,2], the config says [0,1] (set target.target_layer_ids=[0,2])" in msg
    with pytest.raises(ConfigError, match="pretrained_path: is required with init: pretrained"):
        _cfg(tiny_target_dir, tmp_path / "c", "train.drafters.dspark.init=pretrained")
    with pytest.raises(ConfigError, match="is read only with init: pretrained"):
        _cfg(tiny_target_dir, tmp_path / "c", f"train.drafters.dspark.pretrained_path={tmp_path}")
