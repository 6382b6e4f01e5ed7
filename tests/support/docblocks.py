"""The runnable blocks of README.md and docs/*.md (``tests/unit/project/test_docs.py`` checks that they are
found, ``tests/integration/test_docs_commands.py`` runs them).

A fenced block is runnable when its info string holds the word ``runnable``:

- ```` ```sh runnable ````: each line (``\\`` continues it) is a command that must exit 0;
- ```` ```console runnable ````: ``$ `` lines are commands, the lines after one are its recorded output
  and ``[exit N]`` its exit code (0 when absent).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(.*)$")


@dataclass
class Block:
    page: Path
    line: int
    kind: str  # "sh" or "console"
    text: list[str] = field(default_factory=list)


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` whose info string holds ``runnable``, in page order."""
    found, current = [], None
    for i, line in enumerate(page.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and current is None:
            info = m.group(1).split()
            current = Block(page, i, info[0] if info else "", []) if "runnable" in info else False
        elif m:
            if current:
                found.append(current)
            current = None
        elif current:
            current.text.append(line)
    return found


def sh_commands(block: Block) -> list[str]:
    """Logical command lines of an ``sh`` block (``\\`` continuations joined, comments dropped)."""
    out, pending = [], ""
    for line in block.text:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        out.append(pending)
        pending = ""
    return out


def console_steps(block: Block) -> list[tuple[str, list[str], int]]:
    """``(command, recorded output lines, exit code)`` of each ``$`` line of a ``console`` block."""
    steps = []
    for line in block.text:
        if line.startswith("$ "):
            steps.append([line[2:], [], 0])
        elif steps:
            m = re.fullmatch(r"\[exit (\d+)\]", line.strip())
            if m:
                steps[-1][2] = int(m.group(1))
            else:
                steps[-1][1].append(line)
    return [tuple(s) for s in steps]
