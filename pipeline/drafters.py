"""The run config's drafters as models: their :class:`training.drafter.DrafterConfig`, a fresh
initialisation and the trained drafter of a run (what calibrate, export, evaluate and the
benchmarks load)."""
from __future__ import annotations

import torch

from pipeline.config import DrafterSpec, RunConfig, SequentialHead, confidence_sampling
from pipeline.errors import MissingStageOutputError
from storage import join

__all__ = ["drafter_config", "build_drafter", "load_trained_drafter", "head_digest", "calibrated_head_url",
           "save_calibrated_head", "apply_calibrated_head"]


def drafter_config(spec: DrafterSpec, cfg: RunConfig):
    """The model's :class:`training.drafter.DrafterConfig` for one configured drafter."""
    from training.drafter import DrafterConfig

    return DrafterConfig(
        target_layer_ids=cfg.target.target_layer_ids, mask_token_id=spec.mask_token_id,
        num_layers=spec.num_layers, block_size=spec.block_size, sample_from_anchor=spec.sample_from_anchor,
        markov_rank=spec.markov_rank,
        head_type="markov" if spec.head == SequentialHead.none else spec.head.value,
        confidence_head=spec.confidence_head, confidence_grad_to_backbone=spec.confidence_grad_to_backbone,
        **dict(zip(("confidence_temperature", "confidence_top_p", "confidence_top_k"), confidence_sampling(spec, cfg))),
        num_anchors=cfg.train.num_anchors, draft_vocab_size=spec.draft_vocab_size, init=spec.init.value)


def build_drafter(spec: DrafterSpec, cfg: RunConfig, target_dir: str, d2t: torch.Tensor | None = None):
    """A freshly initialised drafter sharing the target's frozen ``embed_tokens`` and ``lm_head``."""
    from training.loop import build_drafter_from

    return build_drafter_from(drafter_config(spec, cfg), target_dir, d2t)


def load_trained_drafter(cfg: RunConfig, name: str, target_dir: str, *, calibrated: bool = False):
    """The drafter ``name`` of ``cfg.run_dir`` with the weights of its newest committed checkpoint,
    built from the model config that checkpoint records (eval mode); with ``calibrated``, the confidence
    head that calibrate refitted on the drafter's own rounds put in where calibrate adopted one
    (:func:`apply_calibrated_head`: what export ships and evaluate judges).

    Raises:
        MissingStageOutputError (a FileNotFoundError): no committed checkpoint under
            ``<run_dir>/train/<name>`` (run the train stage).
        CheckpointError: the run config disagrees with the recorded model or with the thinking mode
            (``data.render.enable_thinking``) of the cache it was trained on (the field, both values and
            the fix are named), or the checkpoint is damaged.
        StaleStageOutputError: ``calibrated`` and calibrate's head was refitted from another checkpoint.
    """
    from training.loop import load_checkpoint_drafter

    model = load_checkpoint_drafter(join(cfg.run_dir, "train", name), drafter_config(cfg.train.drafters[name], cfg),
                                    target_dir, drafter=name, enable_thinking=cfg.data.render.enable_thinking)
    if model is None:
        raise MissingStageOutputError(f"no committed checkpoint for drafter {name!r} under {cfg.run_dir}/train/{name}: "
                                      "run +stage=train first")
    if calibrated:
        apply_calibrated_head(model, calibrated_head_url(cfg, name))
    return model


def head_digest(model) -> str:
    """SHA-256 (hex) of the confidence head's parameters as float32 bytes (``proj.weight`` then
    ``proj.bias``): which trained head a refitted one replaces."""
    import hashlib

    h = hashlib.sha256()
    for t in (model.confidence_head.proj.weight, model.confidence_head.proj.bias):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def calibrated_head_url(cfg: RunConfig, name: str) -> str:
    """``<run_dir>/calibrate/<name>/confidence_head.safetensors``: the refitted head calibrate adopted."""
    return join(cfg.run_dir, "calibrate", name, "confidence_head.safetensors")


def save_calibrated_head(url: str, weight: torch.Tensor, bias: torch.Tensor, replaces: str) -> None:
    """Write a refitted head: ``proj.weight`` [1, D] and ``proj.bias`` [1] float32, with the
    :func:`head_digest` of the trained head it replaces in the metadata (``replaces``)."""
    from safetensors.torch import save

    from storage import filesystem

    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, save({"proj.weight": weight.float().contiguous(), "proj.bias": bias.float().contiguous()},
                            metadata={"replaces": replaces}))


def apply_calibrated_head(model, url: str) -> bool:
    """Put the head at ``url`` (:func:`save_calibrated_head`) into ``model``'s confidence head; False
    (the model unchanged) when there is none there.

    Raises:
        StaleStageOutputError: the file replaces another trained head than ``model``'s (the drafter was
            retrained after calibrate): rerun +stage=calibrate.
    """
    import json
    import struct

    from safetensors.torch import load

    from pipeline.errors import StaleStageOutputError
    from storage import filesystem

    fs, path = filesystem(url)
    if model.confidence_head is None or not fs.exists(path):
        return False
    raw = fs.cat_file(path)
    tensors = load(raw)
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])  # the safetensors layout: u64 length, JSON
    if header.get("__metadata__", {}).get("replaces") != head_digest(model):
        raise StaleStageOutputError(f"{url}: this refitted confidence head was fitted for another checkpoint of the "
                                    "drafter (it was retrained since): rerun +stage=calibrate")
    proj = model.confidence_head.proj
    with torch.no_grad():
        proj.weight.copy_(tensors["proj.weight"].to(proj.weight))
        proj.bias.copy_(tensors["proj.bias"].to(proj.bias))
    return True
