"""The run config's drafters as models: their :class:`training.drafter.DrafterConfig`, a fresh
initialisation, a published drafter to start from (``init: pretrained``) and the trained drafter of a
run (what calibrate, export, evaluate and the benchmarks load)."""
from __future__ import annotations

import torch

from pipeline.config import DrafterInit, DrafterSpec, RunConfig, SequentialHead, confidence_sampling
from pipeline.errors import MissingStageOutputError
from storage import join

__all__ = ["drafter_config", "build_drafter", "pretrained_init_url", "prepare_pretrained", "load_trained_drafter",
           "head_digest", "calibrated_head_url", "save_calibrated_head", "apply_calibrated_head"]

# fields a published drafter must share with the configured one (its layout and the cache's features)
PRETRAINED_FIELDS = ("architecture", "target_layer_ids", "mask_token_id", "num_layers", "block_size", "sample_from_anchor",
                     "markov_rank")

# an eagle3 drafter's layout is its fused layers (the first, middle and last captured one); its block size is the
# steps drafted per round and its mask token is not read, so neither has to match
EAGLE3_PRETRAINED_FIELDS = ("architecture", "eagle3_layer_ids", "num_layers")


def drafter_config(spec: DrafterSpec, cfg: RunConfig):
    """The model's :class:`training.drafter.DrafterConfig` for one configured drafter."""
    from training.drafter import DrafterConfig

    return DrafterConfig(
        target_layer_ids=cfg.target.target_layer_ids, mask_token_id=spec.mask_token_id,
        architecture=spec.architecture.value,
        num_layers=spec.num_layers, block_size=spec.block_size, sample_from_anchor=spec.sample_from_anchor,
        markov_rank=spec.markov_rank,
        head_type="markov" if spec.head == SequentialHead.none else spec.head.value,
        confidence_head=spec.confidence_head, confidence_grad_to_backbone=spec.confidence_grad_to_backbone,
        **dict(zip(("confidence_temperature", "confidence_top_p", "confidence_top_k"), confidence_sampling(spec, cfg))),
        num_anchors=cfg.train.num_anchors, draft_vocab_size=spec.draft_vocab_size, init=spec.init.value,
        init_path=None if spec.init != DrafterInit.pretrained else pretrained_init_url(cfg, _name(cfg, spec)))


def _name(cfg: RunConfig, spec: DrafterSpec) -> str:
    """The key of ``spec`` in ``cfg.train.drafters``. Raises ValueError for a spec that is not the run's."""
    for n, s in cfg.train.drafters.items():
        if s is spec:
            return n
    raise ValueError("a drafter with init: pretrained must be one of the run config's train.drafters")


def pretrained_init_url(cfg: RunConfig, name: str) -> str:
    """Where the train stage keeps the weights a pretrained drafter starts from, in the drafter's own
    parameter names: ``<run_dir>/train/<name>/init/model.safetensors`` (the checkpoint records this URL,
    so export rebuilds the same starting point)."""
    return join(cfg.run_dir, "train", name, "init", "model.safetensors")


def prepare_pretrained(cfg: RunConfig, name: str, target_dir: str) -> dict:
    """Read drafter ``name``'s ``pretrained_path`` (an export in any format the export stage writes:
    native, i.e. vLLM's, z-lab ``dflash``'s and SpecForge's layout, or speculators), check it against the
    configured drafter and the cache's captured layers, and write its trainable weights to
    :func:`pretrained_init_url` for the training workers.

    Returns:
        ``{"source", "init_url", "tensors", "fresh": [modules the export does not hold, left as
        initialised: the confidence head a DFlash export drops]}``.
    Raises:
        ConfigError: the export's layout differs from the config (every differing field, both values and
            the key to set), or it carries a head the config does not have.
        ExportError: an incomplete or unreadable export (:func:`pipeline.stages.export_format.load_export`).
    """
    from safetensors.torch import save

    from pipeline.errors import ConfigError
    from pipeline.stages.export_format import load_export
    from storage import filesystem
    from training.drafter import FROZEN_STATE
    from training.record import format_value

    spec = cfg.train.drafters[name]
    theirs = load_export(spec.pretrained_path, target_dir)
    want = drafter_config(spec, cfg)
    fields = EAGLE3_PRETRAINED_FIELDS if "eagle3" in (want.architecture, theirs.config.architecture) else PRETRAINED_FIELDS
    diffs = [(f, getattr(theirs.config, f), getattr(want, f)) for f in fields
             if getattr(theirs.config, f) != getattr(want, f)]
    if theirs.config.confidence_head and not want.confidence_head:
        diffs.append(("confidence_head", True, False))
    if diffs:
        key = {"target_layer_ids": "target.target_layer_ids",
               "eagle3_layer_ids": "target.target_layer_ids (first, middle and last)"}
        said = "; ".join(f"{f}: the export has {format_value(a)}, the config says {format_value(b)} (set "
                         f"{key.get(f, f'train.drafters.{name}.{f}')}={format_value(a)})" for f, a, b in diffs)
        raise ConfigError(f"train.drafters.{name}.pretrained_path: {spec.pretrained_path} is another drafter: {said}; "
                          "a cache of other target_layer_ids needs a new run_dir")
    state = {k: v.detach().contiguous() for k, v in theirs.state_dict().items()
             if k not in FROZEN_STATE}
    fresh = ["confidence_head"] if want.confidence_head and not theirs.config.confidence_head else []
    url = pretrained_init_url(cfg, name)
    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, save(state))
    return {"source": spec.pretrained_path, "init_url": url, "tensors": len(state), "fresh": fresh}


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


def head_digest(head) -> str:
    """SHA-256 (hex) of a confidence head's parameters as float32 bytes (``proj.weight`` then
    ``proj.bias``): which trained head a refitted one replaces, which head scored calibrate's gate rounds.
    ``head``: a drafter (its ``confidence_head.proj``) or a ``(weight [1, D], bias [1])`` pair. Take it
    on the float32 weights a checkpoint or a refit holds, before :func:`training.block_runner.eval_drafter`
    casts a drafter to the target's dtype on a GPU: the digest names the head, whatever dtype or device a
    stage then runs it in (a bf16 copy's digest differs)."""
    import hashlib

    weight, bias = (head.confidence_head.proj.weight, head.confidence_head.proj.bias) if hasattr(head, "confidence_head") else head
    h = hashlib.sha256()
    for t in (weight, bias):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def calibrated_head_url(cfg: RunConfig, name: str) -> str:
    """``<run_dir>/calibrate/<name>/confidence_head.safetensors``: the refitted head calibrate adopted."""
    return join(cfg.run_dir, "calibrate", name, "confidence_head.safetensors")


def save_calibrated_head(url: str, weight: torch.Tensor, bias: torch.Tensor, replaces: str) -> None:
    """Write a refitted head: ``proj.weight`` [1, D] and ``proj.bias`` [1] float32, with the
    :func:`head_digest` of the trained head it replaces in the metadata (``replaces``)."""
    from storage import write_tensors

    write_tensors(url, {"proj.weight": weight.float(), "proj.bias": bias.float()}, metadata={"replaces": replaces})


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
