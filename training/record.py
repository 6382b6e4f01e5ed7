"""What a committed checkpoint says about its drafter: the model record, and the refusal of a run
config that disagrees with it.

Weights alone do not describe a drafter: ``block_size``, ``sample_from_anchor``, ``mask_token_id``
or ``target_layer_ids`` (same count) change no weight shape, so a state dict loads without a word
into a drafter of another layout. Every checkpoint therefore records the full
:class:`training.drafter.DrafterConfig` it was trained with; later stages build the drafter from
that record and refuse, before any compute, a config that differs on a field that matters.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from training.checkpoint import CheckpointError
from training.drafter import DrafterConfig

__all__ = ["RECORDED_FIELDS", "model_record", "config_from_record", "check_record", "check_thinking_mode",
           "format_value"]

RECORDED_FIELDS = ("architecture", "target_layer_ids", "mask_token_id", "num_layers", "block_size", "sample_from_anchor",
                   "markov_rank", "head_type", "confidence_head", "confidence_grad_to_backbone", "draft_vocab_size")
"""Fields that define the model (architecture, block layout, vocabulary); ``num_anchors`` and
``attention`` are how it is run, not what it is, and may differ between stages."""


def model_record(config: DrafterConfig) -> dict[str, Any]:
    """The JSON-able record of ``config`` (every dataclass field; tuples as lists)."""
    rec = dataclasses.asdict(config)
    rec["target_layer_ids"] = list(rec["target_layer_ids"])
    return rec


def config_from_record(record: dict[str, Any], **runtime: Any) -> DrafterConfig:
    """The :class:`DrafterConfig` of a record, with run-time fields (``num_anchors``, ``attention``)
    replaced by ``runtime`` where given.

    Raises:
        CheckpointError: the record lacks a recorded field (written by another version).
    """
    record = {"architecture": "dflash", **record}  # records written before EAGLE-3 are all DFlash backbones
    missing = [f for f in RECORDED_FIELDS if f not in record]
    if missing:
        raise CheckpointError(f"the checkpoint's model record lacks {missing}: retrain with this version")
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    return DrafterConfig(**{**{k: v for k, v in record.items() if k in known}, **runtime})


def _key(field: str, drafter: str) -> str:
    if field == "target_layer_ids":
        return "target.target_layer_ids"
    if field == "head_type":
        return f"train.drafters.{drafter}.head"
    return f"train.drafters.{drafter}.{field}"


def check_record(recorded: DrafterConfig, current: DrafterConfig, *, drafter: str, where: str) -> None:
    """Refuse a run config whose drafter differs from the one a checkpoint was trained as.

    Args:
        recorded: the checkpoint's config (:func:`config_from_record`). current: the one the run
            config gives now. drafter: its name in ``train.drafters``. where: the checkpoint URL.
    Raises:
        CheckpointError: naming every differing field, both values and the key to set.
    """
    diffs = [(f, getattr(recorded, f), getattr(current, f)) for f in RECORDED_FIELDS
             if getattr(recorded, f) != getattr(current, f)]
    if diffs:
        said = "; ".join(f"{f}: trained with {format_value(a)}, the config says {format_value(b)} "
                         f"(set {_key(f, drafter)}={format_value(a)})" for f, a, b in diffs)
        raise CheckpointError(f"drafter {drafter!r} at {where} was trained as another model: {said}; or retrain "
                              "it in a new run_dir with the new config")


def format_value(value: Any) -> str:
    """A config value as a Hydra override writes it: ``null``, ``[1,9,17]``, ``true``, ``7``."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_thinking_mode(state: dict[str, Any], enable_thinking: bool | None, *, drafter: str, where: str) -> None:
    """Refuse a run config whose thinking mode (``data.render.enable_thinking``) differs from the one
    of the cache the drafter was trained on (its checkpoint's ``cache_fingerprint``): a drafter
    trained on thinking-off renders drafts thinking-on text poorly, and the other way round.

    Raises:
        CheckpointError: both modes and the two fixes.
    """
    fp = state.get("cache_fingerprint")
    if not fp:
        return  # nothing recorded to compare with
    trained = (json.loads(fp) if isinstance(fp, str) else fp)["render_options"].get("enable_thinking")
    if trained != enable_thinking:
        raise CheckpointError(
            f"drafter {drafter!r} at {where} was trained on chats rendered with data.render.enable_thinking="
            f"{format_value(trained)}, the config says {format_value(enable_thinking)}: set data.render.enable_thinking="
            f"{format_value(trained)} (the mode the drafter serves), or cache and train in that mode in a new run_dir")
