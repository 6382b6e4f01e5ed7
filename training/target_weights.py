"""The target's weights a drafter shares (``embed_tokens``, ``lm_head``), read straight from the
target's safetensors files without loading the model."""
from __future__ import annotations

from pathlib import Path

__all__ = ["TargetWeightsError", "load_shared_weights"]


class TargetWeightsError(FileNotFoundError):
    """The target folder holds no safetensors weights, or no embedding in them."""


def load_shared_weights(local_dir: str):
    """The target's ``embed_tokens`` and ``lm_head`` weights, read straight from its safetensors
    files (the rest of the model is not loaded). A tied ``lm_head`` returns the embedding.

    Returns:
        ``(embed [V, H], lm_head [V, H])`` tensors in the checkpoint's dtype.

    Raises:
        TargetWeightsError: no safetensors weights, or no embedding tensor in them.
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
        keys = [k for k in weight_map if k.endswith(suffix)]
        if not keys:
            return None
        with safe_open(root / weight_map[keys[0]], "pt") as f:
            return f.get_tensor(keys[0])

    embed = read("embed_tokens.weight")
    if embed is None:
        raise TargetWeightsError(f"{local_dir}: no '*embed_tokens.weight' tensor in the checkpoint")
    lm_head = read("lm_head.weight")
    return embed, embed if lm_head is None else lm_head
