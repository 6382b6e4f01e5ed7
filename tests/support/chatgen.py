"""Synthetic chat files for the train tests: deterministic rows of stdlib-like words."""
from __future__ import annotations

import json
from pathlib import Path

WORDS = "the of and to in is for return def self if else value list dict none true false data file".split()


def write_chats(path: Path, n: int) -> None:
    """``n`` OpenAI-style rows (``id`` r0..r{n-1}, one user and one assistant turn of 30-54 words)."""
    with path.open("w") as f:
        for i in range(n):
            a = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(30 + i % 25))
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i} " + WORDS[i % 20]},
                                                            {"role": "assistant", "content": a}]}) + "\n")
