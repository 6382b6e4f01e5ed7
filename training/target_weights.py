"""The target's weights a drafter shares (``embed_tokens``, ``lm_head``), read straight from the
target's safetensors files without loading the model."""
from __future__ import annotations

from pathlib import Path

__all__ = ["TargetWeightsError", "load_shared_weights", "load_layer_init"]


class TargetWeightsError(FileNotFoundError):
    """The target folder holds no safetensors weights, or no embedding in them."""


def _reader(local_dir: str):
    """``(read, weight_map)``: ``read(suffix)`` is the first tensor of the target's safetensors whose
    name is ``suffix`` or ends with ``"." + suffix`` (None when there is none), read on its own
    without loading the model; ``weight_map`` maps every tensor name to its file.

    Raises:
        TargetWeightsError: no ``model.safetensors`` nor ``model.safetensors.index.json``.
    """
    import json

    from safetensors import safe_open

    root = Path(local_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(root / "model.safetensors", "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise TargetWeightsError(f"{local_dir}: no model.safetensors(.index.json); the target must be "
                                  "saved with safetensors weights (save_pretrained does so)")

    def read(suffix: str):
        keys = [k for k in weight_map if k == suffix or k.endswith("." + suffix)]
        if not keys:
            return None
        with safe_open(root / weight_map[keys[0]], "pt") as f:
            return f.get_tensor(keys[0])

    return read, weight_map


def load_shared_weights(local_dir: str):
    """The target's ``embed_tokens`` and ``lm_head`` weights, read straight from its safetensors
    files (the rest of the model is not loaded). A tied ``lm_head`` returns the embedding.

    Returns:
        ``(embed [V, H], lm_head [V, H])`` tensors in the checkpoint's dtype.

    Raises:
        TargetWeightsError: no safetensors weights, or no embedding tensor in them.
    """
    read, _ = _reader(local_dir)
    embed = read("embed_tokens.weight")
    if embed is None:
        raise TargetWeightsError(f"{local_dir}: no '*embed_tokens.weight' tensor in the checkpoint")
    lm_head = read("lm_head.weight")
    return embed, embed if lm_head is None else lm_head


def load_layer_init(local_dir: str, layer: int):
    """What ``init: target`` copies into a drafter (:meth:`training.drafter.Drafter.init_from_target`):
    decoder layer ``layer``'s tensors and the final norm.

    Returns:
        ``(layer_state, final_norm)``: ``{name inside the layer: tensor}`` (e.g.
        ``self_attn.q_proj.weight``) and the ``[H]`` final RMSNorm weight, in the checkpoint's dtype.
    Raises:
        TargetWeightsError: the checkpoint has no such layer or no final norm.
    """
    read, weight_map = _reader(local_dir)
    prefix = f"layers.{layer}."
    names = sorted({k[k.index(prefix) + len(prefix):] for k in weight_map if f".{prefix}" in f".{k}"})
    final_norm = read("model.norm.weight")
    if not names or final_norm is None:
        raise TargetWeightsError(f"{local_dir}: no decoder layer {layer} or no final norm in the checkpoint, "
                                 "which init: target copies; use init: random")
    return {n: read(prefix + n) for n in names}, final_norm
