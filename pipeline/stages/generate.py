"""Generate stage: the target rewrites every assistant turn of the chats, resumably.

Drafters learn the target's own distribution, so before caching, each assistant turn is regenerated
by the target in order, turn k+1 conditioned on the regenerated turns 1..k; a chat that ends with a
user turn is a prompt and gets its answer appended.

Pipeline (Ray Data): plan spans (one shard = a fixed row range of one input file, numbered across
files) -> skip committed shards -> an actor pool of generators (HF ``generate`` or ``vllm.LLM``),
one shard per call: the actor regenerates the shard's chats, writes the shard in input order, its
error file, then its commit record last (only if absent), and returns metadata only. Sampling is
seeded per request from (seed, source, row, turn) and HF batches are fixed by input order, so a
killed run, rerun, ends with the rows (and, on the CPU, the text; see
:mod:`pipeline.target_model.engines` for vLLM on a GPU) of an uninterrupted one: none duplicated or lost.

Engine calls: vLLM schedules continuously within one ``generate`` call (``generate.max_num_seqs``
requests at a time), so it gets each round's prompts of the whole shard in one call and the GPU
drains to the longest answer once per round, not once per batch; the HF engine pads, so it gets
``generate.batch_size`` prompts per call. A call that raises is split in halves, recursively
(:func:`generate_bisecting`): one bad prompt costs O(log n) extra calls, and only the prompts that
fail on their own are skipped (``generation_error``, in the error file and ``rows_failed``). When
every prompt of a call of several fails on its own, the engine is broken, not the rows:
:class:`GenerationEngineError` stops the shard uncommitted, so a rerun regenerates it.

Layout under ``<run_dir>/generate/``: ``shards/shard-000000.jsonl`` (OpenAI ``messages`` rows that
:func:`pipeline.chats.ingest.iter_chats` reads), ``errors/shard-000000.jsonl`` (skipped and failed rows with
their source file and line), ``commits/shard-000000.json`` (counts, checksum, settings).

Reasoning targets (Qwen3 thinking): the prompt is rendered in ``data.render.enable_thinking``'s
mode, so the target writes reasoning + answer or the answer only; ``generate.max_new_tokens``
bounds both together. An answer with reasoning (the text has ``</think>``, or the generation prompt
opened a ``<think>`` block) is stored as ``reasoning_content`` + ``content`` (:func:`answer_message`),
which the cache renders back with the template. Every row records ``finish_reasons`` per answer
(``"length"``: cut at ``max_new_tokens``). A row whose answer was cut inside its reasoning (the
think block never closed, so there is no answer) is skipped as ``reasoning_truncated``: raise
``generate.max_new_tokens`` to keep such rows; an answer cut after its reasoning is kept.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from cache_schema.errors import StorageUnavailableError, storage_call
from pipeline.chats.ingest import REASONS, BadRow, Chat, RowError, ShardSpan, iter_chats, plan_shards
from pipeline.config import RunConfig
from pipeline.target_model.engines import GenerationEngine, SamplingSpec
from pipeline.errors import PipelineError
from pipeline.chats.render import apply_render_policy, generation_prompt, render_options, render_prompt
from storage import create_exclusive, filesystem, indexed_name, join
from pipeline.paths import resolve_input
from pipeline.stages.sharded import check_spans, item_span, pending, run_actor_pool, span_item

log = logging.getLogger("pipeline.stages.generate")

# generation failure code -> what a user reads in the error file (ingestion codes: chats.REASONS)
GENERATE_REASONS = {
    "prompt_too_long": "the first prompt already fills data.max_length tokens: no answer would be cached",
    "empty_generation": "the target wrote an empty or whitespace-only answer",
    "generation_error": "the engine raised on this row",
    "reasoning_truncated": "the answer hit generate.max_new_tokens inside its reasoning (the think block never "
                           "closed): raise generate.max_new_tokens",
}

THINK_START, THINK_END = "<think>", "</think>"


def opens_reasoning(generation_prompt: str) -> bool:
    """Whether the template's generation prompt leaves a ``<think>`` block open (Qwen3-2507), so the
    target's text starts inside its reasoning."""
    return generation_prompt.rfind(THINK_START) > generation_prompt.rfind(THINK_END)


def answer_message(text: str, opened: bool) -> tuple[dict[str, str], bool]:
    """The assistant message of one generated answer, and whether its reasoning is still open.

    ``text`` is what the target wrote after the prompt; ``opened``: the prompt opened the think
    block (:func:`opens_reasoning`). Reasoning (up to ``</think>``, without a leading ``<think>`` the
    target wrote itself) becomes ``reasoning_content``, stripped of newlines at its ends, and the rest
    ``content`` without leading newlines: Qwen3's template renders that pair back to the same text.
    """
    head = text.lstrip()
    if head.startswith(THINK_START):
        opened, text = True, head[len(THINK_START):]
    if not opened and THINK_END not in text:
        return {"role": "assistant", "content": text}, False
    if THINK_END not in text:
        return {"role": "assistant", "content": "", "reasoning_content": text.strip("\n")}, True
    reasoning, answer = text.split(THINK_END, 1)
    return {"role": "assistant", "content": answer.lstrip("\n"), "reasoning_content": reasoning.strip("\n")}, False


class GenerateSettingsMismatchError(PipelineError):
    """``<run_dir>/generate`` holds committed shards made with other settings or another plan."""


class ShardCommitConflictError(PipelineError):
    """Two writers generated the same shard (the commit record already existed)."""


class GenerationEngineError(PipelineError):
    """Every prompt of an engine call failed, each on its own: the engine is broken (e.g. vLLM's engine
    process died), so the shard is not committed with all its rows as errors."""


def generate_url(cfg: RunConfig) -> str:
    """The stage's output root: ``<run_dir>/generate``."""
    return join(cfg.run_dir, "generate")


def _name(shard: int) -> str:
    return indexed_name("shard-", shard)


def plan(cfg: RunConfig) -> list[tuple[int, ShardSpan]]:
    """All shards as ``(shard index, span)``: spans of ``generate.rows_per_shard`` input rows of
    ``data.train_files``, numbered across files in order; ``generate.max_rows`` keeps a prefix of
    whole spans.

    Raises:
        PipelineError: no input files; BadInputFileError: a missing or unreadable file.
    """
    files = [resolve_input(f) for f in cfg.data.train_files]
    if not files:
        raise PipelineError("data.train_files is empty: list the prompt/chat files (JSONL or Parquet) to generate from")
    return plan_shards(files, cfg.generate.rows_per_shard, cfg.generate.max_rows)


def sampling_record(cfg: RunConfig) -> dict[str, Any]:
    """The sampling parameters recorded with every output row."""
    g = cfg.generate
    return {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
            "max_new_tokens": g.max_new_tokens, "seed": g.seed, "engine": g.engine.value}


def settings(cfg: RunConfig, local_dir: str) -> dict[str, Any]:
    """What a committed shard must have been made with to be reused: sampling, the target (by the
    SHA-256 of its ``embed_tokens``/``lm_head`` weights, never its name), render options and
    ``data.max_length``."""
    from cache_schema import tensor_sha256
    from training.target_weights import load_shared_weights

    embed, lm_head = load_shared_weights(local_dir)
    return {"sampling": sampling_record(cfg), "render": render_options(cfg.data.render),
            "max_length": cfg.data.max_length,
            "target": {"embed_sha256": tensor_sha256(embed), "lm_head_sha256": tensor_sha256(lm_head)}}


def request_seed(seed: int, source: int, row: int, turn: int) -> int:
    """The sampling seed of one request (31 bits), from the run seed and the turn's provenance."""
    digest = hashlib.blake2b(f"{seed}:{source}:{row}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def answer_slots(messages: Sequence[dict[str, str]]) -> list[int]:
    """Message indexes to (re)write, ascending: every assistant turn, plus ``len(messages)`` when
    the chat ends with a user turn or has no answer at all (the answer is appended)."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and (messages[-1]["role"] == "user" or not slots):
        slots.append(len(messages))
    return slots


@dataclass
class _Work:
    chat: Chat
    messages: list[dict[str, str]]
    slots: list[int]
    finish: list[str] = field(default_factory=list)
    failure: BadRow | None = None

    def fail(self, reason: str, detail: str) -> None:
        c, what = self.chat, GENERATE_REASONS.get(reason) or REASONS.get(reason, reason)
        self.failure = BadRow(c.source, c.row, c.path, reason, f"{what} ({detail})", c.row_id)


@dataclass
class ShardResult:
    """One shard's regeneration: output ``rows`` in input order, error ``records`` (ingestion skips
    and generation failures, in input order) and ``stats`` (counts, tokens, seconds)."""

    rows: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    stats: dict[str, Any]


def regenerate(chats: Sequence[Chat | BadRow], engine: GenerationEngine, cfg: RunConfig) -> ShardResult:
    """Regenerate every answer of ``chats`` (a pure function of its inputs, the engine and config).

    Round r generates the r-th answer of every chat that has one, in (prompt length, input) order: in
    one engine call when the engine schedules its own batches (``engine.schedules_batches``: vLLM),
    else in calls of ``generate.batch_size`` prompts; its prompt is the chat up to that
    answer with the earlier answers already regenerated, rendered with the target's template and
    ``data.render``. A later answer whose prompt no longer fits ``data.max_length`` ends the chat
    after the previous answer (the cache could supervise none of the rest); the row is kept.

    Args:
        chats: one shard's items from :func:`pipeline.chats.ingest.iter_chats` (``require_answer=False``).
        engine: a :class:`pipeline.target_model.engines.GenerationEngine` (its ``tokenizer`` renders prompts).

    Returns:
        :class:`ShardResult`; a failed row (``GENERATE_REASONS`` or render codes) is in ``errors``
        only, never in ``rows``.

    Raises:
        GenerationEngineError: every prompt of an engine call of several failed on its own.
    """
    sampling = SamplingSpec.from_config(cfg.generate)
    record = sampling_record(cfg)
    work = [_Work(c, [dict(m) for m in c.messages], answer_slots(c.messages)) for c in chats
            if isinstance(c, Chat)]
    stats = {"turns_generated": 0, "new_tokens": 0, "turns_cut": 0, "generate_seconds": 0.0,
             "finish_reasons": {"stop": 0, "length": 0}}
    for turn in range(max((len(w.slots) for w in work), default=0)):
        todo = _prompts(work, turn, engine.tokenizer, cfg, stats)
        todo.sort(key=lambda t: len(t[1]))  # stable: ties keep input order
        t0 = time.perf_counter()
        size = max(len(todo), 1) if getattr(engine, "schedules_batches", False) else cfg.generate.batch_size
        for b in range(0, len(todo), size):
            batch = todo[b: b + size]
            gens = generate_bisecting(engine, [t[1] for t in batch], [t[2] for t in batch], sampling)
            for (w, _, _, opened), gen in zip(batch, gens):
                if isinstance(gen, Exception):
                    w.fail("generation_error", f"answer {turn + 1}: {type(gen).__name__}: {gen}")
                    continue
                stats["turns_generated"] += 1
                stats["new_tokens"] += gen.num_tokens
                stats["finish_reasons"][gen.finish_reason] += 1
                if not gen.text.strip():
                    w.fail("empty_generation", f"answer {turn + 1} is empty (finish: {gen.finish_reason})")
                    continue
                msg, still_open = answer_message(gen.text, opened)
                if still_open:
                    w.fail("reasoning_truncated", f"answer {turn + 1}: {gen.num_tokens} tokens, finish {gen.finish_reason}")
                    continue
                w.messages[w.slots[turn]: w.slots[turn] + 1] = [msg]
                w.finish.append(gen.finish_reason)
        stats["generate_seconds"] = round(stats["generate_seconds"] + time.perf_counter() - t0, 3)
    rows = [{"id": w.chat.row_id, "messages": w.messages, "source": w.chat.path, "source_index": w.chat.source,
             "row": w.chat.row, "sampling": record, "finish_reasons": w.finish}
            for w in work if w.failure is None]
    failed = {(w.chat.source, w.chat.row): w.failure for w in work if w.failure is not None}
    errors = [c.record() if isinstance(c, BadRow) else failed[(c.source, c.row)].record()
              for c in chats if isinstance(c, BadRow) or (c.source, c.row) in failed]
    reasons: dict[str, int] = {}
    for e in errors:
        reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    stats.update(rows_in=len(chats), rows_kept=len(rows), rows_failed=dict(sorted(reasons.items())))
    return ShardResult(rows, errors, stats)


def _prompts(work: list[_Work], turn: int, tokenizer, cfg: RunConfig, stats: dict[str, Any]) -> list[tuple]:
    """``(work, prompt ids, seed, opens reasoning)`` for every live chat with a ``turn``-th answer; fails or cuts the
    chats whose prompt does not render or does not fit ``data.max_length``."""
    todo = []
    for w in work:
        if w.failure is not None or turn >= len(w.slots):
            continue
        try:
            history = w.messages[: w.slots[turn]]
            ids = render_prompt(tokenizer, history, cfg.data.render)
            opened = opens_reasoning(generation_prompt(tokenizer, apply_render_policy(history, cfg.data.render),
                                                       cfg.data.render))
        except RowError as e:
            w.fail(e.reason, f"answer {turn + 1}: {e.detail}")
            continue
        if len(ids) < cfg.data.max_length:
            todo.append((w, ids, request_seed(cfg.generate.seed, w.chat.source, w.chat.row, turn), opened))
        elif turn == 0:
            w.fail("prompt_too_long", f"{len(ids)} prompt tokens >= data.max_length={cfg.data.max_length}")
        else:  # end the chat after the last answer that fit; the cache would truncate the rest anyway
            del w.messages[w.slots[turn - 1] + 1:]
            del w.slots[turn:]
            stats["turns_cut"] += 1
    return todo


def generate_bisecting(engine: GenerationEngine, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                       sampling: SamplingSpec) -> list:
    """One :class:`pipeline.target_model.engines.Generation`, or the exception its prompt raised alone,
    per prompt, in order: the engine is called on the whole list; if it raises, on each half,
    recursively, so that k bad prompts among n cost at most ``1 + 2 k log2(n)`` calls and only the
    prompts that fail on their own are lost (the failed calls' other prompts are generated again by
    the halves; a seeded request's draws do not depend on its call).

    Raises:
        GenerationEngineError: more than one prompt and every one failed on its own (a broken engine).
    """
    out = _bisect(engine, list(prompts), list(seeds), sampling)
    if len(out) > 1 and all(isinstance(g, Exception) for g in out):
        raise GenerationEngineError(
            f"the generate engine raised on each of the {len(out)} prompts of a call, one at a time "
            f"({type(out[0]).__name__}: {out[0]}): the engine is broken, not the rows; the shard is left "
            "uncommitted: fix the engine (GPU memory, vLLM install) and rerun +stage=generate") from out[0]
    return out


def _bisect(engine: GenerationEngine, prompts: list, seeds: list, sampling: SamplingSpec) -> list:
    try:
        return engine.generate(prompts, sampling, seeds)
    except Exception as e:  # noqa: BLE001 - isolate the row(s) that make the engine raise
        if len(prompts) == 1:
            return [e]
    half = len(prompts) // 2
    return (_bisect(engine, prompts[:half], seeds[:half], sampling)
            + _bisect(engine, prompts[half:], seeds[half:], sampling))


def generate_shard(span: ShardSpan, engine: GenerationEngine, cfg: RunConfig) -> ShardResult:
    """Read one shard's rows (chats ending with a user turn are prompts) and :func:`regenerate` them.

    Raises:
        BadInputFileError: the input file is missing or unreadable.
    """
    return regenerate(list(iter_chats(span.url, span.source, require_answer=False, span=span)), engine, cfg)


def _jsonl(records: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_shard(out_url: str, shard: int, span: ShardSpan, result: ShardResult, settings_: dict[str, Any],
                writer_id: str) -> dict[str, Any]:
    """Write a shard's rows, then its error file, then its commit record (created only if absent).

    Returns:
        The commit record: ``shard``, ``file``, ``bytes``, ``sha256``, the span (``source``, ``url``,
        ``row_start``, ``row_end``), ``stats`` and ``settings``.

    Raises:
        ShardCommitConflictError: another writer committed this shard meanwhile (two writers must
            never share a shard).
    """
    fs, root = filesystem(out_url)
    data = _jsonl(result.rows)
    with storage_call(join(out_url, "shards", f"{_name(shard)}.jsonl"), f"writing generate shard {shard} to"):
        for sub, payload in (("shards", data), ("errors", _jsonl(result.errors))):
            fs.makedirs(f"{root}/{sub}", exist_ok=True)
            fs.pipe_file(f"{root}/{sub}/{_name(shard)}.jsonl", payload)
    record = {"shard": shard, "file": f"shards/{_name(shard)}.jsonl", "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest(), **asdict(span), "stats": result.stats,
              "settings": settings_, "writer": writer_id}
    try:
        with storage_call(join(out_url, "commits", f"{_name(shard)}.json"), f"committing generate shard {shard} as"):
            fs.makedirs(f"{root}/commits", exist_ok=True)
            create_exclusive(fs, f"{root}/commits/{_name(shard)}.json",
                             json.dumps(record, indent=1, sort_keys=True).encode())
    except FileExistsError:
        raise ShardCommitConflictError(
            f"{out_url}: shard {shard} was committed by another writer while {writer_id!r} wrote it: two "
            "writers must never share a run_dir; rerun +stage=generate alone") from None
    return record


def committed_records(out_url: str) -> dict[int, dict[str, Any]]:
    """Every commit record under ``out_url`` (``<run_dir>/generate``), by shard index."""
    fs, root = filesystem(out_url)
    fs.invalidate_cache(f"{root}/commits")
    if not fs.exists(f"{root}/commits"):
        return {}
    records = {}
    for path in sorted(fs.ls(f"{root}/commits", detail=False)):
        if path.endswith(".json"):
            rec = json.loads(fs.cat_file(path))
            records[int(rec["shard"])] = rec
    return records


def _diff(old: Any, new: Any, key: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in _diff(old.get(k), new.get(k), f"{key}.{k}")]
    return [] if old == new else [f"{key}: {old!r} -> {new!r}"]


def check_records(out_url: str, records: dict[int, dict[str, Any]], shards: list[tuple[int, ShardSpan]],
                  want: dict[str, Any]) -> None:
    """Refuse committed shards made with other settings, or covering other rows than the plan says.

    Raises:
        GenerateSettingsMismatchError: naming the differing fields and the fix.
    """
    fix = "use a new run_dir, or delete that folder to regenerate everything"
    for i, rec in sorted(records.items()):
        if diffs := _diff(rec["settings"], want, "generate"):
            raise GenerateSettingsMismatchError(
                f"{out_url} holds shards generated with other settings ({'; '.join(diffs[:4])}): {fix}")
    check_spans(out_url, shards, {i: (r["url"], r["row_start"], r["row_end"]) for i, r in records.items()},
                key="url", error=GenerateSettingsMismatchError,
                fix=f"data.train_files or generate.rows_per_shard changed since it was generated; restore them, or {fix}")


def generated_files(cfg: RunConfig) -> list[str]:
    """The committed generate shard files (URLs) in shard order: what the cache reads when
    ``generate.enabled``.

    Raises:
        PipelineError: no generate output, some planned shards are not committed, or a committed
            shard file is missing or has another size than its commit record says.
        GenerateSettingsMismatchError: the output was made with other settings or inputs.
    """
    from pipeline.target_model.loader import resolve_target_path

    out = generate_url(cfg)
    shards = plan(cfg)
    records = committed_records(out)
    missing = [i for i, _ in shards if i not in records]
    if missing:
        raise PipelineError(f"{out}: {len(shards) - len(missing)} of {len(shards)} generate shards are committed "
                            "(none or incomplete): run +stage=generate first or set generate.enabled=false")
    check_records(out, records, shards, settings(cfg, resolve_target_path(cfg.target.path)))
    fs, root = filesystem(out)
    fs.invalidate_cache(f"{root}/shards")
    sizes = {e["name"].rsplit("/", 1)[-1]: e["size"] for e in fs.ls(f"{root}/shards", detail=True)}
    for i, _ in shards:
        name = records[i]["file"].rsplit("/", 1)[-1]
        if sizes.get(name) != records[i]["bytes"]:
            raise PipelineError(f"{out}: {records[i]['file']} is missing or not {records[i]['bytes']} bytes as its "
                                f"commit record says: delete commits/{_name(i)}.json and rerun +stage=generate")
    return [join(out, records[i]["file"]) for i, _ in shards]


class ShardGenerator:
    """The generate actor: holds one engine (HF model or ``vllm.LLM``) and owns whole shards; it
    regenerates, writes and commits each shard it is given and returns only metadata."""

    def __init__(self, cfg: RunConfig, out_url: str, settings_: dict[str, Any], use_gpu: bool):
        from pipeline.target_model.engines import make_engine
        from storage import configure_storage

        import torch

        configure_storage(cfg.storage)
        self.cfg, self.out_url, self.settings = cfg, out_url, settings_
        # an actor given a GPU the node only declares (a test cluster's stand-in) runs on the CPU
        self.engine = make_engine(cfg.generate, cfg.target, cfg.data.max_length + cfg.generate.max_new_tokens,
                                  "cuda" if use_gpu and torch.cuda.is_available() else "cpu")
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        shard, span = int(item["shard"]), item_span(item)
        meta = {"shard": shard, "rows": span.row_end - span.row_start, "new_tokens": 0, "written": False, "error": ""}
        fs, root = filesystem(self.out_url)
        if fs.exists(f"{root}/commits/{_name(shard)}.json"):  # a retried task: the shard is done
            return meta
        result = generate_shard(span, self.engine, self.cfg)
        if self.cfg.generate.shard_delay_s:  # a shard in flight for a known time (tests/integration/test_cluster_faults.py)
            time.sleep(self.cfg.generate.shard_delay_s)
        try:
            write_shard(self.out_url, shard, span, result, self.settings, self.writer_id)
        except StorageUnavailableError as exc:  # reported by the driver as one line, not a worker traceback
            return {**meta, "error": str(exc)}
        return {**meta, "new_tokens": result.stats["new_tokens"], "written": True}


def _pool(n_pending: int) -> tuple[int, float | None]:
    """Actor count and GPUs per actor: one actor per GPU of the cluster, else one per CPU."""
    import ray

    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    if gpus:
        return min(gpus, n_pending), 1
    return max(1, min(int(res.get("CPU", 1)), n_pending)), None


def totals(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed over commit records (what ``summary.json`` reports); ``generate_seconds`` is
    engine time summed over actors (seconds), so ``new_tokens / generate_seconds`` is the
    per-actor engine throughput in tokens/s."""
    keys = ("rows_in", "rows_kept", "turns_generated", "turns_cut", "new_tokens", "generate_seconds")
    out: dict[str, Any] = {**dict.fromkeys(keys, 0), "rows_failed": {}, "finish_reasons": {"stop": 0, "length": 0}}
    for rec in records:
        st = rec["stats"]
        for k in keys:
            out[k] += st[k]
        for group in ("rows_failed", "finish_reasons"):
            for k, v in st[group].items():
                out[group][k] = out[group].get(k, 0) + v
    out["rows_failed"] = dict(sorted(out["rows_failed"].items()))
    out["generate_seconds"] = round(out["generate_seconds"], 3)
    return out


def run_generate(cfg: RunConfig) -> dict[str, Any]:
    """The generate stage (``+stage=generate``). Returns the summary ``run.py`` writes to
    ``generate/summary.json``: rows in/kept/failed by reason, turns, new tokens, tokens/s (new
    tokens per wall second of this run's generation; None when nothing was left to generate),
    shards planned/written/already committed, sampling parameters and engine, and ``faults`` (what
    lost actors cost: :class:`pipeline.stages.sharded.FaultLedger`; None when nothing was left to do).

    Raises:
        GenerateSettingsMismatchError: committed shards were made with other settings or inputs.
        StorageUnavailableError: shards whose storage retries ran out (``storage:``), after every
            other shard was written; one line naming the first one's URL and its last S3 error.
        TargetNotFoundError, BadInputFileError, PipelineError: see :func:`plan`, :func:`settings`.
    """
    import ray

    from pipeline.cluster import init_ray
    from pipeline.target_model.loader import resolve_target_path

    out = generate_url(cfg)
    want = settings(cfg, resolve_target_path(cfg.target.path))
    shards = plan(cfg)
    records = committed_records(out)
    check_records(out, records, shards, want)
    todo = pending(shards, records)
    log.info("generate: %d shards planned, %d already committed, %d to write",
             len(shards), len(shards) - len(todo), len(todo))
    run = {"shards_planned": len(shards), "shards_already_committed": len(shards) - len(todo),
           "shards_written": 0, "tokens_per_s": None, "engine": cfg.generate.engine.value,
           "sampling": sampling_record(cfg), "faults": None}
    if todo:
        init_ray(cfg.ray)
        workers, gpus = _pool(len(todo))
        pool = run_actor_pool(ray.data.from_items([span_item(i, s) for i, s in todo], override_num_blocks=len(todo)),
                              ShardGenerator, (cfg, out, want, gpus is not None), workers=workers, gpus=gpus,
                              desc="generate", unit="row", total=sum(s.row_end - s.row_start for _, s in todo),
                              advance="rows",
                              postfix=lambda t: {"shards": t.get("written", 0), "tokens": t.get("new_tokens", 0)})
        run["shards_written"] = int(pool.totals.get("written", 0))
        run["tokens_per_s"] = round(pool.totals.get("new_tokens", 0) / max(pool.seconds, 1e-9), 1)
        run["faults"] = pool.faults
        records = committed_records(out)
    done = [records[i] for i, _ in shards if i in records]
    return {**run, **totals(done)}
