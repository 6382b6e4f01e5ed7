"""A chat dataset and a source corpus from the Python standard library's own source files.

Every Python install ships its stdlib sources, so this data needs no download. A chat asks for one
function by module, signature and docstring; the assistant answers with the function body. Modules
are split deterministically (sha256 of the dotted module name) so that held-out prompts and source
come from modules the target never trained on.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names never read: test suites, third-party packages, generated codec tables, pydoc's
# generated topic strings. Directories that are not identifiers (site-packages, lib-dynload,
# config-3.x-...) are skipped because they are not importable module paths.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"})
SKIP_MODULE_PREFIXES = ("_sysconfigdata_",)


@dataclass(frozen=True)
class StdlibModule:
    """One stdlib source file: ``name`` is the dotted module name, ``source`` its text."""

    name: str
    source: str


def stdlib_root() -> Path:
    """The running interpreter's stdlib source folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(relpath: Path) -> str | None:
    """Dotted module name for a ``.py`` path relative to the stdlib root, or None to skip it.

    ``json/decoder.py`` -> ``json.decoder``; ``json/__init__.py`` -> ``json``. Returns None for
    skipped directories (``SKIP_DIRS``), non-identifier path parts and generated modules.
    """
    parts = list(relpath.with_suffix("").parts)
    if any(p in SKIP_DIRS or not p.isidentifier() for p in parts):
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or parts[-1].startswith(SKIP_MODULE_PREFIXES):
        return None
    return ".".join(parts)


def read_stdlib(root: Path | None = None) -> list[StdlibModule]:
    """Read every stdlib module source under ``root`` (default: ``stdlib_root()``).

    Returns:
        Modules sorted by dotted name; files that are not valid UTF-8 are skipped.

    Raises:
        FileNotFoundError: if ``root`` holds no ``.py`` file (a Python install without sources).
    """
    root = Path(root) if root is not None else stdlib_root()
    modules = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and d.isidentifier()]  # prune the walk
        for file in files:
            path = Path(folder, file)
            name = module_name(path.relative_to(root)) if file.endswith(".py") else None
            if name is None:
                continue
            try:
                modules.append(StdlibModule(name, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
    if not modules:
        raise FileNotFoundError(f"no Python sources under {root}: the embedded data needs a Python "
                                "install that ships its stdlib .py files (or pass another root)")
    return sorted(modules, key=lambda m: m.name)


def _unit_hash(key: str) -> float:
    """A uniform number in [0, 1) from sha256(key): stable across runs, machines and versions."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64


def is_heldout(module: str, heldout_fraction: float = 0.1) -> bool:
    """True when ``module`` (dotted name) belongs to the held-out split.

    Raises:
        ValueError: if ``heldout_fraction`` is not in (0, 1).
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1), e.g. 0.1")
    return _unit_hash(module) < heldout_fraction


def _strip_indent(lines: list[str], indent: str) -> list[str]:
    """Remove ``indent`` from lines that start with it; keep others (string contents) verbatim."""
    return ["" if not line.strip() else line[len(indent):] if line.startswith(indent) else line
            for line in lines]


def _functions(tree: ast.Module):
    """Yield (qualified class path, function node) for module-level functions and class methods."""
    stack = [("", node) for node in tree.body]
    while stack:
        prefix, node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix, node
        elif isinstance(node, ast.ClassDef):
            stack.extend((f"{prefix}{node.name}.", child) for child in node.body)


def extract_chats(source: str, module: str, max_body_lines: int = 40,
                  max_body_chars: int = 2000, max_prompt_chars: int = 2000) -> list[dict]:
    """Chat rows for the documented functions and methods of one module's source.

    The user turn names the module (and class), and shows the ``def`` header with its docstring,
    verbatim and dedented, in a Python code fence. The assistant turn is the rest of the body
    (comments included), dedented by the body's indentation.

    Args:
        source: the module's Python source text.
        module: its dotted name, used in the prompt and the row id (``module:Qual.name:line``).
        max_body_lines, max_body_chars: keep bodies of 1..max_body_lines lines and at most
            max_body_chars characters.
        max_prompt_chars: skip functions whose prompt is longer (very long docstrings).

    Returns:
        Rows ``{"id", "messages": [user, assistant]}``: module-level functions, then methods
        class by class, each in source order. Functions with no
        docstring, a body that is only the docstring, or code sharing a line with the ``def`` or
        the docstring are skipped. Source that does not parse yields [].
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = re.split(r"\r\n|\r|\n", source)  # ast's line breaks (not str.splitlines's \f etc.)
    rows = []
    for prefix, fn in _functions(tree):
        if ast.get_docstring(fn) is None or len(fn.body) < 2:
            continue
        doc, first = fn.body[0], fn.body[1]
        if doc.lineno == fn.lineno or first.lineno == doc.end_lineno:
            continue
        header = lines[fn.lineno - 1:doc.end_lineno]
        body = lines[doc.end_lineno:fn.end_lineno]
        def_indent = header[0][:len(header[0]) - len(header[0].lstrip())]
        body_line = lines[first.lineno - 1]
        body_indent = body_line[:len(body_line) - len(body_line.lstrip())]
        answer = "\n".join(_strip_indent(body, body_indent)).strip("\n")
        signature = "\n".join(_strip_indent(header, def_indent))
        kind = "method" if prefix else "function"
        where = f"In module `{module}`" + (f", class `{prefix[:-1]}`" if prefix else "")
        prompt = f"{where}, write the {kind}:\n```python\n{signature}\n```"
        n_lines = answer.count("\n") + 1
        if (not answer or n_lines > max_body_lines or len(answer) > max_body_chars
                or len(prompt) > max_prompt_chars):
            continue
        rows.append({"id": f"{module}:{prefix}{fn.name}:{fn.lineno}",
                     "messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": answer}]})
    return rows


def split_modules(modules: list[StdlibModule], heldout_fraction: float = 0.1
                  ) -> tuple[list[StdlibModule], list[StdlibModule]]:
    """Split modules into (train, heldout) by ``is_heldout``; each keeps the input order."""
    held = [m for m in modules if is_heldout(m.name, heldout_fraction)]
    return [m for m in modules if not is_heldout(m.name, heldout_fraction)], held


def build_stdlib_chats(out_dir: str | Path, modules: list[StdlibModule] | None = None,
                       heldout_fraction: float = 0.1, max_train: int = 4000,
                       max_heldout: int = 400, **extract_kwargs) -> dict[str, int]:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (OpenAI ``messages`` rows) into ``out_dir``.

    Rows are ordered by sha256 of their id (a fixed shuffle over all modules) and capped, so the
    caps sample every module evenly and the files are byte-identical across runs.

    Args:
        out_dir: folder to write into (created if missing).
        modules: sources to use; default ``read_stdlib()``.
        heldout_fraction: share of modules held out (by sha256 of the module name).
        max_train, max_heldout: caps on the number of rows per file.
        **extract_kwargs: ``max_body_lines``, ``max_body_chars``, ``max_prompt_chars`` for
            ``extract_chats``.

    Returns:
        ``{"train": rows written, "heldout": rows written, "train_modules": n,
        "heldout_modules": n}``.

    Raises:
        ValueError: if a split ends up empty (caps or fraction too small for the sources given).
    """
    modules = read_stdlib() if modules is None else modules
    train_mods, held_mods = split_modules(modules, heldout_fraction)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"train_modules": len(train_mods), "heldout_modules": len(held_mods)}
    for split, mods, cap in (("train", train_mods, max_train), ("heldout", held_mods, max_heldout)):
        rows = [r for m in mods for r in extract_chats(m.source, m.name, **extract_kwargs)]
        rows = sorted(rows, key=lambda r: hashlib.sha256(r["id"].encode()).digest())[:cap]
        if not rows:
            raise ValueError(f"the {split} split has no chat rows: raise max_{split} or use more "
                             "modules / a different heldout_fraction")
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        counts[split] = len(rows)
    return counts
