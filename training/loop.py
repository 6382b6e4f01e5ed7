"""The per-worker training loop (runs inside Ray Train; plain torch.distributed otherwise).

Every rank reads its own shards (:mod:`training.data`), steps a DeepSpeed ZeRO (or DDP) engine
(:mod:`training.engine`) and takes part in committed checkpoints (:mod:`training.checkpoint`).
Randomness is re-derived from ``(seed, epoch, micro-step, rank)`` at every micro-step, so a resumed
run draws exactly the anchors an uninterrupted one would.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.config import DrafterSpec, RunConfig, SequentialHead
from pipeline.storage import filesystem, join
from training.record import check_record, model_record


@dataclass
class Position:
    """Where training stands: optimizer steps done, and micro-steps done in ``epoch``."""

    step: int = 0
    epoch: int = 0
    micro: int = 0


def drafter_config(spec: DrafterSpec, cfg: RunConfig):
    """The model's :class:`training.drafter.DrafterConfig` for one configured drafter."""
    from training.drafter import DrafterConfig

    return DrafterConfig(
        target_layer_ids=cfg.target.target_layer_ids, mask_token_id=spec.mask_token_id,
        num_layers=spec.num_layers, block_size=spec.block_size, sample_from_anchor=spec.sample_from_anchor,
        markov_rank=spec.markov_rank,
        head_type="markov" if spec.head == SequentialHead.none else spec.head.value,
        confidence_head=spec.confidence_head, confidence_grad_to_backbone=spec.confidence_grad_to_backbone,
        num_anchors=cfg.train.num_anchors, draft_vocab_size=spec.draft_vocab_size)


def build_drafter(spec: DrafterSpec, cfg: RunConfig, target_dir: str, d2t: torch.Tensor | None = None):
    """A freshly initialised drafter sharing the target's frozen ``embed_tokens`` and ``lm_head``."""
    return build_drafter_from(drafter_config(spec, cfg), target_dir, d2t)


def build_drafter_from(config, target_dir: str, d2t: torch.Tensor | None = None):
    """A freshly initialised drafter of a :class:`training.drafter.DrafterConfig` on the target."""
    from transformers import AutoConfig

    from pipeline.target import load_shared_weights
    from training.drafter import Drafter

    embed, lm_head = load_shared_weights(target_dir)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return Drafter(config, tc, embed.float(), lm_head.float(), d2t)


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


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def plan_steps(split, cfg: RunConfig, world: int) -> list[int]:
    """Micro-steps per epoch, every rank alike (see :func:`training.data.micro_steps_per_epoch`)."""
    from training.data import micro_steps_per_epoch

    accumulation = cfg.train.global_batch_samples // (cfg.train.micro_batch_samples * world)
    return [micro_steps_per_epoch(split, seed=cfg.train.seed, epoch=e, world=world,
                                  micro_batch=cfg.train.micro_batch_samples, accumulation=accumulation)
            for e in range(cfg.train.epochs)]


def total_steps(micro_per_epoch: list[int], cfg: RunConfig, world: int) -> int:
    """Optimizer steps of the whole run: every epoch's micro-steps over the accumulation, capped
    by ``train.max_steps``."""
    accumulation = cfg.train.global_batch_samples // (cfg.train.micro_batch_samples * world)
    total = sum(micro_per_epoch) // accumulation
    return total if cfg.train.max_steps is None else min(total, cfg.train.max_steps)


def _save(engine, train_url: str, pos: Position, state: dict[str, Any]) -> None:
    """Collective checkpoint: every rank's engine files and part record, then rank 0 commits."""
    from safetensors.torch import save_file

    from training.checkpoint import commit, step_name, upload_dir, write_part

    rank, world = _rank_world()
    tag = step_name(pos.step)
    ckpt = join(train_url, "checkpoints", tag)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save(tmp, tag)
        write_part(ckpt, rank, upload_dir(tmp, join(ckpt, "engine")))
    full = engine.consolidated_state()
    if rank == 0:
        weights = {k: v.detach().float().contiguous() for k, v in full.items()
                   if not k.startswith(("embed_tokens.", "lm_head.", "target_lm_head"))}
        with tempfile.TemporaryDirectory() as tmp:
            save_file(weights, f"{tmp}/drafter.safetensors")
            fs, path = filesystem(join(ckpt, "drafter.safetensors"))
            fs.put_file(f"{tmp}/drafter.safetensors", path)
    _barrier()
    if rank == 0:
        commit(train_url, pos.step, {**state, "step": pos.step, "epoch": pos.epoch, "micro": pos.micro,
                                     "world_size": world})
    _barrier()


def _resume(engine, train_url: str, world: int, zero_stage: int, name: str) -> Position:
    from training.checkpoint import CheckpointError, download_files, latest_checkpoint, read_parts

    found = latest_checkpoint(train_url)
    if found is None:
        return Position()
    ckpt, state = found
    check_record(recorded_config(state, ckpt, engine.module.config), engine.module.config, drafter=name, where=ckpt)
    if state["world_size"] != world or state["zero_stage"] != zero_stage:
        raise CheckpointError(
            f"{ckpt} was written by {state['world_size']} ranks with zero_stage={state['zero_stage']}; this run "
            f"has {world} ranks and zero_stage={zero_stage}: resume with train.num_workers="
            f"{state['world_size']} train.zero_stage={state['zero_stage']}, or start a new run_dir "
            "(the consolidated drafter.safetensors of that checkpoint holds the weights)")
    files = {rel: size for part in read_parts(ckpt, world).values() for rel, size in part.items()}
    with tempfile.TemporaryDirectory() as tmp:
        download_files(join(ckpt, "engine"), files, tmp)
        engine.load(tmp, state_tag(state))
    return Position(state["step"], state["epoch"], state["micro"])


def state_tag(state: dict[str, Any]) -> str:
    from training.checkpoint import step_name

    return step_name(state["step"])


def _metrics_row(out, engine, pos: Position, tokens: int, seconds: float, wait: float) -> dict[str, Any]:
    m = {k: (v.tolist() if v.numel() > 1 else float(v)) for k, v in out.metrics.items()}
    return {"step": pos.step, "epoch": pos.epoch, "lr": engine.lr(), **m, "tokens_per_s": tokens / max(seconds, 1e-9),
            "data_wait_fraction": wait / max(seconds, 1e-9)}


def train_worker(config: dict[str, Any]) -> None:
    """Train one drafter (``config["drafter"]``) on the run's cache; the Ray Train entry point.

    Writes, under ``<run_dir>/train/<drafter>/``: committed checkpoints, ``metrics.jsonl`` (rank 0,
    one row per optimizer step), TensorBoard events, and ``result.json`` at the end.

    Raises:
        FingerprintMismatchError: the cache does not fit the training config (before step 1).
        CheckpointError: an incomplete checkpoint or one written for another world size.
    """
    cfg: RunConfig = config["cfg"]
    name: str = config["drafter"]
    if not cfg.train.use_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from cache_schema import CacheReader, Fingerprint
    from pipeline.cache import cache_url
    from training.blocks import collate_samples
    from training.checkpoint import upload_dir
    from training.data import Prefetcher, rank_order, split_shards
    from training.engine import make_engine
    from training.losses import LossConfig
    from training.validation import curve_summary, plot_curves, validate, validation_batches

    from pipeline.storage import configure_storage

    configure_storage(cfg.storage)
    rank, world = _rank_world()
    torch.manual_seed(cfg.train.seed)
    reader = CacheReader(cache_url(cfg), Fingerprint.from_json(config["fingerprint"]))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                         cfg.train.validation_shards)
    val_batches = validation_batches(split, reader, micro_batch=cfg.train.micro_batch_samples,
                                     max_samples=cfg.train.validation_samples, world=world)
    micro_per_epoch = plan_steps(split, cfg, world)
    accumulation = cfg.train.global_batch_samples // (cfg.train.micro_batch_samples * world)
    total = total_steps(micro_per_epoch, cfg, world)
    if total < 1:
        raise ValueError(f"the cache's {sum(split.counts[s] for s in split.train)} training samples make no full "
                         f"optimizer step of train.global_batch_samples={cfg.train.global_batch_samples}")
    spec = cfg.train.drafters[name]
    d2t = None
    if spec.draft_vocab_size is not None:  # the same on every rank: counted over all training shards
        from training.draft_vocab import build_d2t, count_supervised_tokens

        counts = count_supervised_tokens(reader.token_arrays(split.train), reader.fingerprint.target["vocab_size"])
        d2t = build_d2t(counts, spec.draft_vocab_size)
    model = build_drafter(spec, cfg, config["target_dir"], d2t)
    engine = make_engine(model, cfg.train.zero_stage, lr=cfg.train.lr, betas=(0.9, cfg.train.adam_beta2),
                         weight_decay=cfg.train.weight_decay,
                         total_steps=total, warmup_ratio=cfg.train.warmup_ratio, bf16=cfg.train.precision == "bf16",
                         micro_batch=cfg.train.micro_batch_samples, accumulation=accumulation,
                         grad_clip=cfg.train.grad_clip)
    train_url = join(cfg.run_dir, "train", name)
    pos = _resume(engine, train_url, world, cfg.train.zero_stage, name)
    loss_cfg = LossConfig(ce_weight=cfg.train.loss_ce, tv_weight=cfg.train.loss_tv,
                          confidence_weight=cfg.train.loss_conf, decay_lambda=cfg.train.decay_lambda)
    state = {"drafter": name, "zero_stage": cfg.train.zero_stage, "total_steps": total, "seed": cfg.train.seed,
             "model": model_record(model.config), "cache_fingerprint": config["fingerprint"],
             "reduced_vocabulary": d2t is not None}
    log = MetricsLog(join(train_url, "metrics.jsonl"), pos.step) if rank == 0 else None
    tb = _tensorboard() if rank == 0 else None
    bar = _progress(total, pos.step, name) if rank == 0 else None
    t_step, tokens, waited, last = time.perf_counter(), 0, 0.0, None
    while pos.step < total and pos.epoch < cfg.train.epochs:
        order = rank_order(split, seed=cfg.train.seed, epoch=pos.epoch, rank=rank, world=world)
        feed = Prefetcher(reader, order, cfg.train.micro_batch_samples, pos.micro, micro_per_epoch[pos.epoch])
        for samples in feed:
            batch = collate_samples(samples)
            gen = torch.Generator().manual_seed(hash((cfg.train.seed, pos.epoch, pos.micro, rank)) % 2**63)
            blocks = engine.module.make_blocks(batch, gen)
            out = engine.module.loss(engine(batch, blocks), loss_cfg)
            engine.backward(out.loss * world)  # the engine averages gradients over ranks
            engine.step()
            tokens += int(batch.lengths.sum())
            pos.micro += 1
            if pos.micro % accumulation:
                continue
            pos.step += 1
            seconds = time.perf_counter() - t_step
            validated = {}
            if val_batches and (pos.step % cfg.train.validate_every_steps == 0 or pos.step == total):
                val = validate(engine.module, reader, val_batches, loss_cfg, rank=rank, world=world)
                validated = {f"val_{k}": v for k, v in val.items()}
            if rank == 0:
                last = {**_metrics_row(out, engine, pos, tokens * world, seconds, feed.wait_seconds - waited),
                        **validated}
                log.add(last)
                _log_step(last, tb, bar)
            t_step, tokens, waited = time.perf_counter(), 0, feed.wait_seconds
            if pos.step % cfg.train.checkpoint_every_steps == 0 or pos.step == total:
                if rank == 0:
                    log.flush()
                _save(engine, train_url, pos, state)
            if pos.step >= total:
                break
        else:
            pos.epoch, pos.micro = pos.epoch + 1, 0
            continue
        break
    if rank == 0:
        bar.close()
        tb.close()
        log.flush()
        upload_dir(tb.log_dir, join(train_url, "tensorboard"))
        curves = curve_summary(log.rows)
        if curves is not None:
            with tempfile.TemporaryDirectory() as tmp:
                plot_curves(f"{tmp}/curves.png", log.rows, f"{name}: held-out learning curves")
                fs, path = filesystem(join(train_url, "curves.png"))
                fs.put_file(f"{tmp}/curves.png", path)
        fs, path = filesystem(join(train_url, "result.json"))
        fs.pipe_file(path, json.dumps({"steps": pos.step, "total_steps": total, "last": last,
                                       "validation": curves, "world_size": world,
                                       "checkpoint": join(train_url, "checkpoints")}, default=str).encode())


class MetricsLog:
    """``metrics.jsonl``: one row per optimizer step, written whole at checkpoints and at the end
    (an object store cannot append; rewriting it every step would cost O(steps^2) bytes).

    On resume the rows of steps after the resumed checkpoint (written by the killed attempt) are
    dropped, so the file keeps exactly one row per step.
    """

    def __init__(self, url: str, resumed_step: int):
        self.fs, self.path = filesystem(url)
        self.rows: list[dict[str, Any]] = []
        if self.fs.exists(self.path):
            lines = self.fs.cat_file(self.path).decode().splitlines()
            self.rows = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= resumed_step]

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(self.path, "".join(json.dumps(r) + "\n" for r in self.rows).encode())


def _log_step(row: dict[str, Any], tb, bar) -> None:
    for k, v in row.items():
        if isinstance(v, float):
            tb.add_scalar(f"{'validation' if k.startswith('val_') else 'train'}/{k.removeprefix('val_')}", v,
                          row["step"])
    bar.update(1)
    postfix = {"loss": f"{row['loss']:.3f}", "tau": f"{row['tau_expected']:.2f}"}
    if "val_tau_expected" in row:
        postfix["val_tau"] = f"{row['val_tau_expected']:.3f}"
    bar.set_postfix(**postfix)


def _tensorboard():
    """TensorBoard events go to a local folder, copied to the run's ``tensorboard/`` at the end."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(tempfile.mkdtemp(prefix="dspark-tb-"))


def _progress(total: int, done: int, name: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=f"train {name}", unit="step")


def load_trained_drafter(cfg: RunConfig, name: str, target_dir: str):
    """The drafter ``name`` with the weights of its newest committed checkpoint (eval mode).

    Raises:
        MissingStageOutputError (a FileNotFoundError): no committed checkpoint under
        ``<run_dir>/train/<name>`` (run the train stage).
    """
    from safetensors.torch import load
    from training.checkpoint import latest_checkpoint

    found = latest_checkpoint(join(cfg.run_dir, "train", name))
    if found is None:
        from pipeline.errors import MissingStageOutputError

        raise MissingStageOutputError(f"no committed checkpoint for drafter {name!r} under {cfg.run_dir}/train/{name}: "
                                      "run +stage=train first")
    current = drafter_config(cfg.train.drafters[name], cfg)
    recorded = recorded_config(found[1], found[0], current)
    check_record(recorded, current, drafter=name, where=found[0])
    fs, path = filesystem(join(found[0], "drafter.safetensors"))
    weights = load(fs.cat_file(path))
    d2t = weights.get("d2t")
    model = build_drafter_from(recorded, target_dir, d2t)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    frozen = ("embed_tokens.", "lm_head.", "target_lm_head")
    missing = [k for k in missing if not k.startswith(frozen)]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit drafter {name!r} (missing {missing}, unexpected "
                         f"{unexpected}); the train.drafters.{name} config changed since training")
    return model.eval()
