"""Cache stage: chats -> frozen-target prefill -> sharded Zarr cache (docs/design.md section 4).

Pipeline (Ray Data): plan spans (one shard = a fixed row range of one input file) -> skip
committed shards -> render and tokenize each shard's rows (CPU tasks) -> size estimate and budget
check -> an actor pool of prefill writers, one shard per call: length-aware batches, hooks capture
the target layers, each batch's real rows are copied straight into the shard's buffer
(:class:`cache_schema.layout.ShardBuffer`), the actor writes and commits the shard itself and returns
only metadata (no tensor crosses the object store). Each actor runs two calls at once (``cache.cpus_per_worker``
CPUs): shard k is written and committed while shard k+1 is prefilled. A rerun skips committed shards and rewrites uncommitted ones, so
a killed run ends, after a rerun, with exactly the samples of an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from cache_schema import (CacheSample, Fingerprint, StorageConfig, StorageUnavailableError, estimate_cache_bytes,
                          open_cache, shard_overhead_bytes, tensor_sha256)
from cache_schema.errors import ShardAlreadyCommittedError, storage_call
from cache_schema.fingerprint import chat_template_sha256, tokenizer_sha256
from cache_schema.layout import ShardBuffer, shard_name
from pipeline.chats.ingest import BadRow, RowCounts, RowError, ShardSpan, iter_chats, plan_shards
from pipeline.config import RunConfig
from pipeline.errors import PipelineError, ShardPlanMismatchError
from pipeline.chats.render import ignored_thinking_switch, render_chat, render_options
from storage import filesystem, join
from pipeline.paths import resolve_input
from pipeline.stages.sharded import check_spans, item_span, pending, run_actor_pool, span_item

log = logging.getLogger("pipeline.stages.cache")


CONCURRENT_SHARDS = 2  # calls per prefill actor at once: one shard prefilling while the previous one is written


class StorageBudgetError(PipelineError):
    """The size estimate exceeds ``cache.storage_budget_bytes``."""


def cache_url(cfg: RunConfig) -> str:
    """The cache root of a run: ``<run_dir>/cache``."""
    return join(cfg.run_dir, "cache")


def input_files(cfg: RunConfig) -> list[str]:
    """The chat files the cache reads: the generate stage's output when the config chains them
    (``generate.enabled``), else ``data.train_files``; ``embedded:`` names resolved."""
    if cfg.generate.enabled:
        try:
            from pipeline.stages.generate import generated_files
        except ImportError:
            raise PipelineError("generate.enabled=true but this build has no generate stage; set "
                                "generate.enabled=false to cache data.train_files as they are") from None
        return generated_files(cfg)
    files = [resolve_input(f) for f in cfg.data.train_files]
    if not files:
        raise PipelineError("data.train_files is empty: list the chat files (JSONL or Parquet) to cache")
    return files


def target_fingerprint(cfg: RunConfig, tokenizer, local_dir: str, model_config) -> Fingerprint:
    """The cache fingerprint of docs/design.md section 4 for this target, tokenizer and config.

    Hashes the target's weights that the drafter shares (``embed_tokens``, ``lm_head``), never its
    name; the tokenizer by its serialised state; the chat template by its text.
    """
    from training.target_weights import load_shared_weights

    embed, lm_head = load_shared_weights(local_dir)
    conf = model_config.to_dict()
    for transient in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"):
        conf.pop(transient, None)
    conf_hash = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()
    target = {"model_type": model_config.model_type, "hidden_size": int(model_config.hidden_size),
              "num_hidden_layers": int(model_config.num_hidden_layers),
              "vocab_size": int(model_config.vocab_size), "config_sha256": conf_hash,
              "prefill_dtype": cfg.target.dtype}
    return Fingerprint(
        target=target, embed_hash=tensor_sha256(embed), lm_head_hash=tensor_sha256(lm_head),
        tokenizer_hash=tokenizer_sha256(tokenizer), chat_template_hash=chat_template_sha256(tokenizer),
        render_options=render_options(cfg.data.render), target_layer_ids=tuple(cfg.target.target_layer_ids),
        feature_dtype=cfg.cache.feature_dtype.value, max_length=cfg.data.max_length,
        min_loss_tokens=cfg.data.min_loss_tokens)


@lru_cache(maxsize=2)
def _tokenizer(local_dir: str):
    from transformers import AutoTokenizer

    # no length warning: samples are truncated to data.max_length by the renderer itself
    return AutoTokenizer.from_pretrained(local_dir, local_files_only=True, model_max_length=2**31 - 1)


def render_shard(span: ShardSpan, shard: int, cfg: RunConfig, local_dir: str) -> dict[str, Any]:
    """Render one shard's rows (a pure CPU task).

    Returns:
        A row for the prefill actors: ``shard``; ``ids`` int32 [N] and ``mask`` uint8 [N] (all kept
        samples concatenated), ``offsets`` int64 [n+1], ``rows`` int64 [n], ``hashes`` (JSON list),
        ``bad`` (JSON list of quarantine records), ``skipped`` (JSON {reason: count}), counts.
    """
    tok = _tokenizer(local_dir)
    ids, masks, rows, hashes, bad = [], [], [], [], []
    counts = RowCounts()
    for item in iter_chats(span.url, span.source, span=span):
        if isinstance(item, BadRow):
            bad.append(item)
            continue
        try:
            r = render_chat(tok, item.messages, cfg.data.render, max_length=cfg.data.max_length,
                            min_loss_tokens=cfg.data.min_loss_tokens)
        except RowError as e:
            bad.append(BadRow(item.source, item.row, item.path, e.reason, e.detail, item.row_id))
            continue
        ids.append(r.input_ids)
        masks.append(r.loss_mask)
        rows.append(item.row)
        hashes.append(r.content_hash)
    for b in bad:
        counts.skip(b.reason)
    counts.kept = len(ids)
    lengths = [len(x) for x in ids]
    return {
        "shard": shard, "source": span.source, "row_start": span.row_start, "row_end": span.row_end,
        "ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
        "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "rows": np.asarray(rows, dtype=np.int64), "hashes": json.dumps(hashes),
        "bad": json.dumps([b.record() for b in bad]), "skipped": json.dumps(counts.skipped),
        "num_samples": len(ids), "num_tokens": int(sum(lengths)),
        "num_supervised": int(sum(int(m.sum()) for m in masks)),
        "num_hidden_rows": int(sum(int(m[1:].sum()) for m in masks)),
    }


class ShardPrefillWriter:
    """The prefill actor: owns whole shards; computes, writes and commits each one it is given.

    The cache stage maps it over rendered shards (``write=True``, ``emit=False``): it returns only
    metadata (counts, bytes, seconds) to the driver. The online / hybrid train stage
    (:mod:`pipeline.stages.stream`) flat-maps the same class over shard items that carry their span and
    the stream order (``emit=True``): it renders the shard itself, prefills it whole (the same
    length-aware batches as the cache stage, hence the same bits), in hybrid mode (``write=True``)
    writes and commits it exactly as the cache stage would, or reads it back if it is already
    committed, and returns the samples the item asks for as stream rows (:mod:`training.stream`).

    Args:
        cfg, root_url, fingerprint, storage: the run, the cache root (must exist when ``write``).
        emit: return stream rows instead of metadata. write: write and commit the shard.
        local_dir: the target folder (for rendering span items; default: resolved from the config).
    """

    def __init__(self, cfg: RunConfig, root_url: str, fingerprint: Fingerprint, storage: StorageConfig,
                 emit: bool = False, write: bool = True, local_dir: str | None = None):
        import torch

        from pipeline.target_model.prefill import TargetPrefill
        from storage import configure_storage
        from pipeline.target_model.loader import load_target, resolve_target_path

        configure_storage(cfg.storage)
        cuda = cfg.cache.gpus_per_worker > 0 and torch.cuda.is_available()
        model, _, _ = load_target(cfg.target, "cuda" if cuda else "cpu")
        self.prefill = TargetPrefill(model, cfg.target.target_layer_ids)
        self.cfg, self.fingerprint, self.emit, self.write = cfg, fingerprint, emit, write
        self.shard_delay_s = cfg.cache.shard_delay_s
        self.root_url = root_url
        self.root = open_cache(root_url, fingerprint, create=False, storage=storage) if write else None
        self.local_dir = local_dir or resolve_target_path(cfg.target.path)
        self.max_tokens = cfg.cache.max_tokens_per_batch
        self.writer_id = f"{socket.gethostname()}:{os.getpid()}"
        self._prefill_lock, self._write_lock = threading.Lock(), threading.Lock()

    def _prefilled(self, work: dict[str, Any]) -> Iterator[tuple[int, CacheSample]]:
        """The shard's samples as ``(position in the shard, sample)``, one length-aware prefill batch
        at a time (positions in batch order; features are views of the batch's host output)."""
        import torch

        from pipeline.target_model.prefill import length_batches

        offsets = np.asarray(work["offsets"])
        all_ids, all_mask = np.array(work["ids"], dtype=np.int32), np.array(work["mask"], dtype=np.uint8)
        ids = [all_ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        masks = [all_mask[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        source, hashes, rows = int(work["source"]), json.loads(work["hashes"]), work["rows"]
        for batch in length_batches([len(x) for x in ids], self.max_tokens):
            for i, o in zip(batch, self.prefill([ids[i] for i in batch], [masks[i] for i in batch])):
                yield i, CacheSample(input_ids=torch.as_tensor(ids[i]), loss_mask=torch.as_tensor(masks[i]),
                                     features=o.features, last_hidden=o.last_hidden,
                                     sample_id=f"{source}-{int(rows[i])}", source=source, row=int(rows[i]),
                                     content_hash=hashes[i])

    def _samples(self, work: dict[str, Any]) -> list[CacheSample]:
        """The shard's samples, prefilled, in stored order (the stream path's rows)."""
        samples: list[CacheSample | None] = [None] * int(work["num_samples"])
        for i, sample in self._prefilled(work):
            samples[i] = sample
        return samples

    def _fill(self, work: dict[str, Any]) -> ShardBuffer:
        """Prefill the shard straight into its :class:`ShardBuffer`, batch by batch (each batch's host
        output is copied into its rows, then dropped: the shard is held once)."""
        offsets, mask = np.asarray(work["offsets"]), np.asarray(work["mask"])
        buffer = self.root.new_shard(np.diff(offsets).tolist(),
                                     [int(mask[a + 1:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])])
        for i, sample in self._prefilled(work):
            buffer.put(i, sample)
        return buffer

    def _quarantine(self, shard: int, work: dict[str, Any]) -> dict[str, Any]:
        """Write the shard's quarantine (before anything of the shard: the commit record must never
        precede it) and return the commit record's ``extra``."""
        bad = json.loads(work["bad"])
        if bad:
            url = join(self.root.url, "quarantine", f"{shard_name(shard)}.jsonl")
            with storage_call(url, f"writing the quarantine of shard {shard} to"):
                fs, path = filesystem(url)
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                fs.pipe_file(path, "".join(json.dumps(b) + "\n" for b in bad).encode())
        return {"skipped": json.loads(work["skipped"]), "source": int(work["source"]),
                "rows": [int(work["row_start"]), int(work["row_end"])]}

    def __call__(self, work: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Prefill, write and commit one rendered shard; returns its metadata (``error`` holds a storage
        failure's one-line message). Thread-safe: the cache stage runs two calls per actor at once
        (:data:`CONCURRENT_SHARDS`), so shard k's write and commit overlap shard k+1's prefill; a lock
        keeps one shard on the target and one being written (at most two shard buffers held)."""
        if self.emit:
            return self._stream(work)
        shard = int(work["shard"])
        if self.root.is_committed(shard):  # a retried call whose first attempt committed, then died with its actor
            return self._committed_meta(shard)
        with self._prefill_lock:
            t0 = time.perf_counter()
            buffer = self._fill(work)
            if self.shard_delay_s:  # a shard in flight for a known time (tests/integration/test_cluster_faults.py)
                time.sleep(self.shard_delay_s)
            prefill_s = time.perf_counter() - t0
        with self._write_lock:
            t1 = time.perf_counter()
            try:
                record = self.root.commit_shard(shard, buffer, writer_id=self.writer_id,
                                                extra=self._quarantine(shard, work))
                meta = {"num_samples": record.num_samples, "num_tokens": record.num_tokens,
                        "bytes": record.total_bytes, "error": ""}
            except ShardAlreadyCommittedError:  # a lost attempt of this call committed it first: the same bytes
                return self._committed_meta(shard)
            except StorageUnavailableError as exc:  # reported by the driver as one line, not a worker traceback
                meta = {"num_samples": 0, "num_tokens": 0, "bytes": 0, "error": str(exc)}
            write_s = time.perf_counter() - t1
        # busy: prefill + write + commit of this shard, lock waits excluded (the overlap is not subtracted)
        return {"shard": shard, **meta, "prefill_seconds": prefill_s, "write_seconds": write_s,
                "busy_seconds": prefill_s + write_s}

    def _committed_meta(self, shard: int) -> dict[str, Any]:
        """The metadata of a shard already committed (by an earlier attempt of the same call, lost with
        its actor after the commit): read from its commit record, no second prefill or write. A shard
        is a deterministic function of (inputs, config), so both attempts hold the same bytes."""
        record = self.root.record(shard)
        return {"shard": shard, "num_samples": record.num_samples, "num_tokens": record.num_tokens,
                "bytes": record.total_bytes, "error": "", "prefill_seconds": 0.0, "write_seconds": 0.0,
                "busy_seconds": 0.0}

    def _stream(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """Stream rows of one shard item of :func:`pipeline.stages.stream.shard_items`."""
        from training.stream import sample_row

        shard = int(item["shard"])
        positions = json.loads(item["positions"])
        if self.write and self.root.is_committed(shard):  # hybrid resume: a committed shard is kept, read back
            from cache_schema import CacheReader

            samples = list(CacheReader(self.root_url, self.fingerprint).iter_samples([shard]))
        else:
            span = ShardSpan(**{k: item[k] for k in ShardSpan.__dataclass_fields__})
            work = render_shard(span, shard, self.cfg, self.local_dir)
            samples = self._samples(work)
            if self.write:  # a storage failure stops the stream: hybrid must commit
                self.root.write_shard(shard, samples, writer_id=self.writer_id, extra=self._quarantine(shard, work))
        now = time.time()
        first = int(item["index"])
        return [sample_row(samples[p].input_ids, samples[p].loss_mask, samples[p].features, samples[p].last_hidden,
                           epoch=int(item["epoch"]), index=first + j if first >= 0 else p, shard=shard, position=p,
                           sample_id=samples[p].sample_id, produced_at=now)
                for j, p in enumerate(positions)]


def plan(cfg: RunConfig) -> list[tuple[int, ShardSpan]]:
    """All shards of the run as ``(shard index, span)``, numbered across files in input order."""
    return plan_shards(input_files(cfg), cfg.cache.rows_per_shard, cfg.cache.max_rows)


def resume_plan(cfg: RunConfig, root) -> tuple[list[tuple[int, ShardSpan]], set[int], list[tuple[int, ShardSpan]]]:
    """(planned shards, committed shard indices, shards still to write) of a run over ``root`` (a
    CacheRoot): one listing of the commit records and one batched read of them.

    Raises:
        ShardPlanMismatchError: a committed shard holds other rows than this run plans for it
            (:func:`pipeline.stages.sharded.check_spans`).
    """
    shards = plan(cfg)
    records = root.committed_records()
    recorded = {i: (r.extra.get("source"), *r.extra["rows"]) for i, r in records.items() if "rows" in r.extra}
    check_spans(root.url, shards, recorded, key="source", error=ShardPlanMismatchError,
                fix="data.train_files or cache.rows_per_shard changed since the cache was written; restore them, "
                    "or write to a new run_dir")
    return shards, set(records), pending(shards, records)


def storage_config(cfg: RunConfig) -> StorageConfig:
    return StorageConfig(zstd_level=3 if cfg.cache.compression == "zstd" else None)


def run_cache(cfg: RunConfig) -> dict[str, Any]:
    """The cache stage (``+stage=cache``). Returns the summary written to ``cache/summary.json``.

    Throughput figures (tokens/s): ``prefill_tokens_per_s`` is tokens over the wall time from the start
    of the prefill actor pool to the last commit (actor start-up and target loading included);
    ``steady_tokens_per_s`` is tokens x ``cache.num_workers`` over the actors' summed busy time
    (prefill + write + commit per shard), the rate once the actors are up. ``faults`` (None when
    nothing was to write) is what lost actors or nodes cost: actors started and lost, the shards
    re-prefilled and the seconds from their first start to their retry
    (:meth:`pipeline.stages.sharded.FaultLedger.summary`).

    Raises:
        FingerprintMismatchError: the output holds a cache of another target/config.
        StorageBudgetError: the estimate exceeds ``cache.storage_budget_bytes`` (before prefill).
        StorageUnavailableError: shards whose storage retries ran out (``storage:``), after every
            other shard was written; one line naming the first one's URL and its last S3 error.
    """
    import ray
    from transformers import AutoConfig

    from pipeline.cluster import ObjectStoreWatch, init_ray, object_store_figures
    from pipeline.target_model.loader import resolve_target_path

    local_dir = resolve_target_path(cfg.target.path)
    tok = _tokenizer(local_dir)
    if (warning := ignored_thinking_switch(tok, cfg.data.render)) is not None:
        log.warning("cache: %s", warning)
    fp = target_fingerprint(cfg, tok, local_dir, AutoConfig.from_pretrained(local_dir, local_files_only=True))
    root_url = cache_url(cfg)
    storage = storage_config(cfg)
    root = open_cache(root_url, fp, create=True, storage=storage)
    shards, done, todo = resume_plan(cfg, root)
    log.info("cache: %d shards planned, %d already committed, %d to write", len(shards), len(done), len(todo))
    run = {"shards_planned": len(shards), "shards_already_committed": len(done & {i for i, _ in shards}),
           "shards_written": 0, "estimate_bytes": 0, "prefill_tokens_per_s": None,
           "steady_tokens_per_s": None, "faults": None}
    store = dict.fromkeys(ObjectStoreWatch.KEYS)  # all None: nothing to write, no window
    if todo:
        init_ray(cfg.ray, watch_object_store=True)
        try:
            items = [span_item(i, s) for i, s in todo]
            rendered = ray.data.from_items(items).map(
                lambda it: render_shard(item_span(it), it["shard"], cfg, local_dir)).materialize()
            counts = rendered.select_columns(["num_samples", "num_tokens", "num_supervised", "num_hidden_rows"]).take_all()
            tokens = sum(c["num_tokens"] for c in counts)
            est = estimate_cache_bytes(tokens, hidden_size=fp.hidden_size, num_target_layers=len(fp.target_layer_ids),
                                       feature_dtype=fp.feature_dtype, num_samples=sum(c["num_samples"] for c in counts),
                                       supervised_fraction=sum(c["num_hidden_rows"] for c in counts) / max(tokens, 1))
            total = est.total_bytes + len(todo) * shard_overhead_bytes(
                hidden_size=fp.hidden_size, target_layer_ids=fp.target_layer_ids, feature_dtype=fp.feature_dtype,
                storage=storage)
            run["estimate_bytes"] = total
            print(f"cache: {len(todo)} shards, {tokens:,} tokens to prefill; estimated "
                  f"{total / 2**20:,.1f} MiB at {est.bytes_per_token:,.0f} bytes/token of arrays", flush=True)
            budget = cfg.cache.storage_budget_bytes
            if budget is not None and total > budget:
                raise StorageBudgetError(
                    f"the cache needs about {total:,} bytes, above cache.storage_budget_bytes="
                    f"{budget:,}; raise the budget, use cache.feature_dtype=fp8_e4m3, or cache fewer rows "
                    "(cache.max_rows)")
            pool = run_actor_pool(rendered, ShardPrefillWriter, (cfg, root_url, fp, storage),
                                  workers=cfg.cache.num_workers, gpus=cfg.cache.gpus_per_worker or None, desc="cache",
                                  unit="tok", total=tokens, advance="num_tokens",
                                  postfix=lambda t: {"MiB": f"{t.get('bytes', 0) / 2**20:.1f}"},
                                  cpus=cfg.cache.cpus_per_worker, concurrent_calls=CONCURRENT_SHARDS)
            run["shards_written"] = len(pool.metas)
            run["faults"] = pool.faults
            n_tok, busy = pool.totals.get("num_tokens", 0), pool.totals.get("busy_seconds", 0.0)
            run["prefill_tokens_per_s"] = round(n_tok / max(pool.seconds, 1e-9), 1)
            run["steady_tokens_per_s"] = round(n_tok * cfg.cache.num_workers / max(busy, 1e-9), 1)
        finally:  # the watch stops before Ray does (ObjectStoreWatch), also when a shard fails
            store = object_store_figures()
    totals = cache_totals(root_url)
    skipped = ", ".join(f"{k} {v}" for k, v in totals["skipped_rows"].items()) or "none"
    print(f"cache: {totals['samples']:,} samples in {totals['shards']} shards; skipped rows: {skipped}"
          + (f" (reasons per row in {join(root_url, 'quarantine')})" if totals["skipped_rows"] else ""), flush=True)
    if totals["samples"] == 0:
        log.warning("cache: no usable sample in %s: every input row was skipped; check data.train_files "
                    "(formats: OpenAI messages, ShareGPT conversations)", ", ".join(input_files(cfg)) or "no input")
    return {**run, **totals, **store}


def cache_totals(root_url: str) -> dict[str, Any]:
    """Totals over every committed shard of a cache (what ``summary.json`` and ``ops stat`` show)."""
    root = open_cache(root_url, create=False)
    records = root.committed_records()
    skipped = RowCounts()
    for r in records.values():
        skipped.merge(RowCounts(0, r.extra.get("skipped", {})))
    tokens = sum(r.num_tokens for r in records.values())
    nbytes = sum(r.total_bytes for r in records.values())
    return {"shards": len(records), "samples": sum(r.num_samples for r in records.values()),
            "tokens": tokens, "supervised_tokens": sum(r.num_supervised_tokens for r in records.values()),
            "bytes": nbytes, "bytes_per_token": round(nbytes / max(tokens, 1), 2),
            "skipped_rows": dict(sorted(skipped.skipped.items())), "fingerprint": root.fingerprint.to_dict()}
