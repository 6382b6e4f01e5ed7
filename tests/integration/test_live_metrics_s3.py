"""Live training metrics (training.metrics_log.LiveMetrics): metrics.jsonl and TensorBoard events are
written while the run goes, on a real S3 API (the local and in-memory cases:
tests/unit/training/test_live_metrics.py)."""
import json

import fsspec
import pytest

from training.metrics_log import LiveMetrics

from metricsfiles import _download, _row, _scalars


@pytest.mark.integration
def test_s3_run_dir_has_metrics_and_events_before_close(s3_url, tmp_path):
    """On a real S3 API (moto): the live object and event files exist during the run."""
    train = f"{s3_url}/train/dspark"
    log = LiveMetrics(f"{train}/metrics.jsonl", 0, tensorboard_url=f"{train}/tensorboard", flush_seconds=0.0)
    for step in range(1, 4):
        log.add(_row(step))
    fs, path = fsspec.core.url_to_fs(f"{train}/metrics.jsonl")
    fs.invalidate_cache()
    assert [json.loads(x)["step"] for x in fs.cat_file(path).decode().splitlines()] == [1, 2, 3]
    assert _scalars(_download(f"{train}/tensorboard", tmp_path / "tb")) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    log.close()
