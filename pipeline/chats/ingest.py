"""Chat ingestion: JSONL / Parquet rows in the forms people have, normalised to ``messages``.

Accepted row forms (one chat per row):
- OpenAI ``{"messages": [{"role": ..., "content": str | [{"type": "text", "text": ...}, ...]}]}``
- ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``
- ``{"conversations": [{"role": ..., "content": ...}]}``

An assistant turn's reasoning (the thinking trace of a reasoning model) is read from
``reasoning_content`` (OpenAI-compatible APIs, vLLM, DeepSeek; what Qwen3's chat template reads) or
its aliases ``reasoning`` and ``thinking`` (the first present, in that order) and kept as
``reasoning_content``; reasoning written inline in ``content`` as ``<think>...</think>`` is kept as
written. Either form reaches the chat template unchanged (see ``pipeline.chats.render``).

A bad row never stops the run: it becomes a :class:`BadRow` with a reason code (see ``REASONS``)
that the stage counts and writes to its quarantine file with the source file and line. A bad file
(missing, unreadable, not JSONL/Parquet) raises :class:`BadInputFileError`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pyarrow.parquet as pq

from pipeline.errors import BadInputFileError
from storage import filesystem

# A chat row above this size is skipped before any decoding or tokenization (bytes of the JSONL line, or
# of the Parquet row as JSON): tokenizing one 50 MB row took 9 GB of memory, and no sample keeps more than
# data.max_length tokens of it. 4 MiB is about 100 times the longest Qwen3-4B recipe sample (4,096 tokens).
MAX_ROW_BYTES = 4 * 2**20

# reason code -> what a user reads in the quarantine file
REASONS = {
    "row_too_large": f"the row is larger than {MAX_ROW_BYTES:,} bytes",
    "invalid_utf8": "the line is not valid UTF-8",
    "invalid_json": "the line is not valid JSON",
    "not_a_chat": "no 'messages' or 'conversations' list in the row",
    "empty_conversation": "the conversation has no turns",
    "bad_type": "a turn or its content has the wrong type (content must be text)",
    "unknown_role": "a turn has a role other than system/user/assistant (human/gpt)",
    "no_user_turn": "an assistant turn comes before any user turn",
    "empty_answer": "an assistant turn is empty or whitespace only (no answer and no reasoning)",
    "no_answer": "no assistant turn: nothing to supervise",
    "template_error": "the target's chat template failed on this chat",
    "template_rewrites_content": "the chat template changes message text, so supervision cannot be located",
    "no_supervised_tokens": "no supervised token is left after truncation to max_length",
    "too_few_loss_tokens": "fewer supervised tokens than data.min_loss_tokens",
    "missing_field": "the row lacks its prompt set's prompt field, or it is not text (pipeline.chats.prompt_sets)",
    "not_in_set": "the row does not match its prompt set's match patterns (pipeline.chats.prompt_sets)",
}

# where an assistant turn's reasoning is read from, first present wins; normalised to the first name
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")

_ROLE_MAP = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
             "system": "system"}


@dataclass(frozen=True)
class Chat:
    """One normalised chat. ``row`` is the 0-based line (JSONL) or row (Parquet) index in ``path``."""

    messages: tuple[dict[str, str], ...]
    source: int  # index of the input file in the stage's file list
    row: int
    path: str
    row_id: str | None = None  # the row's own "id" field, if any


@dataclass(frozen=True)
class BadRow:
    """A skipped row: where it is, why (a ``REASONS`` code) and a short detail."""

    source: int
    row: int
    path: str
    reason: str
    detail: str = ""
    row_id: str | None = None

    def record(self) -> dict[str, Any]:
        """JSON record for the quarantine file (``line`` is 1-based, as editors show it)."""
        return {"source": self.path, "line": self.row + 1, "row": self.row, "id": self.row_id,
                "reason": self.reason, "detail": self.detail or REASONS[self.reason]}


class RowError(ValueError):
    """Raised by :func:`normalize_messages` with a ``REASONS`` code in ``reason``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise RowError("bad_type", f"{where}: only text content parts are supported")
        return "".join(parts)
    raise RowError("bad_type", f"{where}: content is {type(content).__name__}, expected text")


def normalize_messages(obj: Any, *, require_answer: bool = True) -> tuple[dict[str, str], ...]:
    """Validate one parsed row and return its turns as ``({"role", "content"}, ...)``; an assistant
    turn with reasoning (a ``REASONING_FIELDS`` field) also has ``"reasoning_content"``.

    Args:
        obj: the parsed JSON object (or Parquet row as a dict).
        require_answer: True for the cache stage (a chat with no assistant turn has nothing to
            supervise); False for generate, where a chat ending in a user turn is a prompt.

    Raises:
        RowError: with a ``REASONS`` code.
    """
    if not isinstance(obj, dict):
        raise RowError("not_a_chat", f"row is a {type(obj).__name__}, expected an object")
    turns = obj.get("messages", obj.get("conversations"))
    if not isinstance(turns, list):
        raise RowError("not_a_chat")
    if not turns:
        raise RowError("empty_conversation")
    out, seen_user, seen_answer = [], False, False
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("bad_type", f"turn {i} is a {type(turn).__name__}, expected an object")
        role_raw = turn.get("role", turn.get("from"))
        role = _ROLE_MAP.get(role_raw) if isinstance(role_raw, str) else None
        if role is None:
            raise RowError("unknown_role", f"turn {i} has role {role_raw!r}")
        content = _text(turn.get("content", turn.get("value")), f"turn {i}")
        msg = {"role": role, "content": content}
        if role == "user":
            seen_user = True
        elif role == "assistant":
            if not seen_user:
                raise RowError("no_user_turn", f"turn {i} answers before any user turn")
            field_ = next((f for f in REASONING_FIELDS if turn.get(f) is not None), None)
            if field_ is not None:
                msg["reasoning_content"] = _text(turn[field_], f"turn {i} {field_}")
            if not content.strip() and not msg.get("reasoning_content", "").strip():
                raise RowError("empty_answer", f"turn {i}")
            seen_answer = True
        out.append(msg)
    if require_answer and not seen_answer:
        raise RowError("no_answer")
    if not seen_user:
        raise RowError("no_user_turn", "the chat has no user turn")
    return tuple(out)


def _row_id(obj: Any) -> str | None:
    rid = obj.get("id") if isinstance(obj, dict) else None
    return str(rid) if rid is not None else None


RowMapper = Callable[[Any], Any]
"""Turns a parsed row of another layout (a benchmark's question field) into a chat row, or raises RowError."""


def _parse(obj: Any, source: int, row: int, path: str, require_answer: bool,
           to_chat: RowMapper | None = None) -> Chat | BadRow:
    try:
        msgs = normalize_messages(obj if to_chat is None else to_chat(obj), require_answer=require_answer)
    except RowError as e:
        return BadRow(source, row, path, e.reason, e.detail, _row_id(obj))
    return Chat(msgs, source, row, path, _row_id(obj))


def _iter_jsonl(fs, path: str, source: int, url: str, require_answer: bool,
                span: "ShardSpan | None" = None, to_chat: RowMapper | None = None) -> Iterator[Chat | BadRow]:
    with fs.open(path, "rb") as f:
        first = 0
        if span is not None:
            f.seek(span.byte_start)
            first = span.row_start
        for row, raw in enumerate(f, start=first):
            if span is not None and row >= span.row_end:
                break
            if len(raw) > MAX_ROW_BYTES:
                yield BadRow(source, row, url, "row_too_large", f"{len(raw):,} bytes > {MAX_ROW_BYTES:,}")
                continue
            if not raw.strip():
                continue  # blank lines are not rows
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield BadRow(source, row, url, "invalid_utf8", f"byte {e.start}: {e.reason}")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield BadRow(source, row, url, "invalid_json", f"{e.msg} (column {e.colno})")
                continue
            yield _parse(obj, source, row, url, require_answer, to_chat)


def _parquet(f, url: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise BadInputFileError(f"{url}: not a readable Parquet file ({e}); "
                                "fix or remove it from the input files") from None


def _iter_parquet(fs, path: str, source: int, url: str, require_answer: bool,
                  span: "ShardSpan | None" = None, to_chat: RowMapper | None = None) -> Iterator[Chat | BadRow]:
    lo, hi = (span.row_start, span.row_end) if span is not None else (0, None)
    with fs.open(path, "rb") as f:
        pf = _parquet(f, url)
        row = 0
        for g in range(pf.num_row_groups):  # read only the row groups that overlap [lo, hi)
            n = pf.metadata.row_group(g).num_rows
            if row + n <= lo or (hi is not None and row >= hi):
                row += n
                continue
            for obj in pf.read_row_group(g).to_pylist():
                if lo <= row and (hi is None or row < hi):
                    size = len(json.dumps(obj, default=str).encode())
                    yield (BadRow(source, row, url, "row_too_large", f"{size:,} bytes > {MAX_ROW_BYTES:,}")
                           if size > MAX_ROW_BYTES else _parse(obj, source, row, url, require_answer, to_chat))
                row += 1


def iter_chats(url: str, source: int, *, require_answer: bool = True,
               span: "ShardSpan | None" = None, to_chat: RowMapper | None = None) -> Iterator[Chat | BadRow]:
    """Stream the chats of one JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) file.

    Args:
        url: local path or fsspec URL.
        source: index of the file in the stage's input list (recorded as provenance).
        require_answer: see :func:`normalize_messages`.
        span: read only this span's rows (from :func:`plan_spans`); the whole file when None.
        to_chat: maps each parsed row to a chat row first (rows in a benchmark's own layout:
            :mod:`pipeline.chats.prompt_sets`); None reads chat rows.

    Yields:
        :class:`Chat` for good rows and :class:`BadRow` for skipped ones, in file order.

    Raises:
        BadInputFileError: the file is missing, or its format is unknown or unreadable.
    """
    fs, path = _open_input(url)
    if url.endswith(".parquet"):
        yield from _iter_parquet(fs, path, source, url, require_answer, span, to_chat)
    else:
        yield from _iter_jsonl(fs, path, source, url, require_answer, span, to_chat)


def _open_input(url: str):
    fs, path = filesystem(url)
    if not url.endswith((".jsonl", ".json", ".parquet")):
        raise BadInputFileError(f"{url}: unknown input format; use .jsonl or .parquet files")
    if not fs.exists(path):
        raise BadInputFileError(f"{url}: no such input file; check data.train_files / data.eval_files")
    if fs.isdir(path):
        raise BadInputFileError(f"{url} is a directory; list its .jsonl / .parquet files in data.train_files / "
                                "data.eval_files")
    return fs, path


@dataclass(frozen=True)
class ShardSpan:
    """A fixed range of input rows ``[row_start, row_end)`` of one file: the rows of one shard.

    Spans depend only on the file and ``rows_per_shard``, so shard membership is a deterministic
    function of the inputs and config (what makes resume exact). ``byte_start`` lets a JSONL
    reader seek straight to the span.
    """

    source: int
    url: str
    row_start: int
    row_end: int
    byte_start: int = 0


def plan_spans(url: str, source: int, rows_per_shard: int) -> list[ShardSpan]:
    """Cut one input file into spans of ``rows_per_shard`` rows (JSONL lines, blank ones included;
    Parquet rows). One streaming pass over a JSONL file; Parquet needs only its footer.

    Raises:
        BadInputFileError: missing, unreadable or unknown-format file.
    """
    fs, path = _open_input(url)
    bounds: list[tuple[int, int]] = []  # (row, byte offset) of each span start
    if url.endswith(".parquet"):
        with fs.open(path, "rb") as f:
            total = _parquet(f, url).metadata.num_rows
        bounds = [(r, 0) for r in range(0, total, rows_per_shard)]
    else:
        total, pos = 0, 0
        with fs.open(path, "rb") as f:
            for line in f:
                if total % rows_per_shard == 0:
                    bounds.append((total, pos))
                total += 1
                pos += len(line)
    ends = [b[0] for b in bounds[1:]] + [total]
    return [ShardSpan(source, url, r, e, b) for (r, b), e in zip(bounds, ends)]


@dataclass
class RowCounts:
    """Kept and skipped row counts by reason code (what summaries report)."""

    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def merge(self, other: "RowCounts") -> None:
        self.kept += other.kept
        for k, v in other.skipped.items():
            self.skipped[k] = self.skipped.get(k, 0) + v


def plan_shards(files: list[str], rows_per_shard: int, max_rows: int | None = None) -> list[tuple[int, ShardSpan]]:
    """Every shard of a stage as ``(shard index, span)``: spans of ``rows_per_shard`` rows, numbered
    across ``files`` in order; ``max_rows`` keeps a prefix of whole spans holding at least that many
    rows.

    Raises:
        BadInputFileError: a missing, unreadable or unknown-format file.
    """
    spans: list[ShardSpan] = []
    for source, url in enumerate(files):
        spans += plan_spans(url, source, rows_per_shard)
    if max_rows is not None:
        kept, rows = [], 0
        for s in spans:
            if rows >= max_rows:
                break
            kept.append(s)
            rows += s.row_end - s.row_start
        spans = kept
    return list(enumerate(spans))
