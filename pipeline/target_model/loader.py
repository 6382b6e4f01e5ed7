"""Locating and loading the frozen target (transformers), strictly from local files.

Nothing is ever downloaded at run time: ``target.path`` is a local model directory, the built-in
``embedded:tiny`` target, or a hub id that is already in the local Hugging Face cache.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.config import TargetConfig, torch_dtype
from pipeline.errors import TargetNotFoundError

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _not_found(path: str) -> TargetNotFoundError:
    """The error for a ``target.path`` that is not on this machine, with the download line that fixes it.

    A hub id (``Qwen/Qwen3-4B``) gets ``hf download Qwen/Qwen3-4B --local-dir /models/Qwen3-4B`` and
    ``target.path=/models/Qwen3-4B``; a local path gets ``hf download <hub id> --local-dir <that path>``.
    """
    never = "this pipeline never downloads weights at run time"
    if _HUB_ID.match(path) and not path.startswith(".") and not Path(path).expanduser().exists():
        local = f"/models/{path.rsplit('/', 1)[-1]}"
        return TargetNotFoundError(
            f"target.path={path!r} is not a local model directory and is not in the local Hugging Face cache, "
            f"and {never}. Download it once on a machine with network access (`hf download {path} "
            f"--local-dir {local}`), copy {local} to every node (or a shared filesystem), and run with "
            f"target.path={local} (a folder holding config.json, the safetensors weights and the tokenizer files).")
    what = "holds no config.json" if Path(path).expanduser().is_dir() else "does not exist"
    return TargetNotFoundError(
        f"target.path={path!r}: the folder {what}, and {never}. Download the model into it once on a machine "
        f"with network access (`hf download <hub id> --local-dir {path}`, e.g. <hub id> = Qwen/Qwen3-4B), "
        "copy it to every node (or a shared filesystem), and run again (the folder holds config.json, the "
        "safetensors weights and the tokenizer files).")


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
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per actor drowns the stage's own bar
    local = resolve_target_path(cfg.path)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch_dtype(cfg.dtype), local_files_only=True).to(device)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
    return model, tokenizer, local


def stop_ids(model, tokenizer) -> set[int]:
    """The end-of-turn / end-of-sequence ids a decoding loop stops at: the tokenizer's
    ``eos_token_id`` and every id of the model's ``generation_config.eos_token_id`` (an int or a list)."""
    import numpy as np

    ids = np.atleast_1d(model.generation_config.eos_token_id or []).tolist()
    return {tokenizer.eos_token_id, *ids} - {None}
