"""`+stage=all` end to end on a reduced tiny config, with `run_dir` on the local S3 server.

A quick embedded build (a 3-layer Qwen3 trained for a few hundred steps on stdlib sources, its own
tokenizer, stdlib function chats split by module) stands in for the full one, so that the whole
recipe (generate, cache, train DFlash + DSpark, calibrate, export, evaluate) runs in a few minutes.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load

from ops.__main__ import main as ops_main
from pipeline.embedded.build import BuildSpec, ensure_embedded
from pipeline.embedded.target import TargetSpec
from pipeline.stages.export_format import check_tensors, expected_tensors
from pipeline.run import DEFAULT_CONFIG
from storage import filesystem, join, read_json

pytestmark = pytest.mark.integration

SPEC = BuildSpec(vocab_size=512, max_train_chats=96, max_heldout_chats=16, module_stride=6,
                 target=TargetSpec(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                                   intermediate_size=128, seq_len=128, batch_size=8, steps=300,
                                   warmup_steps=20, eval_tokens=8192))

REDUCED = ["generate.max_rows=48", "generate.rows_per_shard=16", "generate.max_new_tokens=48",
           "generate.batch_size=16", "cache.rows_per_shard=8", "data.max_length=256",
           "target.target_layer_ids=[0,1,2]", "train.epochs=3", "train.global_batch_samples=8",
           "train.micro_batch_samples=4", "train.checkpoint_every_steps=10",
           "train.drafters.dflash.block_size=4", "train.drafters.dspark.block_size=4", "train.drafters.eagle3.block_size=4",
           "train.drafters.dspark.markov_rank=16", "evaluate.num_prompts=4", "evaluate.max_new_tokens=24",
           "evaluate.concurrency=[1,8]", "evaluate.thresholds=[0.5]", "calibrate.refit_max_new_tokens=24",
           "calibrate.refit_prompts=8",  # the rest of the 16 held-out samples' prompts: the gate rounds
           # 6 optimizer steps: Muon (the tiny recipe's, tuned for thousands of steps) leaves DFlash
           # where it starts (held-out tau_expected 1.02, greedy block tau 1.000; AdamW: 1.77), so this
           # pipeline check trains on AdamW; Muon end to end is tests/integration/test_features_train.py's
           "train.optimizer=adamw"]


def test_all_stages_on_s3(tmp_path, s3_url, capsys):
    paths = ensure_embedded(tmp_path / "home", SPEC)
    run_dir = f"{s3_url}/run"
    gsm8k = tmp_path / "gsm8k.jsonl"  # two questions in GSM8K's layout: a second task of the decoding loop
    gsm8k.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in
                             ("Write a Python function that adds two numbers.", "How do I read a file line by line?")))
    tasks = ["~evaluate.prompt_sets", f"+evaluate.prompt_sets.stdlib.path={paths.heldout_chats}", "+evaluate.prompt_sets.stdlib.max_prompts=2",
             f"+evaluate.prompt_sets.gsm8k.path={gsm8k}", "+evaluate.prompt_sets.gsm8k.format=gsm8k"]
    cmd = [sys.executable, "-m", "pipeline.run", "+stage=all", str(DEFAULT_CONFIG), f"run_dir={run_dir}",
           f"target.path={paths.target_dir}", f"data.train_files=[{paths.train_chats}]",
           f"data.eval_files=[{paths.heldout_chats}]", *REDUCED, *tasks, "export.license=apache-2.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "| DSpark / DFlash |" in r.stdout  # the results table is printed

    s = {stage: read_json(join(run_dir, stage, "summary.json"))
         for stage in ("generate", "cache", "train", "calibrate", "export", "evaluate")}
    assert all(v["seconds"] > 0 for v in s.values())
    gen = s["generate"]
    assert gen["rows_in"] == 48 == gen["rows_kept"] + sum(gen["rows_failed"].values()) and gen["rows_kept"] > 24
    assert gen["new_tokens"] > 0
    assert s["generate"]["tokens_per_s"] > 0
    assert s["cache"]["samples"] > 0 and s["cache"]["supervised_tokens"] > 0
    assert s["cache"]["bytes_per_token"] > 0
    fs, _ = filesystem(run_dir)
    for name in ("dflash", "dspark", "eagle3"):
        assert s["train"]["drafters"][name]["steps"] == s["train"]["drafters"][name]["total_steps"] > 0
        rows = [json.loads(x) for x in fs.cat(join(run_dir, "train", name, "metrics.jsonl")).splitlines()]
        losses = [r["loss"] for r in rows]
        assert sum(losses[-3:]) < sum(losses[:3]), losses  # it learned
    # 4 prompts of 24 tokens are too few to show learning in the decoding loop (a 6-step DFlash may
    # accept nothing at T=0); the block-level evaluation (hundreds of held-out blocks) shows it
    for T in ("T=0", "T=1"):
        drafters = s["evaluate"]["results"][T]["drafters"]
        for name in ("dflash", "dspark", "eagle3"):
            overall = drafters[name]["overall"]
            assert overall["rounds"] > 0 and 1.0 <= overall["tau"] <= 5.0, (T, name, overall)
    blocks = s["evaluate"]["blocks"]["drafters"]
    for name in ("dflash", "dspark"):
        greedy, sampled = blocks[name]["0.0"], blocks[name]["1.0"]
        assert greedy["n"] == sampled["n"] > 100, (name, greedy["n"])
        assert greedy["tau"] > 1.0 + 3 * greedy["tau_se"] and sampled["tau"] > 1.0 + 3 * sampled["tau_se"]
    assert blocks["eagle3"]["0.0"]["n"] == blocks["dspark"]["0.0"]["n"]  # EAGLE-3 on the same (paired) blocks
    assert {"dspark/eagle3", "dflash/eagle3", "dspark/dflash"} <= set(s["evaluate"]["blocks"]["pairs"])
    for curve in ("cpu", "h200_model"):
        sched = s["evaluate"]["scheduler"]["T=0.7,p0.8,k20"]["dspark"][curve]["results"]
        assert [r["R"] for r in sched] == [1, 8]
        assert all(r["scheduler"]["tokens_per_s"] > 0 and r["ratio_scheduler"] > 0 for r in sched)
    confidence = read_json(join(run_dir, "evaluate", "confidence.json"))
    assert [(x["temperature"], x["top_p"], x["top_k"]) for x in confidence["settings"]] == [
        (0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.8, 20)]
    assert all(len(x["estimators"]["max_q"]["auc"]) == 4 and set(x["scheduler"]) == {"cpu", "h200_model"}
               for x in confidence["settings"])
    for x in confidence["settings"]:  # the oracle bound: no estimator's scheduler above it
        for curve, bound in x["scheduler_oracle"].items():
            assert set(bound) == set(x["scheduler"][curve]) and all(b >= 1 - 1e-9 for b in bound.values())
            for by_curve in x["scheduler_by_estimator"].values():
                assert all(by_curve[curve][R] <= b + 1e-9 for R, b in bound.items())
    ece = s["calibrate"]["drafters"]["dspark"]
    assert len(ece["temperatures"]) == 4 and all(t > 0 for t in ece["temperatures"])
    refit = ece["refit"]  # 8 held-out samples' prompts decoded by the drafter; its head adopted, or the reason
    assert refit["prompts"] == 8 and ("skipped" in refit or refit["slots"] > 0)
    gate = ece["gate"]  # the next held-out samples' prompts, decoded with the kept head at the serving setting
    assert 1 <= gate["prompts"] <= 8 and gate["rounds"] >= gate["full_blocks"] > 0, gate
    assert gate["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    fitted = {x["temperature"]: x["fitted_on"] for x in confidence["settings"]}  # estimators fitted and gated there
    assert fitted == {0.0: "held-out blocks, even batches", 1.0: "held-out blocks, even batches",
                      0.7: f"on-policy gate rounds of {gate['prompts']} calibrate prompts"}
    assert fs.exists(join(run_dir, "calibrate", "dspark", "confidence_head.safetensors")) == refit["adopted"]

    assert s["export"]["drafters"]["eagle3"]["format"] == "speculators"
    for name in ("dflash", "dspark", "eagle3"):
        export = s["export"]["drafters"][name]["path"]
        config = read_json(join(export, "config.json"))
        with fs.open(join(export, "model.safetensors"), "rb") as f:
            tensors = load(f.read())
        check_tensors(tensors, expected_tensors(config))  # complete, right shapes, trained
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    # per task: the two prompt sets, each in every table; the model card states the evaluate stage's figures
    assert s["evaluate"]["tasks"] == {"stdlib": 2, "gsm8k": 2}
    assert "| T | drafter | gsm8k | stdlib | macro |" in fs.cat(join(run_dir, "evaluate", "tau_table.md")).decode()
    for name in ("dflash", "dspark", "eagle3"):
        export = s["export"]["drafters"][name]["path"]
        facts = read_json(join(export, "training_summary.json"))
        card = fs.cat(join(export, "README.md")).decode()
        assert card.startswith("---\n") and "license: apache-2.0" in card
        assert facts["data"]["cache"]["tokens"] == s["cache"]["tokens"]
        assert facts["recipe"]["steps"] == s["train"]["drafters"][name]["steps"]
        for setting in facts["evaluation"]:
            measured = s["evaluate"]["results"][setting["setting"]]["drafters"][name]["tasks"]
            assert {t: m["tau"] for t, m in setting["tasks"].items()} == {t: m["tau"] for t, m in measured.items()}
            assert setting["macro"]["tau"] == pytest.approx(sum(m["tau"] for m in measured.values()) / 2)
            row = f"| {setting['setting']} | {setting['tasks']['gsm8k']['tau']:.3f}"
            assert row in card, (row, card)
    assert ops_main(["publish", s["export"]["drafters"]["dspark"]["path"], "me/tiny-dspark", "--dry-run", "--json"]) == 0
    listed = {f["file"] for f in json.loads(capsys.readouterr().out)["files"]}
    assert {"README.md", "training_summary.json", "config.json", "model.safetensors"} <= listed
    table = fs.cat(join(run_dir, "results.md")).decode()
    assert "DSpark / DFlash" in table and "bytes/token" in table and "| evaluate |" in table
