"""Rows and TensorBoard files of the live training metrics (tests/unit/training/test_live_metrics.py,
tests/integration/test_live_metrics_s3.py)."""
from pathlib import Path

import fsspec


def _row(step: int, loss: float | None = None) -> dict:
    return {"step": step, "epoch": 0, "lr": 1e-3, "loss": float(step) if loss is None else loss,
            "acceptance_per_position": [0.5, 0.25], "tau_expected": 1.5, "tokens_per_s": 100.0,
            "data_wait_fraction": 0.0}


def _scalars(log_dir: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard shows it (orphaned events of a restarted run purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _download(url: str, local: Path) -> Path:
    fs, root = fsspec.core.url_to_fs(url)
    for p in fs.find(root):
        dest = local / p.removeprefix(root.rstrip("/") + "/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(p, str(dest))
    return local
