"""``ops publish EXPORT_DIR REPO_ID``: upload one export directory to the Hugging Face Hub.

The directory is what the export stage wrote (``config.json``, ``model.safetensors``) with the model
card the pipeline writes beside them (``README.md``, ``training_summary.json``: :mod:`pipeline.model_card`).
``--dry-run`` lists what would be uploaded and checks it, touching no network. The upload itself is
``huggingface_hub``'s ``create_repo`` + ``upload_folder`` (token from ``HF_TOKEN`` or ``hf auth login``);
an export on object storage is copied to a local temporary folder first.
"""
from __future__ import annotations

import tempfile
from typing import Any

from ops.common import UsageError
from storage import filesystem

REQUIRED = ("config.json", "model.safetensors", "README.md", "training_summary.json")


def listing(url: str) -> list[dict[str, Any]]:
    """Files of an export directory with their bytes, sorted by name.

    Raises:
        UsageError: the directory is absent, or lacks one of :data:`REQUIRED` (the message says which
            stage writes it).
    """
    fs, path = filesystem(url)
    if not fs.isdir(path):
        raise UsageError(f"{url} is not a directory: give an export directory (<run_dir>/export/<drafter>)")
    files = sorted((info["name"].rsplit("/", 1)[-1], int(info["size"])) for info in fs.ls(path, detail=True)
                   if info["type"] == "file")
    missing = [f for f in REQUIRED if f not in dict(files)]
    if missing:
        raise UsageError(f"{url} lacks {', '.join(missing)}: "
                         + ("run +stage=export (it writes the weights and the model card)"
                            if {"config.json", "model.safetensors"} & set(missing)
                            else "rerun +stage=export (the model card is written after it and after evaluate)"))
    return [{"file": name, "bytes": size} for name, size in files]


def publish(url: str, repo_id: str, *, dry_run: bool = False, private: bool = False,
            revision: str | None = None) -> tuple[dict[str, Any], int]:
    """Upload (or, with ``dry_run``, list) export directory ``url`` to Hub repository ``repo_id``.

    Returns:
        ``({"repo_id", "dry_run", "files": [{"file", "bytes"}], "bytes", "commit" (the upload's URL, None on a
        dry run)}, 0)``.
    Raises:
        UsageError: a repo id that is not ``owner/name``, or an incomplete directory (:func:`listing`).
    """
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UsageError(f"repo id {repo_id!r} is not OWNER/NAME (e.g. my-org/qwen3-4b-dspark)")
    files = listing(url)
    out = {"repo_id": repo_id, "dry_run": dry_run, "private": private, "revision": revision, "files": files,
           "bytes": sum(f["bytes"] for f in files), "commit": None}
    if dry_run:
        return out, 0
    from fsspec.implementations.local import LocalFileSystem
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    fs, path = filesystem(url)
    with tempfile.TemporaryDirectory() as tmp:
        folder = path
        if not isinstance(fs, LocalFileSystem):
            fs.get(path.rstrip("/") + "/", tmp + "/", recursive=True)
            folder = tmp
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                   commit_message="Upload drafter export (ops publish)")
    out["commit"] = str(commit)
    return out, 0


def render_publish(p: dict[str, Any]) -> str:
    head = ("would upload" if p["dry_run"] else "uploaded") + f" to {p['repo_id']}" + (
        " (private)" if p["private"] else "") + (f" at {p['revision']}" if p["revision"] else "") + ":"
    rows = [f"  {f['file']:<28} {f['bytes']:>14,} B" for f in p["files"]]
    tail = f"  {len(p['files'])} files, {p['bytes']:,} B" + ("" if p["commit"] is None else f"; {p['commit']}")
    return "\n".join([head, *rows, tail])
