"""The one filesystem abstraction for data paths: fsspec URLs (``s3://``, ``file://``, plain paths).

The bottom layer of the product: every package may import it, it imports none of them.

Credentials and endpoints come from each backend's standard environment (for S3: AWS_* variables,
including AWS_ENDPOINT_URL); they are never taken from configs, logged or written to summaries.
"""
from __future__ import annotations

import json
from typing import Any

import fsspec


def join(url: str, *parts: str) -> str:
    """Join path parts onto a URL with ``/`` (never ``os.path``)."""
    out = url.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the backend path for ``url``."""
    return fsspec.core.url_to_fs(url)


def write_json(url: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``url``, creating parent folders."""
    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def read_json(url: str) -> Any:
    """Read a JSON object from ``url``. Raises FileNotFoundError if absent."""
    fs, path = filesystem(url)
    with fs.open(path, "r") as f:
        return json.load(f)
