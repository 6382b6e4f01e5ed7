"""Input names of the stage layer: the embedded demo assets and paths made absolute for Ray workers."""
from __future__ import annotations

import os


def resolve_input(url: str) -> str:
    """``embedded:...`` names (the built-in demo target and data) to local paths, built on first
    use; any other URL unchanged."""
    if url.startswith("embedded:"):
        from pipeline.embedded import resolve_embedded

        return resolve_embedded(url)
    return url


def absolute(url: str) -> str:
    """A plain relative path made absolute against the current directory (Ray workers run in other
    directories); URLs with a scheme (``s3://``, ``file://``, ``memory://``) and ``embedded:`` names
    unchanged; ``~`` expanded."""
    if "://" in url or url.startswith("embedded:"):
        return url
    return os.path.abspath(os.path.expanduser(url))
