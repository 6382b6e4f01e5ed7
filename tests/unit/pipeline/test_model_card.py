"""The export's model card (README.md + training_summary.json) written from the run's records, and
`ops publish --dry-run`. The end-to-end card of a real run is checked in tests/integration/test_all.py."""
import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from ops.__main__ import main as ops_main
from pipeline.model_card import card_facts, write_model_cards
from pipeline.run import DEFAULT_CONFIG, load_config
from storage import write_json

SETTINGS = [{"temperature": 0.0, "top_p": 1.0, "top_k": 0}, {"temperature": 0.7, "top_p": 0.8, "top_k": 20}]


def _task(tau, se, rounds=20):
    return {"tau": tau, "tau_se": se, "rounds": rounds, "verified_per_round": 7.0}


def _records(run_dir):
    out = f"{run_dir}/export/dspark"
    write_json(f"{run_dir}/export/summary.json", {"drafters": {"dspark": {
        "path": out, "architecture": "Qwen3DSparkModel", "format": "native", "num_speculative_tokens": 7,
        "bytes": 1234, "confidence": "folded", "folded_temperature": 0.85, "enable_thinking": False,
        "ece_before": [0.2, 0.1], "ece_sts": [0.05, 0.04], "ece_vllm": [0.06, 0.05]}}, "skipped": {}})
    write_json(f"{out}/config.json", {"hidden_size": 64, "vocab_size": 512})
    save_file({"fc.weight": torch.zeros(64, 192), "norm.weight": torch.ones(64)}, f"{out}/model.safetensors")
    write_json(f"{run_dir}/train/dspark/result.json", {"steps": 120, "world_size": 2, "validation": {
        "best": {"step": 100, "tau_expected": 3.1, "slot1_acceptance": 0.6, "ce": 2.0, "tv": 0.4},
        "last": {"step": 120, "tau_expected": 3.05, "slot1_acceptance": 0.59, "ce": 2.1, "tv": 0.41}}})
    write_json(f"{run_dir}/calibrate/dspark/report.json", {"temperatures": [0.9, 0.8], "refit": {
        "adopted": True, "prompts": 16, "slots": 300, "heldout_auc": {"trained": 0.55, "refit": 0.7},
        "settings": [{"temperature": 0.7, "top_p": 0.8, "top_k": 20}, {"temperature": 0.0, "top_p": 1.0, "top_k": 0}]}})
    results = {"T=0": {"drafters": {"dspark": {"overall": {**_task(2.8, 0.1, 40), "speedup_vs_target": 1.9},
                                               "tasks": {"gsm8k": _task(3.0, 0.3), "mbpp": _task(2.0, 0.4)}}}},
               "T=0.7,p0.8,k20": {"drafters": {"dspark": {"overall": {**_task(2.5, 0.1, 40), "speedup_vs_target": 1.5},
                                                          "tasks": {"gsm8k": _task(2.6, 0.2), "mbpp": _task(2.2, 0.2)}}}}}
    blocks = {"drafters": {"dspark": {"0.0": {"tau": 3.9, "tau_se": 0.03, "n": 500},
                                      "0.7": {"tau": 3.5, "tau_se": 0.04, "n": 500}}}}
    write_json(f"{run_dir}/evaluate/summary.json", {"settings": SETTINGS, "results": results, "blocks": blocks})
    return out


def test_card_states_the_runs_figures(tmp_path):
    run_dir = str(tmp_path / "run")
    out = _records(run_dir)
    cfg = load_config(DEFAULT_CONFIG, [f"run_dir={run_dir}", "export.license=apache-2.0"])
    assert write_model_cards(cfg) == {"dspark": out}
    facts = json.loads((tmp_path / "run/export/dspark/training_summary.json").read_text())
    assert facts == json.loads(json.dumps(card_facts(cfg, "dspark")))
    assert facts["parameters"] == 64 * 192 + 64 and facts["method"] == "dspark"
    assert facts["recipe"]["steps"] == 120 and facts["recipe"]["optimizer"] == cfg.train.optimizer.value
    t0, t07 = facts["evaluation"]
    assert t0["macro"] == {"tau": 2.5, "tau_se": pytest.approx(0.25), "tasks": 2}
    assert t07["setting"] == "T=0.7,p0.8,k20" and t07["block"] == {"tau": 3.5, "tau_se": 0.04, "n": 500}
    assert facts["data"]["cache"] is None  # no cache in this run_dir: said, not invented
    card = (tmp_path / "run/export/dspark/README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0" and "base_model" not in meta  # embedded target: no hub id
    assert "| T=0 | 3.000 ± 0.300 | 2.000 ± 0.400 | 2.500 ± 0.250 | 2.800 ± 0.100 | 3.900 ± 0.030 |" in card
    assert "| T=0.7,p0.8,k20 | 2.600 ± 0.200 | 2.200 ± 0.200 | 2.400 ± 0.141 | 2.500 ± 0.100 | 3.500 ± 0.040 |" in card
    assert '"method": "dspark"' in card and '"num_speculative_tokens": 7' in card and "vllm serve" in card
    assert ("adopted on 16 prompts decoded at T=0.7,p0.8,k20 and T=0, 300 slots; held-out AUC trained 0.550 -> "
            "refit 0.700") in card
    assert "120 steps" in card and "step 120, expected tau 3.050" in card
    assert "(hidden 64, vocabulary 512)" in card


def test_card_of_an_eagle3_export_reads_the_nested_target_shape(tmp_path):
    """A speculators-format config nests the layer config: the card still states the target's width and
    vocabulary, the method vLLM reads and that there is no confidence head."""
    run_dir = str(tmp_path / "run")
    out = _records(run_dir)
    summary = json.loads((tmp_path / "run/export/summary.json").read_text())
    summary["drafters"]["dspark"].update(architecture="Eagle3LlamaForCausalLM", format="speculators")
    write_json(f"{run_dir}/export/summary.json", summary)
    write_json(f"{out}/config.json", {
        "speculators_model_type": "eagle3", "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "vocab_size": 512},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]}})
    (tmp_path / "run/calibrate/dspark/report.json").unlink()
    cfg = load_config(DEFAULT_CONFIG, [f"run_dir={run_dir}"])
    write_model_cards(cfg)
    card = (tmp_path / "run/export/dspark/README.md").read_text()
    assert "\n# EAGLE-3 drafter `dspark`" in card and "(hidden 64, vocabulary 512)" in card
    assert '"method": "eagle3"' in card and "No confidence head." in card


def test_card_before_evaluate_says_so_and_a_hub_target_is_the_base_model(tmp_path, local_target):
    run_dir = str(tmp_path / "run")
    _records(run_dir)
    (tmp_path / "run/evaluate/summary.json").unlink()
    cfg = load_config(DEFAULT_CONFIG, [f"run_dir={run_dir}"])
    cfg.target.path = "Qwen/Qwen3-4B"
    write_model_cards(cfg)
    card = (tmp_path / "run/export/dspark/README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "Qwen/Qwen3-4B" and "license" not in meta
    assert "Not evaluated yet" in card and "Licence: not set (export.license)" in card
    assert "vllm serve Qwen/Qwen3-4B" in card


def test_ops_publish_dry_run_lists_and_checks_the_export(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    out = _records(run_dir)
    assert ops_main(["publish", out, "me/drafter", "--dry-run"]) == 2  # no card yet
    assert "lacks README.md, training_summary.json" in capsys.readouterr().err
    write_model_cards(load_config(DEFAULT_CONFIG, [f"run_dir={run_dir}"]))
    assert ops_main(["publish", out, "me/drafter", "--dry-run", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "run/export/dspark").iterdir()}
    assert {f["file"]: f["bytes"] for f in listed["files"]} == sizes and listed["bytes"] == sum(sizes.values())
    assert listed["dry_run"] and listed["commit"] is None and listed["repo_id"] == "me/drafter"
    assert ops_main(["publish", out, "not-a-repo-id", "--dry-run"]) == 2
    assert "is not OWNER/NAME" in capsys.readouterr().err
