"""train.report_to: W&B (offline) and MLflow (file store) receive every step's metrics from the live
metrics log, a restarted attempt continues the same tracker run, and a missing package or a bad list
is a clear error. The trainer wiring across a killed and resumed run: tests/integration/test_train_stage.py."""
import glob
import json
import sys

import pytest

from pipeline.errors import ConfigError
from pipeline.run import DEFAULT_CONFIG, load_config
from training.metrics_log import LiveMetrics
from training.trackers import RUN_KEY_TAG, open_trackers

from wandblog import wandb_history


def _row(step, loss):
    return {"step": step, "epoch": 0, "lr": 1e-3, "loss": loss, "tau_expected": 1.5,
            "acceptance_per_position": [0.5, 0.25], **({"val_tau_expected": 2.0 + step} if step == 2 else {})}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for k in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "train" / "dspark"


def _attempt(train, resumed_step, rows):
    trackers = open_trackers(["jsonl", "tensorboard", "wandb", "mlflow"], project="dspark-test", run_name="run/dspark",
                             run_key=str(train), params={"drafter.block_size": "7", "train.lr": "0.003"},
                             local_dir=str(train))
    log = LiveMetrics(str(train / "metrics.jsonl"), resumed_step, flush_seconds=0.0, trackers=trackers)
    for r in rows:
        log.add(r)
    log.close()
    return trackers


def test_wandb_and_mlflow_get_every_step_and_a_resume_continues_the_same_run(offline):
    train = offline
    first = _attempt(train, 0, [_row(1, 3.0), _row(2, 2.5), _row(3, 2.4)])  # killed after step 3, checkpoint at 2
    again = _attempt(train, 2, [_row(3, 2.2), _row(4, 2.0)])
    wandb_first, wandb_again = first[0], again[0]
    assert wandb_first.id == wandb_again.id  # the same W&B run, resumed
    # a resume started in the same second as the first attempt gets "offline-run-<time>-<id>-1" (sorts after)
    hist = [h for d in sorted(glob.glob(f"{train}/wandb/offline-run-*-{wandb_first.id}*")) for h in wandb_history(d)]
    assert [(h["_step"], h["train/loss"]) for h in hist] == [(1, 3.0), (2, 2.5), (3, 2.4), (3, 2.2), (4, 2.0)]
    assert [h["validation/tau_expected"] for h in hist if "validation/tau_expected" in h] == [4.0]
    assert all("train/acceptance_per_position" not in h for h in hist)  # lists are not scalars

    from mlflow.tracking import MlflowClient

    mlf = again[1]
    assert mlf.uri == f"file://{train}/mlruns" and mlf.run_id == first[1].run_id
    client = MlflowClient(tracking_uri=mlf.uri)
    exp = client.get_experiment_by_name("dspark-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].data.tags[RUN_KEY_TAG] == str(train)
    assert runs[0].data.params == {"drafter.block_size": "7", "train.lr": "0.003"} and runs[0].info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(mlf.run_id, "train.loss"))
    assert history == [(1, 3.0), (2, 2.5), (3, 2.2), (3, 2.4), (4, 2.0)]  # the killed step kept beside its redo
    assert [json.loads(x)["loss"] for x in (train / "metrics.jsonl").read_text().splitlines()] == [3.0, 2.5, 2.2, 2.0]


def test_a_failing_tracker_warns_and_training_goes_on(tmp_path, capsys):
    class Broken:
        def log(self, metrics, step):
            raise ConnectionError("tracker server down")

        def close(self):
            raise ConnectionError("still down")

    log = LiveMetrics(str(tmp_path / "metrics.jsonl"), 0, flush_seconds=0.0, trackers=[Broken()])
    log.add(_row(1, 3.0))
    log.close()
    err = capsys.readouterr().err
    assert "Broken could not log step 1 (ConnectionError: tracker server down)" in err and "did not close" in err
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_report_to_is_checked_and_reaches_the_job(tmp_path, monkeypatch):
    from pipeline.stages.train import train_job

    base = [f"run_dir={tmp_path}"]
    job = train_job(load_config(DEFAULT_CONFIG, [*base, "train.report_to=[jsonl,wandb]", "train.tracker_project=p"]),
                    "dspark", "{}", str(tmp_path))
    assert job.report_to == ("jsonl", "wandb") and job.tracker_project == "p"
    assert ("drafter.block_size", "7") in job.tracker_params and ("drafter", "dspark") in job.tracker_params
    assert load_config(DEFAULT_CONFIG, base).train.report_to == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match=r"train.report_to: unknown \['comet'\]"):
        load_config(DEFAULT_CONFIG, [*base, "train.report_to=[jsonl,comet]"])
    with pytest.raises(ConfigError, match="train.report_to: must keep jsonl"):
        load_config(DEFAULT_CONFIG, [*base, "train.report_to=[tensorboard]"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="set MLFLOW_TRACKING_URI"):
        load_config(DEFAULT_CONFIG, ["run_dir=s3://bucket/run", "train.report_to=[jsonl,mlflow]"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install -e '.\[tracking\]'"):
        open_trackers(["jsonl", "wandb"], project="p", run_name="r", run_key="k", params={}, local_dir=str(tmp_path))
