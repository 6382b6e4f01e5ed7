"""The GPU install path (docs/cluster.md): conf/runtime_env.yaml is a runtime_env Ray accepts and ships
the right files (constraints-gpu.txt resolved against PyPI: tests/integration/test_gpu_install_resolves.py)."""
from __future__ import annotations

import zipfile

import yaml

from paths import REPO


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
