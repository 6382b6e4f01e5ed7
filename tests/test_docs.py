"""The README and docs/ stay true: size and front matter, no dead link, and every command block marked
runnable is run (on the tiny config) with its recorded exit code and output.

A fenced block is runnable when its info string holds the word ``runnable``:

- ```` ```sh runnable ````: each line (``\\`` continues it) is a command that must exit 0;
- ```` ```console runnable ````: ``$ `` lines are commands, the lines after one are its recorded output
  and ``[exit N]`` its exit code (0 when absent). Output is compared line by line after the workspace
  path is written as ``/tmp/dspark-demo``, numbers with a decimal point are masked (timings, ages) and
  blank runs are collapsed; a line ``(... omitted ...)`` skips the comparison.

Each page runs in its own workspace: ``conf/`` (the repository's), ``target/`` (the tiny random-weight
Qwen3 of the ``tiny_target_dir`` fixture) and ``cases/`` (``tests/fixtures/cases``), with this
environment's ``python`` and ``ops`` first on PATH and ``DSPARK_HOME`` inside it (so a page's verify
cursors and embedded build are its own).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
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


VOLATILE = [  # what differs between two runs of the same command: masked before comparing
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?"), "TIME"),  # commit times
    (re.compile(r"\b[A-Za-z][\w.-]*:\d+\b"), "HOST:PID"),  # the writer of a shard
    (re.compile(r"\S+(\s+would delete)"), r"AGE\1"),  # ops gc's age column
    (re.compile(r"\d+\.\d+"), "#"),  # timings, ages, rates
]


def _normal(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = line.rstrip()
        for pattern, mask in VOLATILE:
            line = pattern.sub(mask, line)
        line = re.sub(r"\s+", " ", line)
        if line.strip():
            out.append(line.strip())
    return out


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, in_fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    head = "\n".join(lines[:30])
    for needed in ("make demo", "make test", "min on 2 cores", "Contents:", "docs/results.md", "docs/cluster.md"):
        assert needed in head, f"the first 30 lines of README.md lack {needed!r}"
    topics = ("results", "training-recipe", "confidence", "benchmarks", "feature-modes", "reasoning",
              "export-formats", "ops", "object-storage", "failures", "testing", "design", "cluster")
    for topic in topics:
        assert (REPO / "docs" / f"{topic}.md").is_file(), f"docs/{topic}.md is missing"


def test_no_dead_links():
    dead = []
    for page in PAGES:
        in_fence = False
        for i, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_fence = not in_fence
            if in_fence:
                continue
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    dead.append(f"{page.relative_to(REPO)}:{i}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    dead.append(f"{page.relative_to(REPO)}:{i}: {target} (no such heading)")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_code_cites_only_docs_that_exist():
    """Docstrings and comments cite ``docs/<page>.md``; each must exist, and no design file outside the
    repository is cited."""
    missing = []
    for path in [*REPO.glob("*/**/*.py"), *REPO.glob("conf/*.yaml"), REPO / "Makefile"]:
        if any(part.startswith(".venv") for part in path.parts) or path == Path(__file__):
            continue
        text = path.read_text()
        missing += [f"{path.relative_to(REPO)}: {m}" for m in re.findall(r"docs/[\w\-]+\.md", text)
                    if not (REPO / m).is_file()]
        if re.search(r"(?<!docs/)DESIGN\.md|shared/DESIGN", text):
            missing.append(f"{path.relative_to(REPO)}: cites a DESIGN.md outside the repository")
    assert not missing, "\n".join(missing)


def test_docs_quote_the_tiny_recipe_as_configured():
    """The recipe the docs call current is the one in conf/tiny.yaml (epochs and optimizer)."""
    conf = yaml.safe_load((REPO / "conf" / "tiny.yaml").read_text())["train"]
    results = " ".join((REPO / "docs" / "results.md").read_text().split())
    assert f"{conf['epochs']} epochs" in results and f"`muon_lr` {conf['muon_lr']}" in results
    for page in PAGES:
        for n in re.findall(r"it now trains (\d+)", " ".join(page.read_text().split())):
            assert int(n) == conf["epochs"], f"{page.name} says the demo now trains {n} epochs"


def test_runnable_blocks_are_found():
    """The marker is read: the README's checks and the ops page's recorded session are runnable."""
    readme = blocks(REPO / "README.md")
    assert readme and all(b.kind == "sh" for b in readme)
    assert any("dry_run=true" in c for b in readme for c in sh_commands(b))
    steps = [s for b in blocks(REPO / "docs" / "ops.md") for s in console_steps(b)]
    assert len(steps) >= 10 and {s[2] for s in steps} == {0, 1}


@pytest.fixture
def workspace(tmp_path, tiny_target_dir):
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    shutil.copytree(tiny_target_dir, tmp_path / "target")
    shutil.copytree(REPO / "tests" / "fixtures" / "cases", tmp_path / "cases")
    return tmp_path


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", COLUMNS="200",
               DSPARK_HOME=str(cwd / ".dspark"))  # the page's own verify cursors and embedded build
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _record(page: Path, recorded: dict[int, list[str]]) -> None:
    """Rewrite the console blocks of ``page`` (keyed by their first line) with the lines just run."""
    lines = page.read_text().splitlines()
    for block in sorted(blocks(page), key=lambda b: -b.line):
        if block.line in recorded:
            lines[block.line:block.line + len(block.text)] = recorded[block.line]
    page.write_text("\n".join(lines) + "\n")


def _check(page: Path, workspace: Path) -> list[str]:
    """Run the runnable blocks of ``page`` in ``workspace``; the problems found, one string each.

    With ``DSPARK_DOCS_RECORD=1`` the console blocks' outputs are rewritten with what the commands
    print now (to re-record a page after a deliberate change), and only exit codes are checked."""
    problems, recording, new_text = [], os.environ.get("DSPARK_DOCS_RECORD") == "1", {}
    for block in blocks(page):
        where = f"{page.relative_to(REPO)}:{block.line}"
        if block.kind == "sh":
            for command in sh_commands(block):
                done = _run(command, workspace)
                if done.returncode != 0:
                    problems.append(f"{where}: `{command}` exited {done.returncode}:\n{done.stderr[-2000:]}")
            continue
        text = []
        for command, recorded, code in console_steps(block):
            done = _run(command, workspace)
            printed = (done.stdout + done.stderr).replace(str(workspace), "/tmp/dspark-demo").splitlines()
            omitted = any("omitted" in line for line in recorded)
            text += [f"$ {command}", *(recorded if omitted else printed)]
            text += [f"[exit {done.returncode}]"] if done.returncode and not omitted else []
            if done.returncode != code:
                problems.append(f"{where}: `{command}` exited {done.returncode}, the page says {code}:\n"
                                f"{done.stdout[-1500:]}{done.stderr[-1500:]}")
                continue
            if omitted or recording:
                continue
            got = _normal(printed)
            want = _normal(recorded)
            if got != want:
                diff = "\n".join(f"  page: {w!r}\n  now:  {g!r}" for w, g in zip(want + [""] * len(got), got + [""] * len(want))
                                 if w != g)
                problems.append(f"{where}: `{command}` printed other output than the page records:\n{diff}")
        new_text[block.line] = text
    if recording:
        _record(page, new_text)
    return problems


RUNNABLE_PAGES = [p for p in PAGES if blocks(p)]


@pytest.mark.integration
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[p.name for p in RUNNABLE_PAGES])
def test_runnable_commands_run_as_recorded(page, workspace):
    problems = _check(page, workspace)
    assert not problems, "\n\n".join(problems)
