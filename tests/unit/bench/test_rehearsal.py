"""bench/rehearsal.py (``make rehearsal``): the layer mapping, the tokenizer mapped into Qwen3's vocabulary, the
report's must-show keys (issue #34 item 2) from a dry run, the cache's bytes against the analytic size at the
supervised fraction, ``make rehearsal``'s default depth (every stage in ``--quick`` mode:
tests/integration/test_rehearsal_quick.py; the ``rehearsal`` fixture is in tests/conftest.py)."""
from __future__ import annotations

import json

import pytest

from paths import REPO


def test_map_layer_ids(rehearsal):
    assert rehearsal.map_layer_ids(36) == [1, 9, 17, 25, 33]
    assert rehearsal.map_layer_ids(8) == [1, 2, 3, 4, 5]
    assert rehearsal.map_layer_ids(10) == [1, 3, 4, 6, 7]  # the last captured layer stays depth - 3
    with pytest.raises(ValueError, match="at least 8 layers"):
        rehearsal.map_layer_ids(7)


def test_extend_tokenizer_maps_ids_into_qwen3_vocabulary(rehearsal, tmp_path):
    from transformers import AutoTokenizer

    rehearsal.extend_tokenizer(rehearsal.EMBEDDED_TOKENIZER, tmp_path, 151936)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    small = AutoTokenizer.from_pretrained(rehearsal.EMBEDDED_TOKENIZER, local_files_only=True)
    assert len(tok) == 151936
    assert tok.convert_ids_to_tokens([151643, 151644, 151645, 151667, 151668, 151669]) == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok.decode([0, 100000, 151935]) == "<|ph_0|><|ph_100000|><|ph_151935|>"  # every id decodes
    text = "def f(x):\n    return x + 1"
    assert tok(text)["input_ids"] == small(text)["input_ids"]  # ordinary tokens keep their ids
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert ids[0] == 151644 and ids.count(151645) == 1


def test_dry_report_holds_the_must_show_keys(rehearsal, tmp_path):
    assert rehearsal.main(["--dry", "--depth", "36", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "rehearsal.json").read_text())
    assert report["missing_keys"] == [] and rehearsal.missing_keys(report) == []
    assert {k: report["target"][k] for k in rehearsal.REQUIRED["target"]} == {
        "hidden_size": 2560, "vocab_size": 151936, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128}
    assert report["depth"] == 36 and report["target"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert report["drafter"]["trainable_parameters"] == 615_221_249
    for cluster in ("8xH200", "64xH200"):
        for stage in ("generate", "cache", "train"):
            row = report["projection"][cluster][stage]
            assert row["s_per_1e9_tokens"] > 0 and row["bound"] in ("compute", "hbm", "pcie", "network", "s3_put", "s3_get")
    assert "+stage=cache" in report["commands"]["cache"] and "conf/qwen3_4b.yaml" in report["commands"]["cache"]
    del report["cache"]["bytes_per_token"], report["stages"]["vllm_load"]["wall_s"]
    assert rehearsal.missing_keys(report) == ["cache.bytes_per_token", "stages.vllm_load.wall_s"]


def test_cache_figures_analytic_at_the_supervised_fraction(rehearsal):
    # 1,000 tokens, 600 supervised: features 5 x 2560 x 2 + last_hidden 0.6 x 2560 x 2 + int32 id + uint8 mask
    analytic = 5 * 2560 * 2 + 0.6 * 2560 * 2 + 5
    est = rehearsal.cache_figures({"tokens": 1000, "bytes": 28_700_000, "shards": 2, "estimate_bytes": 28_750_000,
                                   "supervised_tokens": 600}, hidden=2560, n_layers=5)
    assert est["analytic_bytes_per_token"] == pytest.approx(analytic) == pytest.approx(28_677)
    assert est["analytic_bytes_per_token_all_supervised"] == 5 * 2560 * 2 + 2560 * 2 + 5 == 30_725
    assert est["bytes_per_token"] == 28_700 and est["supervised_fraction"] == 0.6
    assert est["measured_over_analytic"] == pytest.approx(28_700 / analytic)
    assert est["bytes_within_1pct_of_analytic"] is True and est["bytes_within_1pct_of_estimate"] is True
    assert "peak_rss_over_shard_bytes" not in est  # the writer's own figure (writer_figures), not the stage tree's
    # the all-supervised size is 7% off a cache whose prompts store no last_hidden: the check must use the fraction
    off = rehearsal.cache_figures({"tokens": 1000, "bytes": 30_725_000, "shards": 1, "estimate_bytes": 28_000_000,
                                   "supervised_tokens": 600}, hidden=2560, n_layers=5)
    assert off["bytes_within_1pct_of_analytic"] is False and off["bytes_within_1pct_of_estimate"] is False
    assert rehearsal.cache_figures({}, hidden=2560, n_layers=5)["bytes_within_1pct_of_analytic"] is None


def test_make_rehearsal_default_depth_is_the_scripts(rehearsal, tmp_path):
    make = (REPO / "Makefile").read_text()
    assert "REHEARSAL_ARGS ?= --depth 8\n" in make and 'REHEARSAL_ARGS="--depth 36"' in make
    assert rehearsal.main(["--dry", "--out", str(tmp_path)]) == 0  # no --depth: the script's default
    report = json.loads((tmp_path / "rehearsal.json").read_text())
    assert report["depth"] == 8 and report["target"]["num_hidden_layers"] == 8
    assert report["target"]["target_layer_ids"] == [1, 2, 3, 4, 5] and report["target"]["hidden_size"] == 2560


def test_a_rerun_with_skip_carries_over_what_a_stopped_run_measured(rehearsal, tmp_path):
    """A run that stopped after some stages leaves rehearsal.partial.json; the entries of the stages that passed
    are what a --skip rerun reports for them (marked), a failed one is not carried."""
    done = {"ok": True, "wall_s": 58.2, "peak_rss_bytes": 5_700_000_000, "summary": {"tokens": 8192}}
    (tmp_path / rehearsal.PARTIAL).write_text(json.dumps({"stages": {"cache": done, "train": {"ok": False}}}))
    carried = rehearsal.previous_stages(tmp_path)
    assert carried == {"cache": {**done, "carried_over": rehearsal.PARTIAL}}
    (tmp_path / rehearsal.PARTIAL).unlink()
    (tmp_path / "rehearsal.json").write_text(json.dumps({"stages": {"generate": {"ok": True, "wall_s": 1.0}}}))
    assert rehearsal.previous_stages(tmp_path)["generate"]["carried_over"] == "rehearsal.json"
    assert rehearsal.previous_stages(tmp_path / "none") == {}
