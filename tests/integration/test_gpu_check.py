"""bench/gpu_check.py --dry (the GPU check's CPU mode): every section runs the product's code and reports real
figures, and nothing it imports loads Ray (absent on the GPU machine)."""
import json
import math
import os
import subprocess
import sys

import pytest

from cache_schema import estimate_cache_bytes, shard_overhead_bytes
from paths import REPO

SECTIONS = {"train", "attention", "prefill", "block_eval", "speculate", "sps"}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.integration
def test_gpu_check_dry_runs_every_section_without_ray(tmp_path):
    out = tmp_path / "dry.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(REPO / "bench/gpu_check.py"), "--dry", "--out", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads(out.read_text())
    sections = res["sections"]
    assert set(sections) == SECTIONS and res["ok"]
    assert all(s["ok"] for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    assert res["ray_imported"] is False and res["vllm_imported"] is False
    assert "ray" not in res["third_party_modules"] and res["torch"] and res["device"] == "cpu"
    assert res["wall_s"] < 300  # about 45 s on a 2-core machine

    train = sections["train"]
    for b in res["shape"]["batches"]:
        mb = train[f"mb{b}"]
        assert _positive(mb["step_s"]) and _positive(mb["tokens_per_s"]) and _positive(mb["peak_rss_bytes"])
        assert all(_positive(t) for t in mb["step_s_all"]) and all(_positive(x) for x in mb["loss"])

    att = sections["attention"]
    assert att["backward"] is False and math.isfinite(att["loss_sdpa"]) and att["loss_abs_diff"] < 1e-4

    pre = sections["prefill"]
    assert _positive(pre["ratio"]) and _positive(pre["prefill_tokens_per_s"]) and _positive(pre["bare_tokens_per_s"])
    shard, shape = pre["shard"], res["shape"]
    est = estimate_cache_bytes(shard["tokens"], hidden_size=shape["hidden"], num_target_layers=len(shape["ids"]),
                               supervised_fraction=shard["hidden_rows"] / shard["tokens"],
                               num_samples=shard["samples"])
    overhead = shard_overhead_bytes(hidden_size=shape["hidden"], target_layer_ids=tuple(shape["ids"]))
    expected = (est.total_bytes + overhead) / shard["tokens"]  # the contract: payload + zarr metadata per shard
    assert shard["bytes_per_token"] == pytest.approx(expected, rel=0.01)

    for T, fig in sections["block_eval"]["by_temperature"].items():
        assert fig["n"] > 0 and fig["tau"] >= 1 and math.isfinite(fig["tau_expected"]), (T, fig)

    spec = sections["speculate"]
    assert spec["vocab"] == shape["vocab"] and spec["gamma"] == shape["block"]
    assert 0 <= spec["accepted"] <= spec["verified"] <= spec["gamma"] and spec["emitted"] == 2

    sps = sections["sps"]
    assert sps["batch_tokens"] == [1, 4, 16] and all(_positive(v) for v in sps["steps_per_s"] + sps["tokens_per_s"])
