"""Reasoning data (Qwen3 thinking traces) through the cache stage on Qwen3-4B's real template: the think
block is supervised as the template emits it (ingestion and rendering: tests/unit/pipeline/test_reasoning.py)."""
import pytest

from reasoningdata import QWEN3_SUPERVISED, REASONING


@pytest.fixture(scope="module")
def qwen3_target_dir(tmp_path_factory, tiny_qwen3, qwen3_tokenizer) -> str:
    """The tiny random Qwen3 with the small tokenizer that carries Qwen3-4B's real chat template."""
    d = tmp_path_factory.mktemp("qwen3_template_target")
    tiny_qwen3.save_pretrained(d)
    qwen3_tokenizer.save_pretrained(d)
    return str(d)


@pytest.mark.integration
def test_cache_stage_on_reasoning_data_supervises_the_think_block(ray_local, qwen3_target_dir, tmp_path):
    from ops import sample as ops_sample
    from pipeline.stages.cache import cache_url, run_cache
    from pipeline.run import DEFAULT_CONFIG, load_config

    cfg = load_config(DEFAULT_CONFIG, [f"target.path={qwen3_target_dir}", f"run_dir={tmp_path / 'run'}",
                                       f"data.train_files=[{REASONING}]", "generate.enabled=false",
                                       "cache.rows_per_shard=8", "data.min_loss_tokens=1"])
    s = run_cache(cfg)
    assert s["samples"] == 5 and s["skipped_rows"] == {}  # both forms, multi-turn: nothing skipped
    payload, rc = ops_sample.sample(cache_url(cfg), None, (0, 0), qwen3_target_dir, None, 3)
    assert rc == 0 and payload["tokenizer_matches_cache"] is True
    supervised = [seg["text"] for seg in payload["segments"] if seg["supervised"]]
    assert supervised == QWEN3_SUPERVISED["r1"]
    view = ops_sample.render_sample(payload)
    assert "<think>\n<<The last answer was 5, and 5 times 4 is 20.\n</think>\n\n20<|im_end|>>>" in view
    inline, _ = ops_sample.sample(cache_url(cfg), None, (0, 1), qwen3_target_dir, None, 3)  # r2: inline form
    assert [seg["text"] for seg in inline["segments"] if seg["supervised"]] == QWEN3_SUPERVISED["r2"]
