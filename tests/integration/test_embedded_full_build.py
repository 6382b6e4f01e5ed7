"""The embedded default target: the default build trained from scratch, against the shipped one (tokenizer,
chat template, stdlib chats, the quick build and cache: tests/unit/pipeline/test_embedded.py).

The full build trains for about 7 minutes on 2 cores, a seventh of the whole suite, to check something that
changes only with its inputs: the build's code, the shipped target's files, the Python whose stdlib it
reads and the torch and transformers it trains with. ``tests/fixtures/embedded_full_build.json`` records
the digest of those inputs at the last full build that passed, with that build's figures. The test runs the
full build when the digest differs from the record (any change to an input), or when
``DSPARK_FULL_BUILD=1``; otherwise it checks the record against the shipped figures and says when and where
it was verified. ``DSPARK_FULL_BUILD=1 DSPARK_FULL_BUILD_RECORD=1`` rewrites the record after a passing
build (``make verify-embedded-build``).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import pytest
import torch
import transformers

from paths import REPO
from pipeline.embedded import build as build_mod
from pipeline.embedded.build import ensure_embedded

RECORD = REPO / "tests" / "fixtures" / "embedded_full_build.json"
BUILD_CODE = sorted((REPO / "pipeline" / "embedded").glob("*.py"))
SHIPPED_FILES = sorted(p for p in build_mod.SHIPPED_TARGET.iterdir() if p.is_file())


def build_inputs() -> dict[str, str]:
    """What the full build's outcome depends on: each input file's SHA-256 (path relative to the repository)
    and the versions of Python (its stdlib is the corpus), torch and transformers."""
    files = {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest() for p in BUILD_CODE + SHIPPED_FILES}
    return {**files, "python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__,
            "transformers": transformers.__version__}


def digest(inputs: dict[str, str]) -> str:
    """SHA-256 (hex) of ``inputs`` as sorted-key JSON: the key the record is stored under."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def assert_like_shipped(metrics: dict, shipped: dict) -> None:
    """A build's figures beat the 1 M-param reference (3.9 nats / 25% top-1) and land within 0.05 nats and
    1 point of top-1 of the shipped target's (the build is not bit-reproducible across thread counts)."""
    assert metrics["heldout_source"]["loss"] < 3.9 and metrics["heldout_source"]["top1"] > 0.25
    assert metrics["chats"]["train"] == 4000 and metrics["chats"]["heldout"] == 400
    for key in ("heldout_source", "heldout_chat"):
        assert abs(metrics[key]["loss"] - shipped[key]["loss"]) < 0.05, (key, metrics[key], shipped[key])
        assert abs(metrics[key]["top1"] - shipped[key]["top1"]) < 0.01, (key, metrics[key], shipped[key])


@pytest.mark.integration
def test_full_build_trains_a_target_like_the_shipped_one(tmp_path):
    """The default build trained from scratch lands where the shipped target is (:func:`assert_like_shipped`);
    run when an input changed since the recorded build, else the record is checked."""
    shipped = json.loads((build_mod.SHIPPED_TARGET / "metrics.json").read_text())
    inputs = build_inputs()
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if record.get("digest") == digest(inputs) and os.environ.get("DSPARK_FULL_BUILD") != "1":
        assert_like_shipped(record["metrics"], shipped)
        return
    changed = sorted(k for k in inputs if record.get("inputs", {}).get(k) != inputs[k])
    paths = ensure_embedded(tmp_path, train_target=True)
    metrics = json.loads(paths.metrics.read_text())
    assert metrics["target"] == "trained"
    assert_like_shipped(metrics, shipped)
    if os.environ.get("DSPARK_FULL_BUILD_RECORD") == "1":
        RECORD.write_text(json.dumps({
            "digest": digest(inputs), "inputs": inputs, "verified_on": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "build_seconds": metrics["build_seconds"],
            "metrics": {k: metrics[k] for k in ("heldout_source", "heldout_chat", "chats")}}, indent=1) + "\n")
    else:
        assert not changed, (f"the full build passed, but its inputs changed since {RECORD.relative_to(REPO)} "
                             f"({', '.join(changed)}): record this build with `make verify-embedded-build`")
