"""Run ``python -m pipeline.run`` as a user does, and read the JSON plans a dry run prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from paths import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "DS_ACCELERATOR": "cpu",
       "TOKENIZERS_PARALLELISM": "false"}


def run_cli(*args, cwd=REPO, timeout=60) -> subprocess.CompletedProcess:
    """``python -m pipeline.run ARGS`` in ``cwd``, offline; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "pipeline.run", *map(str, args)], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def plans(stdout: str) -> list[dict]:
    """The JSON plans a dry run prints (Hydra may log lines around them)."""
    dec, out, i = json.JSONDecoder(), [], stdout.find("{")
    while i >= 0:
        obj, end = dec.raw_decode(stdout, i)
        out.append(obj)
        i = stdout.find("{", end)
    return out
