"""The README and docs/ stay true: every command block marked runnable is run (on the tiny config) with its
recorded exit code and output (the pages' other checks: tests/unit/project/test_docs.py). The blocks, as
``tests/support/docblocks.py`` reads them:

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
from pathlib import Path

import pytest

from docblocks import PAGES, blocks, console_steps, sh_commands
from paths import REPO


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
