"""Live training metrics (training.metrics_log.LiveMetrics): metrics.jsonl and TensorBoard events are
written while the run goes, throttled on object storage, and a resume keeps each step exactly once."""
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from training.metrics_log import LiveMetrics

from metricsfiles import _download, _row, _scalars


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def memory_url():
    url = f"memory://live-{uuid.uuid4().hex}/train/dspark"
    yield url
    fs, root = fsspec.core.url_to_fs(url.rsplit("/", 2)[0])
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _read_rows(url: str) -> list[dict]:
    fs, path = fsspec.core.url_to_fs(url)
    return [json.loads(x) for x in fs.cat_file(path).decode().splitlines()]


@pytest.mark.parametrize("flush_seconds", [0.0, 1e9])
def test_local_run_dir_holds_every_step_before_close(tmp_path, flush_seconds):
    """Locally each row is appended as it is added, whatever the throttle; TensorBoard writes in place."""
    train = tmp_path / "train" / "dspark"
    clock = Clock()
    log = LiveMetrics(str(train / "metrics.jsonl"), 0, tensorboard_url=str(train / "tensorboard"),
                      flush_seconds=flush_seconds, clock=clock)
    for step in range(1, 6):
        log.add(_row(step))
        clock.t += 1.0
        rows = [json.loads(x) for x in (train / "metrics.jsonl").read_text().splitlines()]
        assert rows == [_row(s) for s in range(1, step + 1)]  # the record format, unchanged
    if flush_seconds == 0:  # events flushed at every due write, in <train>/tensorboard
        assert _scalars(train / "tensorboard") == [(s, float(s)) for s in range(1, 6)]
    log.flush()  # a checkpoint: everything, whatever the throttle
    assert _scalars(train / "tensorboard") == [(s, float(s)) for s in range(1, 6)]
    assert _scalars(train / "tensorboard", "train/tau_expected")[-1] == (5, 1.5)
    log.close()
    assert len((train / "metrics.jsonl").read_text().splitlines()) == 5


def test_object_storage_holds_every_step_before_close(memory_url, tmp_path):
    """No append on object storage: with flush interval 0 the whole object is rewritten every step,
    and the TensorBoard event files are uploaded under <train>/tensorboard as they grow."""
    log = LiveMetrics(f"{memory_url}/metrics.jsonl", 0, tensorboard_url=f"{memory_url}/tensorboard",
                      flush_seconds=0.0)
    for step in range(1, 8):
        log.add(_row(step))
        assert [r["step"] for r in _read_rows(f"{memory_url}/metrics.jsonl")] == list(range(1, step + 1))
    events = _download(f"{memory_url}/tensorboard", tmp_path / "tb")
    assert [p.name.startswith("events.out.tfevents.") for p in events.iterdir()] == [True]
    assert _scalars(events) == [(s, float(s)) for s in range(1, 8)]  # before close
    log.add({**_row(8), "val_tau_expected": 2.5})
    log.close()
    assert _read_rows(f"{memory_url}/metrics.jsonl")[-1]["val_tau_expected"] == 2.5
    assert _scalars(_download(f"{memory_url}/tensorboard", tmp_path / "tb2"), "validation/tau_expected") == [(8, 2.5)]


def test_throttle_bounds_object_storage_writes(memory_url, monkeypatch):
    """100 steps of 1 s with a 10 s interval: 10 rewrites of metrics.jsonl and 10 event uploads during the
    run (t = 0, 10, ..., 90 s), then one of each at the checkpoint flush and none more at close."""
    clock = Clock()
    log = LiveMetrics(f"{memory_url}/metrics.jsonl", 0, tensorboard_url=f"{memory_url}/tensorboard",
                      flush_seconds=10.0, clock=clock)
    rewrites, uploads = [], []
    pipe, put = log.fs.pipe_file, log.fs.put_file
    monkeypatch.setattr(log.fs, "pipe_file", lambda path, data, **kw: (rewrites.append(path), pipe(path, data, **kw)))
    monkeypatch.setattr(log.fs, "put_file", lambda src, dst, **kw: (uploads.append(dst), put(src, dst, **kw)))
    for step in range(1, 101):
        log.add(_row(step))
        clock.t += 1.0
        if step == 15:  # the write at t = 10 s (step 11) is the newest
            assert [r["step"] for r in _read_rows(f"{memory_url}/metrics.jsonl")] == list(range(1, 12))
    assert len(rewrites) == 10 and len(uploads) == 10
    assert len(_read_rows(f"{memory_url}/metrics.jsonl")) == 91
    log.flush()  # a checkpoint
    assert len(rewrites) == 11 and len(uploads) == 11
    assert len(_read_rows(f"{memory_url}/metrics.jsonl")) == 100
    log.close()  # nothing new to write; the closed writer's last bytes are uploaded
    assert len(rewrites) == 11 and len(uploads) == 11


def test_failed_live_write_warns_and_is_retried(memory_url, monkeypatch, capsys):
    """A storage error in a throttled write never stops training; the next due write has every row."""
    clock = Clock()
    log = LiveMetrics(f"{memory_url}/metrics.jsonl", 0, flush_seconds=5.0, clock=clock)
    pipe, failures = log.fs.pipe_file, [1]

    def flaky(path, data, **kw):
        if failures:
            failures.pop()
            raise OSError("503 SlowDown")
        return pipe(path, data, **kw)

    monkeypatch.setattr(log.fs, "pipe_file", flaky)
    log.add(_row(1))  # due at once, fails
    assert "metrics of step 1 not yet written" in capsys.readouterr().err
    assert not log.fs.exists(log.path)
    for step in range(2, 7):
        clock.t += 1.0
        log.add(_row(step))  # step 6, at t = 5 s, is due again
    assert [r["step"] for r in _read_rows(f"{memory_url}/metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    failures.append(1)
    log.add(_row(7))
    with pytest.raises(OSError, match="SlowDown"):
        log.flush()  # a checkpoint's flush raises


@pytest.mark.parametrize("where", ["local", "memory"])
def test_resume_replaces_the_killed_attempts_later_steps(where, tmp_path, memory_url):
    """The killed attempt flushed steps 1-7, its last checkpoint was step 4: the rerun's file holds 1-4
    at once, then each step once, 5-9 from the rerun; TensorBoard hides the killed attempt's 5-7."""
    train = str(tmp_path / "train" / "dspark") if where == "local" else memory_url
    url, tb = f"{train}/metrics.jsonl", f"{train}/tensorboard"
    killed = LiveMetrics(url, 0, tensorboard_url=tb, flush_seconds=0.0)
    for step in range(1, 8):
        killed.add(_row(step))
    killed.flush()  # ... and the process dies: no close()
    again = LiveMetrics(url, 4, tensorboard_url=tb, flush_seconds=0.0)
    assert [r["step"] for r in again.rows] == [1, 2, 3, 4]
    assert [r["step"] for r in _read_rows(url)] == [1, 2, 3, 4]  # rewritten at once
    for step in range(5, 10):
        again.add(_row(step, loss=-float(step)))
    rows = _read_rows(url)
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 4.0, -5.0, -6.0, -7.0, -8.0, -9.0]
    again.close()
    killed.close()  # the test's own cleanup: nothing new to write
    assert [r["step"] for r in _read_rows(url)] == list(range(1, 10))
    events = Path(tb) if where == "local" else _download(tb, tmp_path / "tb")
    assert len(list(events.iterdir())) == 2  # both attempts' event files
    assert _scalars(events) == [(s, float(s)) for s in range(1, 5)] + [(s, -float(s)) for s in range(5, 10)]


def test_resume_drops_a_half_written_last_line(tmp_path):
    url = tmp_path / "metrics.jsonl"
    url.write_text("".join(json.dumps(_row(s)) + "\n" for s in range(1, 4)) + '{"step": 4, "lo')
    log = LiveMetrics(str(url), 3)
    assert url.read_text() == "".join(json.dumps(_row(s)) + "\n" for s in range(1, 4))
    log.add(_row(4))
    assert [json.loads(x)["step"] for x in url.read_text().splitlines()] == [1, 2, 3, 4]


def test_flush_interval_reaches_the_job(tmp_path):
    from pipeline.errors import ConfigError
    from pipeline.run import DEFAULT_CONFIG, load_config
    from pipeline.stages.train import train_job

    base = [f"run_dir={tmp_path}"]
    cfg = load_config(DEFAULT_CONFIG, [*base, "train.metrics_flush_seconds=5"])
    assert train_job(cfg, "dspark", "{}", str(tmp_path)).metrics_flush_seconds == 5.0
    assert load_config(DEFAULT_CONFIG, base).train.metrics_flush_seconds == 30.0
    with pytest.raises(ConfigError, match="train.metrics_flush_seconds"):
        load_config(DEFAULT_CONFIG, [*base, "train.metrics_flush_seconds=-1"])
