"""Named evaluation prompt sets in the layouts public benchmarks ship in (``evaluate.prompt_sets``).

Each set is one local or fsspec JSONL / Parquet file read through the chat ingestion
(:func:`pipeline.chats.ingest.iter_chats`, same bad-row handling) with a row mapper that turns the
benchmark's prompt field into a one-turn user chat; the evaluate stage renders it with the target's
chat template, as every chat (:func:`pipeline.stages.evaluate.eval_prompts`). Formats and the field
each reads, as the datasets are distributed:

========== =============================== ==========================================================
format     field                           source
========== =============================== ==========================================================
mt_bench   ``turns`` (list; the first)     FastChat ``question.jsonl`` (the second turn needs the
                                           model's first answer, so only the first is drafted here)
gsm8k      ``question``                    openai/gsm8k (``question`` / ``answer``)
humaneval  ``prompt``                      openai/openai_humaneval (code to complete)
math500    ``problem``                     HuggingFaceH4/MATH-500
mbpp       ``text``                        google-research mbpp (full; sanitized: ``prompt``)
field      ``field`` of the set's config   anything else with one text field
chat       ``messages`` / ``conversations`` this project's chat rows (up to the first answer)
========== =============================== ==========================================================

A row without its field (or with a non-text one) is skipped with reason ``missing_field`` and counted,
as any bad row. ``match`` keeps only the rows whose fields match regular expressions (``re.search`` on
the field's text, every pattern): one benchmark file split into tasks, e.g. MT-Bench by ``category``, or
the demo's held-out chats by module kind (``id``); the others are counted as ``not_in_set``.
"""
from __future__ import annotations

import re
from typing import Any

from pipeline.chats.ingest import RowError, RowMapper
from pipeline.errors import ConfigError

FIELDS = {"mt_bench": "turns", "gsm8k": "question", "humaneval": "prompt", "math500": "problem", "mbpp": "text"}
FORMATS = (*FIELDS, "field", "chat")


def row_mapper(fmt: str, field: str | None = None, match: dict[str, str] | None = None) -> RowMapper | None:
    """The :data:`pipeline.chats.ingest.RowMapper` of a prompt-set format: a row -> ``{"messages":
    [{"role": "user", "content": text}]}`` (``chat``: the row itself); None for ``chat`` without ``match``.

    Raises:
        ConfigError: an unknown format, ``field`` format without a field name, or a ``match`` pattern that
            is not a regular expression (the message starts with the prompt set's key: ``format``,
            ``field`` or ``match``).
    """
    try:
        patterns = {k: re.compile(v) for k, v in (match or {}).items()}
    except re.error as e:
        raise ConfigError(f"match: {e} in {match}") from None

    def matches(obj: Any) -> None:
        for k, pat in patterns.items():
            value = obj.get(k) if isinstance(obj, dict) else None
            if value is None or not pat.search(str(value)):
                raise RowError("not_in_set", f"{k}={value!r} does not match {pat.pattern!r}")

    if fmt == "chat":
        if not patterns:
            return None

        def keep(obj: Any) -> Any:
            matches(obj)
            return obj

        return keep
    if fmt not in FORMATS:
        raise ConfigError(f"format: unknown format {fmt!r}; use one of {list(FORMATS)}")
    if fmt == "field" and not field:
        raise ConfigError("field: format 'field' needs `field: <the prompt's column>`")
    name = field if fmt == "field" or field else FIELDS[fmt]

    def to_chat(obj: Any) -> dict[str, Any]:
        matches(obj)
        value = obj.get(name) if isinstance(obj, dict) else None
        if fmt == "mt_bench" and isinstance(value, list) and value:
            value = value[0]
        if not isinstance(value, str) or not value.strip():
            raise RowError("missing_field", f"no text in field {name!r} ({fmt} format)")
        return {"messages": [{"role": "user", "content": value}]}

    return to_chat
