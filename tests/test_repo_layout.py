"""The house: every source file visible to the tools that skip build outputs, and `make clean` keeping runs."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Folder names that common global ignore files (and code-indexing tools) treat as build output.
BUILD_OUTPUT_NAMES = ("target", "build", "dist", "out", "bin", "obj", "node_modules", "vendor")
GLOBAL_IGNORE = "\n".join([*(f"{n}/" for n in BUILD_OUTPUT_NAMES), "*.egg-info/", "__pycache__/", ".venv/", ""])


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_no_source_folder_is_named_like_a_build_output():
    bad = [p for p in _tracked() if set(Path(p).parts[:-1]) & set(BUILD_OUTPUT_NAMES)]
    assert not bad, f"source files under folders that global ignore rules skip: {bad[:10]}"


def test_common_global_ignore_rules_ignore_no_tracked_file(tmp_path):
    rules = tmp_path / "global-gitignore"
    rules.write_text(GLOBAL_IGNORE)
    sources = [p for p in _tracked() if p.endswith((".py", ".yaml", ".md", ".toml"))]
    done = subprocess.run(["git", "-c", f"core.excludesFile={rules}", "check-ignore", "--no-index", "--stdin"],
                          cwd=REPO, input="\n".join(sources), capture_output=True, text=True)
    assert done.returncode == 1 and not done.stdout.strip(), f"ignored by common rules: {done.stdout.split()[:10]}"


def _make_dry(target: str) -> list[str]:
    """The words of the commands ``make -n TARGET`` would run (run from ``make test`` too: no make
    variables inherited, no directory banners)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO, env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_make_clean_keeps_runs():
    clean = _make_dry("clean")
    assert "rm" in clean and "runs" not in clean, clean
    assert _make_dry("clean-runs") == ["rm", "-rf", "runs"]
