"""The README and docs/ stay true: size and front matter, no dead link, the code cites only docs pages that
exist, and the runnable command blocks are found (tests/integration/test_docs_commands.py runs them)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from docblocks import PAGES, blocks, console_steps, sh_commands
from paths import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


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
