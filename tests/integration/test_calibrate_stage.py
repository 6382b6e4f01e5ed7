"""Calibrate stage: the stage end to end, then export, on a trained drafter (the collection and STS wiring:
tests/unit/pipeline/test_calibrate.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.stages.calibrate import load_confidence


@pytest.mark.integration
@pytest.mark.gpu_path
def test_calibrate_and_export_stages_on_a_trained_drafter(tmp_path, ray_local, tiny_target_dir, monkeypatch):
    """Train (6 steps; checkpoints at steps 2, 4, 6 with ``train.keep_checkpoints=2``: 4 and 6 remain),
    calibrate and export; then calibrate again in bf16 on ``calibrate.max_samples=5`` of the held-out
    samples, the first ones in stored order (the GPU-path bounds: tests/unit/pipeline/test_limits.py)."""
    from cache_schema import CacheReader
    from checkpointdirs import _folders
    from training.checkpoint import latest_checkpoint
    from chatgen import write_chats
    from test_train_stage import _cfg

    from pipeline.stages.cache import cache_url, run_cache
    from pipeline.stages.calibrate import run_calibrate
    from pipeline.stages.export import run_export
    from pipeline.stages.train import run_train

    data = tmp_path / "chats.jsonl"
    write_chats(data, 80)
    cfg = _cfg(tiny_target_dir, tmp_path / "run", data, "train.max_steps=6", "train.checkpoint_every_steps=2",
               "train.keep_checkpoints=2",
               "++train.drafters.dflash={num_layers: 1, block_size: 7, sample_from_anchor: true, mask_token_id: 5, "
               "head: none, markov_rank: 0, confidence_head: false}", "calibrate.bins=10",
               "calibrate.refit_prompts=12", "calibrate.refit_max_new_tokens=32")
    run_cache(cfg)
    run_train(cfg)
    train_url = str(tmp_path / "run" / "train" / "dspark")  # pruned after each commit: the newest two remain
    assert _folders(train_url) == {"step-000004": True, "step-000006": True}
    found = latest_checkpoint(train_url)
    assert found[0].endswith("step-000006") and found[1]["step"] == 6
    summary = run_calibrate(cfg)
    assert summary["heldout_shards"] == [3]                       # 80 rows / 20 per shard: the last one
    assert summary["drafters"]["dflash"] == {"skipped": "no confidence head"}
    s = summary["drafters"]["dspark"]
    out = tmp_path / "run" / "calibrate" / "dspark"
    report = json.loads((out / "report.json").read_text())
    assert len(s["temperatures"]) == 7 and s["temperatures"] == report["temperatures"]
    assert s["num_blocks"] == report["num_blocks"] == report["fit_blocks"] + report["report_blocks"]
    assert report["positions"][0]["n"] == report["report_blocks"] > 0      # reported out-of-sample
    assert s["ece_after"][0] <= s["ece_before"][0]                # position 1: never worse than T = 1
    saved = load_confidence(str(out / "confidence.safetensors"))
    y, valid = saved.y, saved.valid
    # the default: realised 0/1 prefix survival of the drafter's own drafts at its confidence setting
    assert report["label"] == s["label"] == "realised_acceptance"
    assert s["confidence_sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}  # the generate setting
    assert set(y[valid].unique().tolist()) <= {0.0, 1.0} and ((y[:, 1:] <= y[:, :-1]) | ~valid[:, 1:]).all()
    assert s["block_size"] == 7 and 1.0 < s["heldout_tau_expected"] < 8.0
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved.num_blocks == s["num_blocks"]
    # the on-policy refit: the drafter's own decoding rounds on the first 12 held-out samples' prompts
    refit = s["refit"]
    assert refit == report["refit"] and refit["prompts"] == 12 and refit["slots"] > refit["accepted_slots"] > 0
    assert refit["settings"] == [s["confidence_sampling"], {"temperature": 0.0, "top_p": 1.0, "top_k": 0}]
    assert sum(refit["slots_per_setting"]) == refit["slots"] and min(refit["slots_per_setting"]) > 0
    assert refit["adopted"] == (refit["heldout_auc"]["refit"] > refit["heldout_auc"]["trained"])
    head_file = out / "confidence_head.safetensors"
    assert head_file.exists() == refit["adopted"]
    # the gate rounds: the 8 held-out samples after the refit's, decoded with the kept head at its setting
    from pipeline.drafters import head_digest, load_trained_drafter
    from pipeline.inference.realised import load_outcomes

    gate = s["gate"]
    assert gate == report["gate"] and gate["prompts"] == 8 and gate["rounds"] >= gate["full_blocks"] > 0
    assert gate["sampling"] == s["confidence_sampling"]
    rounds = load_outcomes(str(out / "gate_rounds.safetensors"))
    assert rounds.num_blocks == gate["rounds"] and set(rounds.group.tolist()) <= set(range(8))
    assert bool((rounds.accepted <= rounds.verified).all()) and rounds.gamma == 7
    assert gate["head"] == head_digest(load_trained_drafter(cfg, "dspark", cfg.target.path, calibrated=True))

    exported = run_export(cfg)
    assert "sample_from_anchor=false" in exported["skipped"]["dflash"]
    e = exported["drafters"]["dspark"]
    conf = json.loads((tmp_path / "run/export/dspark/config.json").read_text())
    assert e["architecture"] == "Qwen3DSparkModel" and e["confidence"] in ("folded", "config")
    T = report["temperatures"]
    if e["confidence"] == "config":
        assert conf["confidence_temperatures"] == T and e["ece_vllm"] == e["ece_before"]
    else:
        assert conf["confidence_temperatures"] == pytest.approx([t / e["folded_temperature"] for t in T])
    assert e["ece_sts"] == s["ece_after"] and len(e["ece_vllm"]) == 7 and not any(map(math.isnan, e["ece_vllm"]))
    assert Path(e["path"], "model.safetensors").stat().st_size == e["bytes"]
    if refit["adopted"]:  # export ships the refitted head (scaled by the folded temperature, if folded)
        from safetensors.torch import load_file

        head, shipped = load_file(head_file), load_file(Path(e["path"], "model.safetensors"))
        fold = e["folded_temperature"] if e["confidence"] == "folded" else 1.0
        key = next(k for k in shipped if k.endswith("proj.weight") and "confidence" in k)
        torch.testing.assert_close(shipped[key].float() * fold, head["proj.weight"], rtol=1e-2, atol=1e-3)

    # On a GPU calibrate runs the drafter cast to the target's dtype (bf16; forced here on the CPU) and,
    # here, adopts its refit. The digests tying the refitted head to its checkpoint and the gate rounds to
    # their head are of the float32 weights, the ones export and evaluate compare: a digest of the bf16
    # copy made export raise StaleStageOutputError and evaluate drop the gate rounds, whatever the rerun.
    import dataclasses

    import training.block_runner as block_runner
    import training.confidence_refit as confidence_refit
    from pipeline.stages.evaluate import gate_outcomes

    cast, fit = block_runner.eval_drafter, confidence_refit.fit_logistic_head
    monkeypatch.setattr(block_runner, "eval_drafter", lambda model, device, dtype=None: cast(model, device, torch.bfloat16))
    monkeypatch.setattr(confidence_refit, "fit_logistic_head",
                        lambda *a, **kw: dataclasses.replace(fit(*a, **kw), heldout_auc={"refit": 1.0, "trained": 0.5}))
    # ... and on the first 5 held-out samples only (calibrate.max_samples): 5 samples in micro-batches of 4
    cfg = dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, max_samples=5))
    summary = run_calibrate(cfg)
    s = summary["drafters"]["dspark"]
    assert s["refit"]["adopted"] and s["gate"]["prompts"] == 8
    available = CacheReader(cache_url(cfg)).records[3].num_samples
    assert summary["heldout_shards"] == [3] and available > 5
    report = json.loads((out / "report.json").read_text())
    assert (s["samples_used"], s["samples_available"]) == (report["samples_used"], report["samples_available"]) == (5, available)
    assert int(load_confidence(str(out / "confidence.safetensors")).batch.max()) + 1 == 2  # two forward passes
    served = load_trained_drafter(cfg, "dspark", cfg.target.path, calibrated=True)
    assert served.confidence_head.proj.weight.dtype == torch.float32
    assert gate_outcomes(cfg, "dspark", head_digest(served))[1] == s["gate"]
    assert run_export(cfg)["drafters"]["dspark"]["architecture"] == "Qwen3DSparkModel"
