"""The house: every source file visible to the tools that skip build outputs, `make clean` keeping runs, and the
tests' folders saying what runs (tests/unit by package, tests/integration every test marked `integration`)."""
from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

from paths import REPO

# Folder names that common global ignore files (and code-indexing tools) treat as build output.
BUILD_OUTPUT_NAMES = ("target", "build", "dist", "out", "bin", "obj", "node_modules", "vendor")
GLOBAL_IGNORE = "\n".join([*(f"{n}/" for n in BUILD_OUTPUT_NAMES), "*.egg-info/", "__pycache__/", ".venv/", ""])


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_no_source_folder_is_named_like_a_build_output():
    bad = [p for p in _tracked() if set(Path(p).parts[:-1]) & set(BUILD_OUTPUT_NAMES)]
    assert not bad, f"source files under folders that global ignore rules skip: {bad[:10]}"


def test_common_global_ignore_rules_ignore_no_tracked_file(tmp_path):
    rules = tmp_path / "global-gitignore"
    rules.write_text(GLOBAL_IGNORE)
    sources = [p for p in _tracked() if p.endswith((".py", ".yaml", ".md", ".toml"))]
    done = subprocess.run(["git", "-c", f"core.excludesFile={rules}", "check-ignore", "--no-index", "--stdin"],
                          cwd=REPO, input="\n".join(sources), capture_output=True, text=True)
    assert done.returncode == 1 and not done.stdout.strip(), f"ignored by common rules: {done.stdout.split()[:10]}"


def _make_dry(target: str) -> list[str]:
    """The words of the commands ``make -n TARGET`` would run (run from ``make test`` too: no make
    variables inherited, no directory banners)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", "--no-print-directory", target], cwd=REPO, env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_make_clean_keeps_runs():
    clean = _make_dry("clean")
    assert "rm" in clean and "runs" not in clean, clean
    assert _make_dry("clean-runs") == ["rm", "-rf", "runs"]


# tests/unit/<folder>: the packages, bench/ scripts and the repository-wide checks ("project")
UNIT_FOLDERS = {"storage", "cache_schema", "training", "pipeline", "ops", "bench", "project"}


def _test_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("test_*.py"))


def _marks_integration(expr: ast.expr) -> bool:
    """``expr`` holds ``pytest.mark.integration`` (a decorator, a ``pytestmark`` value or list)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "integration" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(expr))


def _tests(tree: ast.Module) -> list[ast.FunctionDef]:
    """The test functions pytest collects from a module: ``test_*`` at the top and in ``Test*`` classes."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found.append(node)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found += [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name.startswith("test")]
    return found


def test_integration_tests_carry_the_marker_and_unit_tests_do_not():
    """Every test under tests/integration is marked ``integration`` (the module's ``pytestmark`` or its own
    decorator), and no test under tests/unit is: the folder says what ``-m "not integration"`` runs."""
    unmarked, marked = [], []
    for path in _test_files():
        rel = path.relative_to(REPO / "tests")
        tree = ast.parse(path.read_text())
        module_mark = any(_marks_integration(n.value) for n in tree.body if isinstance(n, ast.Assign)
                          and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets))
        if rel.parts[0] == "integration":
            unmarked += [f"{rel}::{t.name}" for t in _tests(tree)
                         if not module_mark and not any(_marks_integration(d) for d in t.decorator_list)]
        elif rel.parts[0] == "unit" and (module_mark or any(_marks_integration(n) for n in ast.walk(tree)
                                                             if isinstance(n, ast.expr))):
            marked.append(str(rel))
    assert not unmarked, f"tests under tests/integration without the integration marker: {unmarked}"
    assert not marked, f"integration markers under tests/unit (move those tests to tests/integration): {marked}"


def test_test_files_are_in_unit_or_integration_with_distinct_names():
    """Test modules live in tests/unit/<package>/ or tests/integration/ (tests/envs holds scripts run in other
    environments, tests/support helpers: neither is collected), and no two share a basename (pytest's
    default import mode imports each by its basename)."""
    misplaced = [str(p.relative_to(REPO)) for p in _test_files()
                 if not (p.parent == REPO / "tests" / "integration"
                         or (p.parent.parent == REPO / "tests" / "unit" and p.parent.name in UNIT_FOLDERS))]
    assert not misplaced, f"test files outside tests/unit/<package>/ and tests/integration/: {misplaced}"
    names = [p.name for p in _test_files()]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
