"""Locating and loading the frozen target (transformers), strictly from local files.

Nothing is ever downloaded at run time: ``target.path`` is a local model directory, the built-in
``embedded:tiny`` target, or a hub id that is already in the local Hugging Face cache.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.config import TargetConfig
from pipeline.errors import TargetNotFoundError

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _not_found(path: str) -> TargetNotFoundError:
    return TargetNotFoundError(
        f"target.path={path!r} is not a local model directory and is not in the local Hugging Face "
        "cache, and this pipeline never downloads weights at run time. Download the model once on a "
        f"machine with network access (for example `huggingface-cli download {path} --local-dir "
        "/models/NAME`), copy it to every node (or a shared filesystem), and run with "
        "target.path=/models/NAME (a folder holding config.json, the safetensors weights and the "
        "tokenizer files).")


def resolve_target_path(path: str) -> str:
    """Local directory of the target named by ``path``.

    Raises:
        TargetNotFoundError: not local (message says how to point ``target.path`` at local weights).
    """
    if path.startswith("embedded:"):
        from pipeline.embedded import resolve_embedded

        return resolve_embedded(path)
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return str(local)
    if _HUB_ID.match(path) and not local.exists():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return snapshot_download(path, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            raise _not_found(path) from None
    raise _not_found(path)


def load_target(cfg: TargetConfig, device: str = "cpu"):
    """Load the frozen target model (eval mode, no grad) and its tokenizer from local files.

    Returns:
        ``(model, tokenizer, local_dir)``; the model is a ``*ForCausalLM`` in ``cfg.dtype``.

    Raises:
        TargetNotFoundError: see :func:`resolve_target_path`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per actor drowns the stage's own bar
    local = resolve_target_path(cfg.path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype, local_files_only=True).to(device)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
    return model, tokenizer, local
