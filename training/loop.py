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
    from transformers import AutoConfig

    from pipeline.target import load_shared_weights
    from training.drafter import Drafter

    embed, lm_head = load_shared_weights(target_dir)
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    return Drafter(drafter_config(spec, cfg), tc, embed.float(), lm_head.float(), d2t)


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


def _resume(engine, train_url: str, world: int, zero_stage: int) -> Position:
    from training.checkpoint import CheckpointError, download_files, latest_checkpoint, read_parts

    found = latest_checkpoint(train_url)
    if found is None:
        return Position()
    ckpt, state = found
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

    rank, world = _rank_world()
    torch.manual_seed(cfg.train.seed)
    reader = CacheReader(cache_url(cfg), Fingerprint.from_json(config["fingerprint"]))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards)
    micro_per_epoch = plan_steps(split, cfg, world)
    accumulation = cfg.train.global_batch_samples // (cfg.train.micro_batch_samples * world)
    total = sum(micro_per_epoch) // accumulation
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
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
    engine = make_engine(model, cfg.train.zero_stage, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                         total_steps=total, warmup_ratio=cfg.train.warmup_ratio, bf16=cfg.train.precision == "bf16",
                         micro_batch=cfg.train.micro_batch_samples, accumulation=accumulation,
                         grad_clip=cfg.train.grad_clip)
    train_url = join(cfg.run_dir, "train", name)
    pos = _resume(engine, train_url, world, cfg.train.zero_stage)
    loss_cfg = LossConfig(ce_weight=cfg.train.loss_ce, tv_weight=cfg.train.loss_tv,
                          confidence_weight=cfg.train.loss_conf, decay_lambda=cfg.train.decay_lambda)
    state = {"drafter": name, "zero_stage": cfg.train.zero_stage, "total_steps": total, "seed": cfg.train.seed}
    metrics_fs, metrics_path = filesystem(join(train_url, "metrics.jsonl"))
    metrics_fs.makedirs(metrics_path.rsplit("/", 1)[0], exist_ok=True)
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
            if rank == 0:
                seconds = time.perf_counter() - t_step
                last = _metrics_row(out, engine, pos, tokens * world, seconds, feed.wait_seconds - waited)
                _log(metrics_fs, metrics_path, last, tb, bar)
            t_step, tokens, waited = time.perf_counter(), 0, feed.wait_seconds
            if pos.step % cfg.train.checkpoint_every_steps == 0 or pos.step == total:
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
        upload_dir(tb.log_dir, join(train_url, "tensorboard"))
        fs, path = filesystem(join(train_url, "result.json"))
        fs.pipe_file(path, json.dumps({"steps": pos.step, "total_steps": total, "last": last,
                                       "world_size": world, "checkpoint": join(train_url, "checkpoints")},
                                      default=str).encode())


def _log(fs, path: str, row: dict[str, Any], tb, bar) -> None:
    line = json.dumps(row) + "\n"
    mode = "ab" if fs.exists(path) else "wb"
    try:
        with fs.open(path, mode) as f:
            f.write(line.encode())
    except NotImplementedError:  # object stores cannot append: rewrite the (small) file
        fs.pipe_file(path, (fs.cat_file(path) if fs.exists(path) else b"") + line.encode())
    if tb is not None:
        for k, v in row.items():
            if isinstance(v, float):
                tb.add_scalar(f"train/{k}", v, row["step"])
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau_expected']:.2f}")


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
    fs, path = filesystem(join(found[0], "drafter.safetensors"))
    weights = load(fs.cat_file(path))
    d2t = weights.get("d2t")
    model = build_drafter(cfg.train.drafters[name], cfg, target_dir, d2t)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    frozen = ("embed_tokens.", "lm_head.", "target_lm_head")
    missing = [k for k in missing if not k.startswith(frozen)]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit drafter {name!r} (missing {missing}, unexpected "
                         f"{unexpected}); the train.drafters.{name} config changed since training")
    return model.eval()
