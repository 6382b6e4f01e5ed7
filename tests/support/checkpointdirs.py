"""The checkpoint folders of a train run (tests/unit/pipeline/test_limits.py,
tests/integration/test_calibrate_stage.py)."""
from __future__ import annotations

from storage import filesystem, join


def _folders(train_url: str) -> dict[str, bool]:
    """Checkpoint folder name -> whether it is committed (has its COMMITTED.json)."""
    fs, root = filesystem(join(train_url, "checkpoints"))
    fs.invalidate_cache(root)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    return {n: fs.exists(f"{root}/{n}/COMMITTED.json") for n in names}
