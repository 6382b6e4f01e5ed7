"""Frozen-target prefill: capture the hidden states the drafter needs, batch by batch.

Pure PyTorch (no Ray): the cache stage's actors wrap :class:`TargetPrefill`.

Layer-id convention (docs/design.md section 2): id k is the output of decoder layer k (before the final
norm; equal to ``output_hidden_states[k + 1]`` for every layer but the last), id -1 is the
embedding output. Ids are strictly ascending; the final layer is refused, because HF's
``output_hidden_states[-1]`` is taken after the final norm and the drafter's context is pre-norm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pipeline.errors import ConfigError


def check_layer_ids(ids: Sequence[int], num_layers: int) -> None:
    """Raise ConfigError unless ``ids`` are strictly ascending, in ``[-1, num_layers - 2]``."""
    ids = list(ids)
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"target.target_layer_ids: must be strictly ascending (got {ids})")
    if ids[0] < -1 or ids[-1] > num_layers - 2:
        example = ",".join(str(i) for i in range(max(0, num_layers - 4), num_layers - 1))
        raise ConfigError(f"target.target_layer_ids: {ids} must lie in [-1, {num_layers - 2}] for this "
                          f"{num_layers}-layer target: the final layer {num_layers - 1} is refused (HF returns "
                          f"it after the final norm), e.g. target.target_layer_ids=[{example}]")


@dataclass(frozen=True)
class PrefillOutput:
    """One sample's captured states.

    ``features``: bf16 [T, L*H], the target layers in ``target_layer_ids`` order, concatenated.
    ``last_hidden``: bf16 [T_sup, H], final post-norm hidden state at positions t whose next
    token is supervised (``loss_mask[t + 1] == 1``), in increasing t.
    """

    features: torch.Tensor
    last_hidden: torch.Tensor


def next_supervised_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions t (int64) with ``loss_mask[t + 1] == 1``: their logits give a supervised token's
    target distribution."""
    return np.flatnonzero(np.asarray(loss_mask)[1:] == 1)


def length_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Length-aware batching: indices sorted by length, grouped so that a batch's padded size
    ``len(batch) * max(length)`` stays within ``max_tokens`` (a longer sample goes alone).

    Returns:
        Lists of indices into ``lengths``; every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur = [], []
    for i in order:  # ascending length: the newest sample sets the padded width
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class LayerTap:
    """Forward hooks that capture the target's layers at ``target_layer_ids`` and its final norm
    output on every forward of ``model`` (batched prefill, or verification steps with a KV cache).

    Raises:
        ConfigError: bad layer ids for this target.
    """

    def __init__(self, model: torch.nn.Module, target_layer_ids: Sequence[int]):
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.ids = list(target_layer_ids)
        check_layer_ids(self.ids, len(self.base.layers))
        self._captured: dict = {}
        for k in self.ids:
            module = self.base.embed_tokens if k == -1 else self.base.layers[k]
            module.register_forward_hook(self._hook(k))
        self.base.norm.register_forward_hook(self._hook("norm"))

    def _hook(self, key):
        def hook(_module, _inputs, output):
            self._captured[key] = output[0] if isinstance(output, tuple) else output
        return hook

    def features(self) -> torch.Tensor:
        """[B, T, L*H] the captured layers of the last forward, concatenated in id order."""
        return torch.cat([self._captured[k] for k in self.ids], dim=-1)

    def final(self) -> torch.Tensor:
        """[B, T, H] the final post-norm hidden state of the last forward."""
        return self._captured["norm"]


class TargetPrefill:
    """Runs the frozen target over batches and returns per-sample :class:`PrefillOutput`.

    Args:
        model: a HF ``*ForCausalLM`` (Qwen3 family) in eval mode; only its base model runs, the
            ``lm_head`` is never applied here (target distributions are recomputed at train time).
        target_layer_ids: see module docstring.

    Raises:
        ConfigError: bad layer ids for this target.
    """

    def __init__(self, model: torch.nn.Module, target_layer_ids: Sequence[int]):
        self.tap = LayerTap(model, target_layer_ids)
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def __call__(self, input_ids: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray]) -> list[PrefillOutput]:
        """Prefill one right-padded batch.

        Only the real tokens leave the device: on CUDA the real rows of the features [sum T_i, L*H]
        and the supervised rows of the final state [sum T_sup_i, H] are gathered on the device and
        copied once into pinned host memory (an asynchronous DMA); on the CPU the outputs are views
        of the batch's tensors, no copy. Padding rows are never copied.

        Args:
            input_ids: per sample int [T_i].
            loss_masks: per sample uint8 [T_i].

        Returns:
            One :class:`PrefillOutput` per sample, bf16 on the CPU, equal (up to float rounding of
            batched kernels) to a batch-1 forward: right padding never reaches real tokens under
            causal attention. On CUDA the outputs of a batch share one pinned buffer.
        """
        lengths = [len(x) for x in input_ids]
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        attn = torch.zeros(len(lengths), width, dtype=torch.long)
        sup = torch.zeros(len(lengths), width, dtype=torch.bool)
        for i, x in enumerate(input_ids):
            ids[i, : lengths[i]] = torch.as_tensor(np.asarray(x, dtype=np.int64))
            attn[i, : lengths[i]] = 1
            sup[i, torch.as_tensor(next_supervised_positions(loss_masks[i]))] = True
        self.tap.base(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False)
        feats, final = self.tap.features(), self.tap.final()
        num_sup = sup.sum(dim=1).tolist()
        if feats.device.type == "cpu":
            feats, final = feats.to(torch.bfloat16), final.to(torch.bfloat16)
            return [PrefillOutput(feats[i, :n], final[i][sup[i]]) for i, n in enumerate(lengths)]
        real, rows = real_rows(feats, final, attn.to(self.device).bool(), sup.to(self.device))
        real, rows = _to_host(real.to(torch.bfloat16)), _to_host(rows.to(torch.bfloat16))
        return [PrefillOutput(f, h) for f, h in zip(real.split(lengths), rows.split(num_sup))]


def real_rows(features: torch.Tensor, final: torch.Tensor, real: torch.Tensor,
              supervised: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a padded batch that leave the device, gathered on its device, samples in batch order.

    Args:
        features: [B, T_max, L*H] and final: [B, T_max, H], the captured states of a right-padded batch.
        real: bool [B, T_max], the real tokens; supervised: bool [B, T_max], positions t with
            ``loss_mask[t + 1] == 1``.
    Returns:
        (features of the real tokens [sum T_i, L*H], final state at the supervised positions
        [sum T_sup_i, H]), sample by sample, positions ascending (split them by T_i and T_sup_i).
    """
    return features[real], final[supervised]


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """One copy of device tensor ``x`` into pinned host memory (PyTorch's caching host allocator
    reuses the block), waited for before returning."""
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return out
