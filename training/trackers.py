"""Experiment trackers a training run reports to besides ``metrics.jsonl`` and TensorBoard
(``train.report_to``): Weights & Biases and MLflow, each optional (``pip install -e '.[tracking]'``).

Rank 0 only, through :class:`training.metrics_log.LiveMetrics`: every optimizer step's row goes to
each tracker as it is added, its float values as metrics at ``step`` (``train/<key>``, and
``validation/<key>`` for ``val_<key>``, the TensorBoard tags). A restarted or resumed attempt
continues the same tracker run: W&B by a run id derived from the run's key (``run_key``, the train
output URL: ``resume="allow"``), MLflow by the tag ``dspark.run_key`` searched in the experiment. A
tracker that fails while logging is reported on stderr and never stops training.

Where they write: W&B to ``WANDB_DIR`` (default: ``local_dir``, the run's local train folder, or the
temporary folder for a run_dir on object storage), online or offline by ``WANDB_MODE`` as W&B itself
decides; MLflow to ``MLFLOW_TRACKING_URI`` (default: a file store at ``<local_dir>/mlruns``, MLflow's
file backend, which MLflow 3 allows only with ``MLFLOW_ALLOW_FILE_STORE=true``: set for this default).
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from typing import Any, Protocol

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
RUN_KEY_TAG = "dspark.run_key"


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def metric_tags(row: dict[str, Any]) -> dict[str, float]:
    """The float values of a metrics row under their TensorBoard tags (``train/<key>``, ``validation/<key>``)."""
    return {(f"validation/{k.removeprefix('val_')}" if k.startswith("val_") else f"train/{k}"): float(v)
            for k, v in row.items() if isinstance(v, float)}


def _missing(name: str, package: str) -> ImportError:
    return ImportError(f"train.report_to lists {name}, but {package} is not installed: pip install -e '.[tracking]' "
                       f"(or pip install {package}), or remove {name} from train.report_to")


class WandbTracker:
    """One W&B run per drafter run (``wandb.init`` with a stable id, ``resume="allow"``)."""

    def __init__(self, project: str, run_name: str, run_key: str, params: dict[str, Any], local_dir: str | None):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self.id = hashlib.sha256(run_key.encode()).hexdigest()[:16]
        folder = os.environ.get("WANDB_DIR") or local_dir or tempfile.gettempdir()
        os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, id=self.id, resume="allow", config=params, dir=folder,
                              settings=wandb.Settings(silent=True, console="off"))
        self.dir = self.run.dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run per drafter run in experiment ``project``, found again by its ``dspark.run_key`` tag."""

    def __init__(self, project: str, run_name: str, run_key: str, params: dict[str, Any], local_dir: str | None):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow-skinny") from None
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            if local_dir is None:
                raise ValueError("train.report_to lists mlflow on a run_dir on object storage: set MLFLOW_TRACKING_URI "
                                 "(a tracking server or database) for the training workers")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file://" + os.path.join(os.path.abspath(local_dir), "mlruns")
        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
                                        order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags={RUN_KEY_TAG: run_key}).info.run_id
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "."), v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(names: tuple[str, ...] | list[str], *, project: str, run_name: str, run_key: str,
                  params: dict[str, Any], local_dir: str | None) -> list[Tracker]:
    """The trackers of ``train.report_to`` beyond ``jsonl`` and ``tensorboard`` (which
    :class:`training.metrics_log.LiveMetrics` writes itself).

    Args:
        project: W&B project / MLflow experiment. run_name: the run's display name. run_key: what makes
            a restarted attempt the same run (the train output URL). params: flat config values to record.
        local_dir: the run's local train folder, None for a run_dir on object storage.
    Raises:
        ImportError: a tracker's package is not installed (the message says what to install).
        ValueError: an unknown tracker name, or MLflow with no tracking URI and no local folder.
    """
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"train.report_to: unknown {unknown}; use some of {list(TRACKERS)}")
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    return [kinds[n](project, run_name, run_key, params, local_dir) for n in names if n in kinds]


def safe_log(trackers: list[Tracker], metrics: dict[str, float], step: int) -> None:
    """Log to each tracker; a failure is reported on stderr and training goes on."""
    for t in trackers:
        try:
            t.log(metrics, step)
        except Exception as e:  # noqa: BLE001 - any tracker backend error; a tracker never stops training
            print(f"warning: {type(t).__name__} could not log step {step} ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
