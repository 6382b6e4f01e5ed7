"""bench/rehearsal.py (``make rehearsal``): every stage in ``--quick`` mode, vLLM serving the DFlash export
losslessly where ``.venv-vllm`` exists (the script's parts: tests/unit/bench/test_rehearsal.py; the ``rehearsal``
fixture is in tests/conftest.py)."""
from __future__ import annotations

import json

import pytest

from paths import REPO


@pytest.mark.integration
def test_quick_rehearsal_runs_every_stage(rehearsal, tmp_path):
    serve = (REPO / ".venv-vllm/.installed-stamp").is_file()  # make test-vllm builds it; never built here
    rc = rehearsal.main(["--quick", "--out", str(tmp_path), "--skip", "vllm_load", *([] if serve else ["vllm_serve"])])
    report = json.loads((tmp_path / "rehearsal.json").read_text())
    assert report["missing_keys"] == [] and report["depth"] == 8
    for stage in ("generate", "cache", "train", "calibrate", "export", "evaluate"):
        assert report["stages"][stage]["ok"] is True, report["stages"][stage].get("error")
        assert report["stages"][stage]["wall_s"] > 0 and report["stages"][stage]["peak_rss_bytes"] > 2**20
    assert report["checks"]["cache_bytes_within_1pct"] is True
    c = report["cache"]  # hidden 64: 28 B per sample and the shard metadata are ~1% of 743 B/tok (real width: 0.2%)
    assert 0 < c["supervised_fraction"] < 1 and 1.0 < c["measured_over_analytic"] < 1.02
    assert c["analytic_bytes_per_token"] == pytest.approx(5 * 64 * 2 + c["supervised_fraction"] * 64 * 2 + 5)
    assert 1.0 < report["cache"]["peak_rss_over_shard_bytes"] < 2.0  # the real-width writer (bench: 1.13x)
    assert report["cache"]["writer_shard"]["hidden_size"] == 2560
    assert all(v > 0 for v in report["train"]["step_split_s"].values())
    assert {k.split("/")[1] for k in report["train"]["checkpoint_bytes"]} == {"dflash", "dspark"}
    assert set(report["export"]["files"]) >= {"dflash/model.safetensors", "dspark/model.safetensors"}
    if serve:
        st = report["stages"]["vllm_serve"]
        assert st["ok"] is True and st["lossless"] is True, st.get("error")
        assert st["prompts"] == 3 and st["tokens"] == st["target_tokens"]
        assert all(len(t) == 16 for t in st["tokens"]) and st["drafts"] > 0
        assert st["wall_s"] > 0 and st["peak_rss_bytes"] > 2**20
    assert rc == 0
