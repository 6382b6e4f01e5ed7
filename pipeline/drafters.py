"""The run config's drafters as models: their :class:`training.drafter.DrafterConfig`, a fresh
initialisation and the trained drafter of a run (what calibrate, export, evaluate and the
benchmarks load)."""
from __future__ import annotations

import torch

from pipeline.config import DrafterSpec, RunConfig, SequentialHead, confidence_sampling
from pipeline.errors import MissingStageOutputError
from storage import join

__all__ = ["drafter_config", "build_drafter", "load_trained_drafter"]


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


def load_trained_drafter(cfg: RunConfig, name: str, target_dir: str):
    """The drafter ``name`` of ``cfg.run_dir`` with the weights of its newest committed checkpoint,
    built from the model config that checkpoint records (eval mode).

    Raises:
        MissingStageOutputError (a FileNotFoundError): no committed checkpoint under
            ``<run_dir>/train/<name>`` (run the train stage).
        CheckpointError: the run config disagrees with the recorded model or with the thinking mode
            (``data.render.enable_thinking``) of the cache it was trained on (the field, both values and
            the fix are named), or the checkpoint is damaged.
    """
    from training.loop import load_checkpoint_drafter

    model = load_checkpoint_drafter(join(cfg.run_dir, "train", name), drafter_config(cfg.train.drafters[name], cfg),
                                    target_dir, drafter=name, enable_thinking=cfg.data.render.enable_thinking)
    if model is None:
        raise MissingStageOutputError(f"no committed checkpoint for drafter {name!r} under {cfg.run_dir}/train/{name}: "
                                      "run +stage=train first")
    return model
