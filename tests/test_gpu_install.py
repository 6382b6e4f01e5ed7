"""The GPU install path (docs/cluster.md): constraints-gpu.txt with the `gpu` extra resolves against
PyPI to CUDA torch + vLLM + the pipeline (tests/check_gpu_install.py, `make check-gpu-install`), and
conf/runtime_env.yaml is a runtime_env Ray accepts and ships the right files."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "tests" / "check_gpu_install.py"
KEY_PACKAGES = ("torch", "vllm", "deepspeed", "ray", "transformers")
FORCE = os.environ.get("DSPARK_CHECK_GPU_INSTALL") == "1"


def _pins() -> dict[str, str]:
    lines = (REPO / "constraints-gpu.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line and not line.startswith("#"))


def _index_reachable() -> bool:
    host = urlparse(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").hostname
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_runtime_env_yaml_is_a_valid_ray_runtime_env(tmp_path):
    """Ray's own RuntimeEnv accepts the file; it installs nothing; its excludes keep runs and virtual
    environments out of the uploaded working_dir (checked with Ray's packaging, .gitignore not read)."""
    from ray.runtime_env import RuntimeEnv

    spec = yaml.safe_load((REPO / "conf" / "runtime_env.yaml").read_text())
    env = RuntimeEnv(**spec)
    assert env.working_dir() == "."
    assert not {"pip", "uv", "conda", "container", "image_uri"} & set(spec), "nodes have the environment"
    assert env.env_vars()["TOKENIZERS_PARALLELISM"] == "false"
    assert all(isinstance(v, str) for v in env.env_vars().values()), "Ray needs string env_vars"

    from ray._private.runtime_env.packaging import _zip_files

    tree = ["pipeline/run.py", "training/engine.py", "conf/qwen3_4b.yaml", "pyproject.toml",
            "pipeline/embedded/shipped_target/model.safetensors", "tests/fixtures/cases/a.json",
            "runs/tiny/train/ckpt.pt", "outputs/2026-01-01/log.txt", "multirun/0/x.txt", ".venv/bin/python",
            ".venv-vllm/lib/x.py", ".git/HEAD", "pipeline/__pycache__/run.cpython-311.pyc",
            "dspark_pipeline.egg-info/PKG-INFO", "build/lib/x.py", ".pytest_cache/v/x"]
    for rel in tree:
        (tmp_path / "wd" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "wd" / rel).write_text("x")
    _zip_files(str(tmp_path / "wd"), spec["excludes"], str(tmp_path / "pkg.zip"), include_gitignore=False)
    shipped = sorted(zipfile.ZipFile(tmp_path / "pkg.zip").namelist())
    assert shipped == sorted(tree[:6]), shipped


@pytest.mark.integration
def test_gpu_install_resolves_to_cuda_torch_and_vllm():
    """tests/check_gpu_install.py: the dry run resolves, torch is a CUDA build, and the key versions are
    the pinned ones (about a minute here: metadata only, no wheel downloaded whole). Skipped when the
    index is unreachable, unless DSPARK_CHECK_GPU_INSTALL=1 (then it fails instead)."""
    if not FORCE and not _index_reachable():
        pytest.skip("the package index is unreachable (set DSPARK_CHECK_GPU_INSTALL=1 to fail instead)")
    done = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    versions = dict(re.findall(r"(\S+)==(\S+)", re.search(r"^versions: (.*)$", done.stdout, re.M).group(1)))
    pins = _pins()
    assert versions == {name: pins[name] for name in KEY_PACKAGES}, done.stdout
    assert re.search(r"^\| cuda \| - \| CUDA \d+\.\d+", done.stdout, re.M), done.stdout
    assert "check_gpu_install: OK" in done.stdout
