"""Output helpers shared by the ops commands: aligned text tables, key/value blocks, sizes, JSON.

Every command builds one JSON-ready dict (its ``--json`` output) and a renderer turns that dict
into the human view with these helpers, so the two views never disagree.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """``n`` bytes as a short binary-unit string (``1.5 MiB``); ``-`` for None."""
    if n is None:
        return "-"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def cell(value: Any) -> str:
    """One table cell: ``-`` for None, thousands separators for ints, 4 significant digits for floats."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], *,
          headers: Sequence[str] | None = None) -> str:
    """Rows as an aligned text table (numbers right-aligned, text left-aligned).

    Args:
        rows: dicts holding at least ``columns`` (a missing key shows as ``-``).
        columns: keys to show, in order; headers: their titles (default: the keys).
    Returns:
        The table text without a trailing newline; ``(none)`` when there are no rows.
    """
    if not rows:
        return "(none)"
    titles = list(headers or columns)
    body = [[cell(row.get(c)) for c in columns] for row in rows]
    numeric = [all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]
    widths = [max(len(t), *(len(line[i]) for line in body)) for i, t in enumerate(titles)]

    def fmt(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    return "\n".join([fmt(titles), *(fmt(line) for line in body)])


def key_values(pairs: Iterable[tuple[str, Any]]) -> str:
    """``key: value`` lines with the values aligned (values formatted like table cells)."""
    pairs = list(pairs)
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k + ':':<{width + 1}} {cell(v)}" for k, v in pairs)


def to_json(payload: Any) -> str:
    """The ``--json`` form of a command's result: indented, sorted keys, non-JSON values as str."""
    return json.dumps(payload, indent=2, sort_keys=True, default=str)


def preview(items: Sequence[Any], limit: int = 10) -> str:
    """The first ``limit`` items joined by commas, with ``(+N more)`` when cut; ``-`` when empty."""
    if not items:
        return "-"
    shown = ", ".join(str(i) for i in items[:limit])
    return shown if len(items) <= limit else f"{shown} (+{len(items) - limit:,} more)"
