"""The import contracts of pyproject.toml ([tool.importlinter]): layers point down, checked on the tree."""
import shutil
import subprocess
import sys
from pathlib import Path

from paths import REPO


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 kept, 0 broken" in out.stdout


def test_no_pipeline_import_below_the_stage_layer():
    for pkg in ("training", "cache_schema", "storage"):
        for f in (REPO / pkg).rglob("*.py"):
            text = f.read_text()
            assert "from pipeline" not in text and "import pipeline" not in text, f
