"""The embedded default target and data: a tiny Qwen3 and chats built from the Python stdlib.

``ensure_embedded()`` builds them once into ``$DSPARK_HOME`` (default ``~/.cache/dspark``);
``resolve_embedded("embedded:tiny")`` and ``resolve_embedded("embedded:stdlib/train.jsonl")``
map the project's pseudo-URLs to local paths. ``python -m pipeline.embedded`` builds and reports.
"""
from pipeline.embedded.build import (BuildSpec, EmbeddedPaths, EmbeddedSpecMismatch,
                                     build_embedded, ensure_embedded, resolve_embedded)
from pipeline.embedded.stdlib_chats import build_stdlib_chats, extract_chats, is_heldout
from pipeline.embedded.target import TargetSpec
from pipeline.embedded.tokenizer import build_tokenizer

__all__ = ["BuildSpec", "EmbeddedPaths", "EmbeddedSpecMismatch", "TargetSpec", "build_embedded",
           "build_stdlib_chats", "build_tokenizer", "ensure_embedded", "extract_chats",
           "is_heldout", "resolve_embedded"]
