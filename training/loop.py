"""The per-worker training loop (runs inside Ray Train; plain torch.distributed otherwise).

Every rank reads its own shards (:mod:`training.data`), steps a DeepSpeed ZeRO (or DDP) engine
(:mod:`training.engine`) and takes part in committed checkpoints (:mod:`training.checkpoint`).
Randomness is re-derived from ``(seed, epoch, micro-step, rank)`` at every micro-step, so a resumed
run draws exactly the anchors an uninterrupted one would.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from storage import configure_storage, filesystem, join
from training.job import TrainJob
from training.metrics_log import LiveMetrics
from training.record import check_record, check_thinking_mode, model_record


FROZEN_PREFIXES = ("embed_tokens.", "lm_head.", "target_lm_head")
"""Parameter names of the target's frozen weights inside a drafter: never saved, trained or exported."""


@dataclass
class Position:
    """Where training stands: optimizer steps done, and micro-steps done in ``epoch``."""

    step: int = 0
    epoch: int = 0
    micro: int = 0


def build_drafter_from(config, target_dir: str, d2t: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float32):
    """A freshly initialised drafter of a :class:`training.drafter.DrafterConfig` on the target
    (the frozen ``embed_tokens`` / ``lm_head`` read from ``target_dir``'s safetensors; with
    ``config.init == "target"`` the backbone copied from the target, :meth:`Drafter.init_from_target`;
    ``"pretrained"``: the weights of ``config.init_path``, :meth:`Drafter.load_pretrained`).

    The frozen weights are cast once, to ``dtype``: the dtype the drafter computes in (bf16 for a
    bf16 DeepSpeed engine, whose cast then leaves them as they are; float32 for fp32 training and
    the later stages). A tied target (no ``lm_head`` stored, or one equal to the embedding) gives
    one [V, H] tensor whose storage ``embed_tokens.weight`` and ``lm_head.weight`` (or
    ``target_lm_head``) share, as two parameters, so that DeepSpeed's and the DDP engine's exclusion
    of frozen parameters by name (over ``named_parameters``, which drops a repeated object) leaves
    both out of checkpoints: at V = 151,936, H = 2,560 one copy is 0.78 GB in bf16, 1.56 GB in
    float32, where casting each separately held two. The trainable weights are initialised in
    float32 whatever ``dtype`` (the same draws for a seed).

    Args:
        config: the drafter's config. target_dir: local target directory. d2t: [V_draft] int64
            draft-to-target offsets (reduced vocabulary) or None. dtype: the frozen weights' dtype.
    Raises:
        TargetWeightsError: no safetensors weights or no embedding in ``target_dir``.
        ValueError: see :class:`training.drafter.Drafter`.
    """
    from transformers import AutoConfig

    from training.drafter import new_drafter
    from training.target_weights import load_layer_init, load_shared_weights

    embed, lm_head = load_shared_weights(target_dir)
    tied = lm_head is embed or torch.equal(lm_head, embed)
    embed = embed.to(dtype)
    lm_head = embed if tied else lm_head.to(dtype)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    model = new_drafter(config, tc, embed, lm_head, d2t)
    if config.init == "target":
        model.init_from_target(*load_layer_init(target_dir, model.init_layer))
    elif config.init == "pretrained":
        from safetensors.torch import load

        fs, path = filesystem(config.init_path)
        model.load_pretrained(load(fs.cat_file(path)))
    return model


def recorded_config(state: dict[str, Any], ckpt: str, current):
    """The drafter config a checkpoint records, with ``current``'s run-time fields (anchors, attention).

    Raises:
        CheckpointError: the checkpoint has no model record (written before checkpoints described
            their drafter): retrain it, since its layout cannot be known.
    """
    from training.checkpoint import CheckpointError
    from training.record import config_from_record

    if "model" not in state:
        raise CheckpointError(f"{ckpt} records no model config (it was written by an older version, before "
                              "checkpoints described their drafter), so its block layout cannot be checked: "
                              "retrain it in a new run_dir")
    return config_from_record(state["model"], num_anchors=current.num_anchors, attention=current.attention)


def _assigned_cpus() -> int:
    """The CPUs Ray assigned to this worker (``train.cpus_per_worker``, default 1), or torch's current
    thread count outside Ray: the intra-op threads of a CPU worker. Ray leaves torch at one thread per
    core, so two one-CPU workers on 2 cores ran 4 threads (a 600-step demo train stage: 102 s, 79 s with
    one thread each; docs/training-recipe.md)."""
    import ray

    if not ray.is_initialized():
        return torch.get_num_threads()
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    return max(1, int(cpus))


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def plan_steps(split, job: TrainJob, world: int) -> list[int]:
    """Micro-steps per epoch, every rank alike (see :func:`training.data.micro_steps_per_epoch`)."""
    from training.data import micro_steps_per_epoch

    return [micro_steps_per_epoch(split, seed=job.seed, epoch=e, world=world, micro_batch=job.micro_batch_samples,
                                  accumulation=job.accumulation(world))
            for e in range(job.epochs)]


def total_steps(micro_per_epoch: list[int], job: TrainJob, world: int) -> int:
    """Optimizer steps of the whole run: every epoch's micro-steps over the accumulation, capped
    by ``job.max_steps``."""
    total = sum(micro_per_epoch) // job.accumulation(world)
    return total if job.max_steps is None else min(total, job.max_steps)


def master_ahead(engine, weights: dict[str, torch.Tensor]) -> list[str]:
    """The trainable tensors whose fp32 master weights (the optimizer's copy under DeepSpeed's bf16
    mixed precision) differ from ``weights``, the (bf16) module weights a checkpoint stores.

    DeepSpeed creates each fp32 master from the bf16 weights, so a tensor the optimizer never
    updated keeps them equal; an update moves the master off the bf16 grid even where the bf16
    copy does not change (an AdamW step of 1e-4 on a norm weight at 1.0, below bf16's spacing of
    2**-7 there). Collective under DeepSpeed (``deepspeed.utils.safe_get_full_fp32_param``
    all-reduces each tensor over the ranks, in parameter order, on every rank).

    Args:
        engine: a :func:`training.engine.make_engine` engine. weights: name -> the module's weights
            (rank 0's :meth:`consolidated_state`; empty on the other ranks).
    Returns:
        the names, sorted (on the ranks that hold ``weights``); empty for the DDP engine and for
        fp32 training (the module's weights are the master weights).
    """
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if getattr(engine, "stage", 0) == 0 or all(p.dtype == torch.float32 for _, p in params):
        return []
    from deepspeed.utils import safe_get_full_fp32_param

    ahead = []
    for name, p in params:
        master = safe_get_full_fp32_param(p)
        if master is not None and name in weights and not torch.equal(master, weights[name].to(master.device).float()):
            ahead.append(name)
    return sorted(ahead)


def _weights_dtype(weights: dict[str, torch.Tensor]) -> str:
    """The floating dtype of a drafter's trainable weights as torch names it (``bfloat16``, ``float32``)."""
    return str(next(v.dtype for v in weights.values() if v.is_floating_point())).removeprefix("torch.")


def _save(engine, train_url: str, pos: Position, state: dict[str, Any]) -> None:
    """Collective checkpoint: every rank's engine files (without the frozen target weights) and part
    record, rank 0's ``drafter.safetensors`` (the trainable tensors in the training dtype), then rank 0
    commits, recording :func:`master_ahead` as ``master_ahead`` and the weights' dtype as
    ``weights_dtype`` (what the export guard reads)."""
    from safetensors.torch import save_file

    from training.checkpoint import commit, step_name, upload_dir, write_part

    rank, world = _rank_world()
    tag = step_name(pos.step)
    ckpt = join(train_url, "checkpoints", tag)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save(tmp, tag)
        write_part(ckpt, rank, upload_dir(tmp, join(ckpt, "engine")))
    full = {k: v for k, v in engine.consolidated_state().items() if not k.startswith(FROZEN_PREFIXES)}
    ahead = master_ahead(engine, full)
    if rank == 0:
        weights = {k: v.detach().contiguous() for k, v in full.items()}
        with tempfile.TemporaryDirectory() as tmp:
            save_file(weights, f"{tmp}/drafter.safetensors")
            fs, path = filesystem(join(ckpt, "drafter.safetensors"))
            fs.put_file(f"{tmp}/drafter.safetensors", path)
    consumed = [state.pop("_consumed")]
    if dist.is_initialized() and world > 1:  # what every rank has trained on, recorded by rank 0
        consumed = [None] * world
        dist.all_gather_object(consumed, state.get("_rank_consumed"))
    state.pop("_rank_consumed", None)
    _barrier()
    if rank == 0:
        commit(train_url, pos.step, {**state, "step": pos.step, "epoch": pos.epoch, "micro": pos.micro,
                                     "world_size": world, "consumed": consumed, "master_ahead": ahead,
                                     "weights_dtype": _weights_dtype(full)})
    _barrier()


def _resume(engine, train_url: str, world: int, zero_stage: int, optimizer: str, name: str) -> tuple[Position, dict]:
    """The position of the newest committed checkpoint (engine state loaded), and what this rank had
    consumed by then (its ``consumed`` entry; empty for a fresh run or an older checkpoint).

    Each node downloads the checkpoint's engine files once (its local rank 0, ``LOCAL_RANK`` as Ray
    Train and torchrun set it, into :func:`training.checkpoint.resume_dir`) and its ranks load from
    that copy: DeepSpeed's ZeRO-1/2 load opens every rank's optimizer file
    (``_get_all_zero_checkpoints``) plus rank 0's model states. Without ``LOCAL_RANK`` each rank
    downloads its own copy."""
    from training.checkpoint import CheckpointError, download_files, latest_checkpoint, read_parts, resume_dir

    found = latest_checkpoint(train_url)
    if found is None:
        return Position(), {}
    ckpt, state = found
    check_record(recorded_config(state, ckpt, engine.module.config), engine.module.config, drafter=name, where=ckpt)
    if state["world_size"] != world or state["zero_stage"] != zero_stage:
        raise CheckpointError(
            f"{ckpt} was written by {state['world_size']} ranks with zero_stage={state['zero_stage']}; this run "
            f"has {world} ranks and zero_stage={zero_stage}: resume with train.num_workers="
            f"{state['world_size']} train.zero_stage={state['zero_stage']}, or start a new run_dir "
            "(the consolidated drafter.safetensors of that checkpoint holds the weights)")
    if state.get("optimizer", "adamw") != optimizer:
        raise CheckpointError(f"{ckpt} holds {state.get('optimizer', 'adamw')} optimizer state; this run uses "
                              f"{optimizer}: resume with train.optimizer={state.get('optimizer', 'adamw')}, or "
                              "start a new run_dir")
    files = {rel: size for part in read_parts(ckpt, world).values() for rel, size in part.items()}
    local_rank = os.environ.get("LOCAL_RANK")  # set by Ray Train and torchrun
    rank = _rank_world()[0]
    local = resume_dir(ckpt, "node" if local_rank is not None else f"rank{rank}")
    downloads = local_rank is None or int(local_rank) == 0
    if downloads:  # one copy per node: DeepSpeed's ZeRO load reads every rank's optimizer file
        shutil.rmtree(local, ignore_errors=True)
        download_files(join(ckpt, "engine"), files, local)
    _barrier()
    engine.load(str(local), state_tag(state))
    _barrier()
    if downloads:
        shutil.rmtree(local, ignore_errors=True)
    consumed = state.get("consumed") or []
    return Position(state["step"], state["epoch"], state["micro"]), (consumed[rank] if rank < len(consumed) else {})


def preemption_notice(job: TrainJob, step: int, device: torch.device) -> bool:
    """Whether Ray Train has a preemption notice for this worker group (``ray.train.get_preemption_info``:
    a node of the group drained with reason preemption, as a cloud autoscaler or a node's SIGTERM hook
    does with ``ray drain-node``), looked up after optimizer step ``step`` when it is a multiple of
    ``job.preemption_check_every_steps`` (0: never). A collective: every rank calls it at the same
    steps, and the answer is the max over ranks (a one-element all-reduce on ``device``), because Ray
    passes the notice to each worker on its own and the checkpoint the caller writes on it is itself a
    collective. Never where Ray Train's preemption watcher is off (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``,
    which a private local instance sets: a workstation is not preempted), so a local run pays nothing.
    The caller writes a checkpoint on the first notice, so that the restart after the node is gone
    redoes only the steps trained after it (docs/failures.md)."""
    if not job.preemption_check_every_steps or step % job.preemption_check_every_steps:
        return False
    if os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1").lower() in ("0", "false"):
        return False
    import ray.train

    noticed = torch.tensor([int(ray.train.get_preemption_info() is not None)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(noticed, op=dist.ReduceOp.MAX)
    return bool(noticed.item())


def _dataset(name: str, required: bool = True):
    """This worker's Ray Train dataset iterator ``name`` (online / hybrid features); None when the
    train stage passed none and ``required`` is false (a rank with nothing left to stream)."""
    import ray.train

    try:
        it = ray.train.get_dataset_shard(name)
    except (KeyError, ValueError):
        it = None
    if it is None and required:
        raise RuntimeError(f"the train stage passed no Ray dataset {name!r} to this worker")
    return it


def state_tag(state: dict[str, Any]) -> str:
    from training.checkpoint import step_name

    return step_name(state["step"])


def _metrics_row(out, engine, pos: Position, tokens: int, seconds: float, wait: float) -> dict[str, Any]:
    m = {k: (v.tolist() if v.numel() > 1 else float(v)) for k, v in out.metrics.items()}
    return {"step": pos.step, "epoch": pos.epoch, "lr": engine.lr(), **m, "tokens_per_s": tokens / max(seconds, 1e-9),
            "data_wait_fraction": wait / max(seconds, 1e-9)}


class _Data:
    """A worker's data: the cache reader (None while features stream), the shard split, the
    validation source and batches, and this rank's stream rows (online / hybrid)."""

    def __init__(self, job: TrainJob, rank: int, world: int):
        from cache_schema import CacheReader, Fingerprint
        from training.data import split_shards
        from training.stream import VALIDATION_DATASET, MemoryReader, rank_dataset_name
        from training.validation import validation_batches

        self.job, self.fingerprint = job, Fingerprint.from_json(job.fingerprint)
        self.streamed = job.features in ("online", "hybrid")
        self.reader = None if self.streamed else CacheReader(job.cache_url, self.fingerprint)
        counts = job.shard_counts if self.streamed else {s: r.num_samples for s, r in self.reader.records.items()}
        self.split = split_shards(counts, job.heldout_shards, job.validation_shards)
        self.rows = None
        if self.streamed:  # the same validation samples as a cache read, computed by the same prefill actors
            self.val_source = (MemoryReader(list(_dataset(VALIDATION_DATASET).iter_rows()))
                               if self.split.validation else None)
            it = _dataset(rank_dataset_name(rank), required=False)
            self.rows = iter(it.iter_rows()) if it is not None else None
        else:
            self.val_source = self.reader
        self.val_batches = validation_batches(self.split, self.val_source, micro_batch=job.micro_batch_samples,
                                              max_samples=job.validation_samples,
                                              world=world) if self.split.validation else []

    def streams(self, epoch: int) -> bool:
        """Whether ``epoch`` reads the stream (online: every epoch; hybrid: epoch 0) or the cache."""
        return self.job.features == "online" or (self.job.features == "hybrid" and epoch == 0)

    def drain(self) -> None:
        """Hybrid: read the rest of the epoch-0 stream (the shards' commits happen in the actors),
        then wait for every rank, so that the cache is complete before anyone reads it.

        Raises:
            RuntimeError: some training shards are still not committed (their writes failed).
        """
        from cache_schema import CacheReader

        if self.rows is not None:
            for _ in self.rows:
                pass
            self.rows = None
        _barrier()
        self.reader = CacheReader(self.job.cache_url, self.fingerprint)
        missing = sorted(set(self.split.train) - set(self.reader.records))
        if missing:
            raise RuntimeError(f"hybrid: epoch 0 ended but training shards {missing[:5]} of {self.job.cache_url} are "
                               "not committed (their writes failed; see the prefill actors' log): rerun the train "
                               "stage, which rewrites them")


def _build(job: TrainJob, data: _Data, total: int, accumulation: int):
    """The drafter and its engine for ``total`` optimizer steps of ``accumulation`` micro-steps.

    Returns:
        (engine, d2t): the engine (:func:`training.engine.make_engine`; the drafter is
        ``engine.module``) and the reduced vocabulary's draft-to-target offsets (int64
        [draft_vocab_size], ``arange + d2t`` = target ids: :func:`training.draft_vocab.build_d2t`,
        counted over every training shard, the same on every rank), or None for the full vocabulary.
    """
    from training.engine import make_engine

    d2t = None
    if job.model.draft_vocab_size is not None:
        from training.draft_vocab import build_d2t, count_supervised_tokens

        counts = count_supervised_tokens(data.reader.token_arrays(data.split.train),
                                         data.reader.fingerprint.target["vocab_size"])
        d2t = build_d2t(counts, job.model.draft_vocab_size)
    model = build_drafter_from(job.model, job.target_dir, d2t, dtype=compute_dtype(job))
    engine = make_engine(model, job.zero_stage, lr=job.lr, muon_lr=job.muon_lr, betas=job.betas,
                         weight_decay=job.weight_decay,
                         total_steps=total, warmup_ratio=job.warmup_ratio, bf16=job.bf16,
                         micro_batch=job.micro_batch_samples, accumulation=accumulation, grad_clip=job.grad_clip)
    return engine, d2t


def compute_dtype(job: TrainJob) -> torch.dtype:
    """The dtype a job's drafter computes in: bf16 under a bf16 DeepSpeed engine (``job.bf16`` and
    ZeRO stage >= 1; DeepSpeed casts the module's float32 parameters to it), else float32 (the DDP
    engine trains in float32 whatever ``bf16``)."""
    return torch.bfloat16 if job.bf16 and job.zero_stage > 0 else torch.float32


def host_batch(samples, pin: bool):
    """The :class:`training.blocks.DraftBatch` of a micro-batch's sample mappings, on the CPU
    (:func:`training.blocks.collate_samples`), in pinned memory when ``pin`` (a CUDA model:
    :func:`training.data.pin_batch`). Runs on the prefetch thread in cache mode.

    Raises:
        ValueError: samples that do not collate (see :func:`training.blocks.collate_samples`).
        RuntimeError: ``pin`` without a CUDA device.
    """
    from training.blocks import collate_samples
    from training.data import pin_batch

    batch = collate_samples(samples)
    return pin_batch(batch) if pin else batch


def micro_step(engine, batch, generator: torch.Generator, loss_cfg, world: int):
    """One training micro-step on a CPU batch: blocks drawn on the CPU (``engine.module.make_blocks``
    with ``generator``, a CPU generator, so the anchors are the same on every device), batch and
    blocks moved to the model's device (:func:`training.data.to_device`, the one hand-off: the
    engines do not move inputs; a no-op on a CPU model), forward, loss, ``backward(loss * world)``
    (the engine averages gradients over ranks) and ``engine.step()``.

    Args:
        engine: a :func:`training.engine.make_engine` engine (its ``module`` a drafter).
        batch: a :class:`training.blocks.DraftBatch` on the CPU (pinned for a CUDA model).
        loss_cfg: a :class:`training.losses.LossConfig`. world: the number of ranks.
    Returns:
        the :class:`training.losses.LossOutput` (tensors on the model's device).
    """
    from training.data import module_device, to_device

    model = engine.module
    blocks = model.make_blocks(batch, generator)
    device = module_device(model)
    out = model.loss(engine(to_device(batch, device), to_device(blocks, device)), loss_cfg)
    engine.backward(out.loss * world)
    engine.step()
    return out


def train_worker(config: dict[str, Any]) -> None:
    """Train one drafter (``config["job"]``, a :class:`training.job.TrainJob`) on its cache; the
    Ray Train entry point.

    Features come from the cache, or (``job.features`` online / hybrid) from the Ray Train datasets
    the train stage built (:mod:`training.stream`); the model, loss, order and anchors are the same
    code in every mode.

    Writes, under ``job.output_url``: committed checkpoints (each records what every rank has
    ``consumed``: :class:`training.stream.ConsumedLog`), ``metrics.jsonl`` (rank 0, one row per
    optimizer step) and TensorBoard events in ``tensorboard/``, both as the run goes
    (:class:`training.metrics_log.LiveMetrics`, every ``job.metrics_flush_seconds`` on object
    storage), ``curves.png`` and ``result.json`` at the end (with the stream's rows, bytes and peak
    in-flight bytes in online / hybrid mode).

    Raises:
        FingerprintMismatchError: the cache does not fit the job's fingerprint (before step 1).
        CheckpointError: an incomplete checkpoint or one written for another world size or model.
        ValueError: the cache's training samples make no full optimizer step.
    """
    job: TrainJob = config["job"]
    if not job.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(_assigned_cpus())
    from training.data import READ_THREADS_PER_CPU, Prefetcher, module_device, rank_order
    from training.stream import ConsumedLog, StreamFeed, max_ahead_bytes
    from training.validation import validate

    configure_storage(job.storage)  # every S3 client of this worker process
    rank, world = _rank_world()
    torch.manual_seed(job.seed)
    data = _Data(job, rank, world)
    split = data.split
    micro_per_epoch = plan_steps(split, job, world)
    accumulation = job.accumulation(world)
    total = total_steps(micro_per_epoch, job, world)
    if total < 1:
        raise ValueError(f"the cache's {sum(split.counts[s] for s in split.train)} training samples make no full "
                         f"optimizer step of {job.global_batch_samples} samples")
    engine, d2t = _build(job, data, total, accumulation)
    name, train_url, loss_cfg = job.drafter, job.output_url, job.loss
    optimizer = "adamw" if job.muon_lr is None else "muon"
    pos, consumed_state = _resume(engine, train_url, world, job.zero_stage, optimizer, name)
    consumed = ConsumedLog(consumed_state)
    state = {"drafter": name, "zero_stage": job.zero_stage, "optimizer": optimizer, "total_steps": total,
             "seed": job.seed,
             "model": model_record(engine.module.config), "cache_fingerprint": job.fingerprint,
             "reduced_vocabulary": d2t is not None, "features": job.features}
    log = LiveMetrics(join(train_url, "metrics.jsonl"), pos.step,
                      tensorboard_url=join(train_url, "tensorboard") if "tensorboard" in job.report_to else None,
                      flush_seconds=job.metrics_flush_seconds, trackers=_trackers(job)) if rank == 0 else None
    bar = _progress(total, pos.step, name) if rank == 0 else None
    t_step, tokens, waited, last = time.perf_counter(), 0, 0.0, None
    noticed = False  # a preemption notice was acted on (one checkpoint per attempt)
    timeline: list = []  # (produced_at, consumed_at, bytes) of every streamed row
    pin = module_device(engine.module).type == "cuda"

    while pos.step < total and pos.epoch < job.epochs:
        order = rank_order(split, seed=job.seed, epoch=pos.epoch, rank=rank, world=world)
        if data.streams(pos.epoch):
            feed = StreamFeed(data.rows, order, job.micro_batch_samples, pos.micro, micro_per_epoch[pos.epoch],
                              pos.epoch, timeline)
            batches = ((samples, host_batch(samples, pin)) for samples in feed)
        else:
            if data.reader is None:  # hybrid, resumed after epoch 0: the driver completed the cache
                data.drain()
            feed = Prefetcher(data.reader, order, job.micro_batch_samples, pos.micro, micro_per_epoch[pos.epoch],
                              collate=functools.partial(host_batch, pin=pin),  # collated (pinned) in its thread
                              workers=READ_THREADS_PER_CPU * _assigned_cpus())  # train.cpus_per_worker
            batches = feed
        waited = feed.wait_seconds
        for samples, batch in batches:
            consumed.add(samples)
            gen = torch.Generator().manual_seed(hash((job.seed, pos.epoch, pos.micro, rank)) % 2**63)
            out = micro_step(engine, batch, gen, loss_cfg, world)
            tokens += int(batch.lengths.sum())  # the CPU batch: no device sync
            pos.micro += 1
            if pos.micro % accumulation:
                continue
            pos.step += 1
            if job.step_delay_s:
                time.sleep(job.step_delay_s)
            seconds = time.perf_counter() - t_step
            validated = {}
            if data.val_batches and (pos.step % job.validate_every_steps == 0 or pos.step == total):
                val = validate(engine.module, data.val_source, data.val_batches, loss_cfg, rank=rank, world=world)
                validated = {f"val_{k}": v for k, v in val.items()}
            if rank == 0:
                last = {**_metrics_row(out, engine, pos, tokens * world, seconds, feed.wait_seconds - waited),
                        **validated}
                log.add(last)
                _show_step(last, bar)
            t_step, tokens, waited = time.perf_counter(), 0, feed.wait_seconds
            reason = "periodic" if pos.step % job.checkpoint_every_steps == 0 or pos.step == total else None
            if not noticed and preemption_notice(job, pos.step, module_device(engine.module)):  # one per notice
                noticed, reason = True, "preemption"
            if reason is not None:
                if rank == 0:
                    log.flush()
                mine = consumed.state(pos.epoch, pos.micro)
                _save(engine, train_url, pos, {**state, "reason": reason, "_consumed": mine, "_rank_consumed": mine})
                if rank == 0 and job.keep_checkpoints is not None:  # committed: drop the ones beyond the newest N
                    from training.checkpoint import prune_checkpoints

                    prune_checkpoints(train_url, job.keep_checkpoints)
            if pos.step >= total:
                break
        else:
            if job.features == "hybrid" and pos.epoch == 0:
                data.drain()
            pos.epoch, pos.micro = pos.epoch + 1, 0
            continue
        break
    if job.features == "hybrid" and data.rows is not None:  # the budget ended inside epoch 0: finish the cache
        data.drain()
    if rank == 0:
        stream = None
        if data.streamed:
            stream = {"rows": len(timeline), "bytes": int(sum(n for _, _, n in timeline)),
                      "max_ahead_bytes": max_ahead_bytes(timeline), "bound_bytes": job.stream_bound_bytes}
        bar.close()
        _write_outputs(job, log, {"steps": pos.step, "total_steps": total, "last": last, "world_size": world,
                                  "torch_threads": torch.get_num_threads(),
                                  "features": job.features, "stream": stream,
                                  "consumed": consumed.state(pos.epoch, pos.micro),
                                  "checkpoint": join(train_url, "checkpoints")})


def _trackers(job: TrainJob) -> list:
    """Rank 0's experiment trackers of ``job.report_to`` (:func:`training.trackers.open_trackers`)."""
    from training.trackers import open_trackers

    fs, path = filesystem(job.output_url)
    local = path if isinstance(fs, LocalFileSystem) else None
    run_name = f"{job.output_url.rstrip('/').rsplit('/', 3)[-3]}/{job.drafter}"  # <run_dir name>/<drafter>
    return open_trackers(job.report_to, project=job.tracker_project, run_name=run_name, run_key=job.output_url,
                         params=dict(job.tracker_params), local_dir=local)


def _write_outputs(job: TrainJob, log: LiveMetrics, result: dict[str, Any]) -> None:
    """Rank 0 at the end: the last metrics and TensorBoard events (``log`` closed), ``curves.png``
    (held-out learning curves, when validated) and ``result.json`` (``result`` plus the curves' summary)."""
    from training.validation import curve_summary, plot_curves

    train_url = job.output_url
    log.close()
    curves = curve_summary(log.rows)
    if curves is not None:
        with tempfile.TemporaryDirectory() as tmp:
            plot_curves(f"{tmp}/curves.png", log.rows, f"{job.drafter}: held-out learning curves")
            fs, path = filesystem(join(train_url, "curves.png"))
            fs.put_file(f"{tmp}/curves.png", path)
    fs, path = filesystem(join(train_url, "result.json"))
    fs.pipe_file(path, json.dumps({**result, "validation": curves}, default=str).encode())


def _show_step(row: dict[str, Any], bar) -> None:
    bar.update(1)
    postfix = {"loss": f"{row['loss']:.3f}", "tau": f"{row['tau_expected']:.2f}"}
    if "val_tau_expected" in row:
        postfix["val_tau"] = f"{row['val_tau_expected']:.3f}"
    bar.set_postfix(**postfix)


def _progress(total: int, done: int, name: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=f"train {name}", unit="step", mininterval=1.0)


def load_checkpoint_drafter(train_url: str, current, target_dir: str, *, drafter: str,
                            enable_thinking: bool | None):
    """The drafter of the newest committed checkpoint under ``train_url``, built from the model
    config the checkpoint records (eval mode), or None when nothing is committed there.

    Args:
        current: the :class:`training.drafter.DrafterConfig` the run config gives now; it must agree
            with the record (:func:`training.record.check_record`) and supplies the run-time fields.
        drafter: its name in the run config (for messages). enable_thinking: the run's thinking
            mode (``data.render.enable_thinking``), checked against the cache the drafter was trained on.
    Raises:
        CheckpointError: no model record, a record that disagrees with ``current``, a thinking mode
            other than the one of the cache it was trained on, or weights that do not fit the recorded model.
    """
    from safetensors.torch import load

    from training.checkpoint import CheckpointError, latest_checkpoint

    found = latest_checkpoint(train_url)
    if found is None:
        return None
    recorded = recorded_config(found[1], found[0], current)
    check_record(recorded, current, drafter=drafter, where=found[0])
    check_thinking_mode(found[1], enable_thinking, drafter=drafter, where=found[0])
    fs, path = filesystem(join(found[0], "drafter.safetensors"))
    weights = load(fs.cat_file(path))
    model = build_drafter_from(recorded, target_dir, weights.get("d2t"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(FROZEN_PREFIXES)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: the weights do not fit the model the checkpoint records (missing {missing}, "
                              f"unexpected {unexpected}): the checkpoint is damaged; retrain drafter {drafter!r}")
    return model.eval()
