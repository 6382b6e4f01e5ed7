"""The export format contract: the directories that the serving and training tools load, written
and read back (the export stage, :mod:`pipeline.stages.export`, runs it on each trained drafter).

Two formats (``export.format``), same tensors, same drafter:

- ``native`` (default): vLLM's own layout (vLLM 0.32, ``vllm/model_executor/models/qwen3_dspark.py``
  and ``qwen3_dflash.py``), which z-lab ``dflash`` and SpecForge read too. ``config.json`` is the
  target's Qwen3 config with ``architectures`` ``["Qwen3DSparkModel"]`` (drafters with a Markov head)
  or ``["DFlashDraftModel"]`` (no sequential head), ``model_type: "qwen3"``, ``num_hidden_layers`` =
  draft layers, and no ``quantization_config`` / ``layer_types``. DFlash keys: ``dflash_config:
  {mask_token_id, target_layer_ids, sample_from_anchor}``. DSpark keys, top level (vLLM) and mirrored
  in ``dflash_config`` (SpecForge reads them there, with ``projector_type: "dspark"`` and its
  ``attention_mode``, ``gqa`` or ``mha``):
  ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ``enable_confidence_head``,
  ``confidence_head_with_markov``; top level only: ``sample_from_anchor`` (vLLM's DFlash speculator,
  which its DSpark one extends, refuses ``dflash_config.sample_from_anchor: true``) and
  ``confidence_temperatures`` (STS, one per position). Both layouts: ``enable_thinking``, the thinking mode the drafter was
  trained for (``data.render.enable_thinking``; null: the template's default), which serving
  requests should use (``chat_template_kwargs``).
- ``speculators``: the vllm-project/speculators 0.9 native format (``speculators_model_type``
  ``dflash`` / ``dspark``, ``speculators_version``, a ``speculators_config`` with the greedy proposal's
  ``speculative_tokens`` and the verifier, the drafter's Qwen3 config nested under
  ``transformer_layer_config``, ``aux_hidden_state_layer_ids``); vLLM loads it too.

``block_size`` is the slot count of a block, anchor included, in both formats: every tool reads it
so (vLLM's speculators configs: "only mask tokens predict, yielding block_size - 1 speculative
tokens" when ``sample_from_anchor`` is false). The product's ``block_size`` is gamma, the drafted
tokens: a DFlash drafter ``[anchor, mask x gamma]`` exports ``block_size = gamma + 1``, a DSpark one
``[anchor, mask x (gamma-1)]`` (``sample_from_anchor``) ``block_size = gamma``. vLLM's native DFlash
path takes the draft count from ``num_speculative_tokens`` instead: serve with ``gamma`` (the export
summary's ``num_speculative_tokens``).

``model.safetensors``: the names vLLM's loader expects, without a ``model.`` prefix (the loader adds
it). ``embed_tokens`` / ``lm_head`` are left out (the tools share the target's) unless they differ
from the target's; a reduced draft vocabulary ships ``lm_head`` [V_draft, H], ``d2t`` [V_draft] int64
offsets (``target = i + d2t[i]``) and ``t2d`` [V] bool (target token is drafted), as EAGLE-3 and
speculators store them (speculators needs ``t2d``; vLLM skips it).

``target_layer_ids`` convention (DeepSpec / DFlash, and this project's ``target.target_layer_ids``):
id k is the output of target decoder layer k (0-based), -1 the embedding output. vLLM captures
"aux hidden state" ``k + 1`` for it (``get_eagle3_aux_layers_from_config`` adds 1; aux state j is the
residual stream after j decoder layers, so aux 0 is the embedding output): the native format writes
the ids as they are, the speculators format writes ``aux_hidden_state_layer_ids = k + 1``.

Serving constraints checked here: vLLM's DFlash method always uses the ``[anchor, mask x gamma]``
layout (``sample_from_anchor=false``) and has no confidence head; its DSpark model has only the
vanilla Markov head. vLLM rejects unknown tensor names but never reports a missing one (it stays
uninitialised), so :func:`check_tensors` checks the key set and shapes derived from ``config.json``
itself, finiteness, and that no tensor was left untrained (judged on the trained weights and the
checkpoint's record of the fp32 master weights that moved, not on the bf16 copy alone).

Confidence: vLLM applies the raw ``sigmoid`` of the confidence head (no temperature). The calibrate
stage's global temperature ``T`` (``training.sts.fit_global_temperature``, the best transform that
raw sigmoid can express) is folded into the head, weight and bias divided by ``T``
(:func:`fold_confidence`), so vLLM's raw sigmoid is ``sigmoid(z / T)`` exactly; the per-position STS
temperatures stay a separate key, ``confidence_temperatures``, as the residual ``T_k / T`` for
runtimes that read it (``sigmoid(z_folded / (T_k / T)) = sigmoid(z / T_k)``). Reports from before
the global temperature fall back to folding only when all ``T_k`` agree within
``export.fold_temperature_tolerance``.
EAGLE-3 (``architecture: eagle3``, :mod:`training.eagle3`) has one format whatever ``export.format``: the
speculators ``eagle3`` one (:func:`eagle3_config`), which vLLM loads (``Eagle3LlamaForCausalLM``; serve it with
``speculative_config={"model": <export>, "num_speculative_tokens": gamma}``, the method read from the config)
and speculators too. Its tensors are vLLM's ``llama_eagle3`` names: ``fc`` [H, 3 H_target], ``norm``,
``layers.0.{self_attn.{q,k,v}_proj [*, 2H], self_attn.o_proj, mlp.*, input_layernorm, hidden_norm,
post_attention_layernorm}`` and ``lm_head`` [V_draft, H] even at the full vocabulary (speculators' ``Eagle3``
leaves a missing one uninitialised; vLLM shares it with the target's when equal, so serving holds one copy);
``embed_tokens`` shared with the target as for the other drafters.

:func:`load_export` reads every format back into the product's drafter (:func:`training.drafter.new_drafter`).
"""
from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from pipeline.errors import PipelineError
from storage import filesystem, join, read_json, write_json

__all__ = ["ExportError", "FORMATS", "DSPARK_ARCH", "DFLASH_ARCH", "EAGLE3_ARCH", "architecture", "eagle3_config", "native_config",
           "speculators_config", "export_config", "read_fields", "expected_tensors", "drafter_tensors",
           "check_tensors", "fold_confidence", "export_drafter", "load_export"]

FORMATS = ("native", "speculators")
DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"
EAGLE3_ARCH = "Eagle3LlamaForCausalLM"  # vLLM's class for a speculators eagle3 export with a Llama layer
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema the speculators format follows
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DROP_KEYS = ("quantization_config", "layer_types", "auto_map", "_name_or_path", "architectures",
              "torch_dtype")
_SHARED = ("embed_tokens.weight", "lm_head.weight")
_FROZEN = (*_SHARED, "d2t", "t2d")  # copied from the target / fixed before training: never "trained"


class ExportError(PipelineError):
    """The drafter cannot be exported as a complete vLLM checkpoint (message names the fix)."""


def architecture(config) -> str:
    """The vLLM architecture of a drafter: ``Qwen3DSparkModel`` with a Markov head, ``Eagle3LlamaForCausalLM``
    for an eagle3 drafter, else ``DFlashDraftModel``.

    Args:
        config: a :class:`training.drafter.DrafterConfig`.
    Raises:
        ExportError: a gated/RNN head (vLLM has the vanilla Markov head only), or a head-less drafter
            with ``sample_from_anchor=true`` (vLLM's DFlash drafts ``[anchor, mask x gamma]`` only).
    """
    if config.architecture == "eagle3":
        return EAGLE3_ARCH
    if config.markov_rank > 0:
        if config.head_type != "markov":
            raise ExportError(f"vLLM's {DSPARK_ARCH} has only the vanilla Markov head, this drafter has "
                              f"head={config.head_type!r}: train it with head=markov to serve it in vLLM")
        return DSPARK_ARCH
    if config.sample_from_anchor:
        raise ExportError("vLLM's DFlash method drafts [anchor, mask x gamma] (slots predict their own "
                          "positions); this drafter was trained with sample_from_anchor=true: retrain it "
                          "with sample_from_anchor=false, or give it a Markov head to export it as DSpark")
    return DFLASH_ARCH


def _dtype_name(target_config: Mapping[str, Any]) -> str:
    name = target_config.get("dtype") or target_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ExportError(f"target dtype {name!r} is not one of {sorted(_DTYPES)}; export a float checkpoint")
    return name


def _qwen3_config(model, target_config: Mapping[str, Any]) -> dict[str, Any]:
    """The drafter's own Qwen3 config: the target's, with the draft depth and no target-only keys."""
    cfg = {k: v for k, v in target_config.items() if k not in _DROP_KEYS}
    cfg.update(model_type="qwen3", num_hidden_layers=model.config.num_layers, tie_word_embeddings=False,
               use_sliding_window=False, dtype=_dtype_name(target_config))
    return cfg


def _confidence_keys(model, temperatures: Sequence[float] | None, folded: float | None) -> dict[str, Any]:
    """``confidence_temperatures`` (residual after a fold) and ``confidence_temperature_folded``."""
    if model.confidence_head is None or model.config.markov_rank == 0:
        return {}
    T = [1.0] * model.config.block_size if temperatures is None else [float(t) for t in temperatures]
    return {"confidence_temperatures": [t / folded for t in T] if folded else T,
            "confidence_temperature_folded": folded}


def native_config(model, target_config: Mapping[str, Any], temperatures: Sequence[float] | None = None,
                  folded: float | None = None) -> dict[str, Any]:
    """The drafter's ``config.json`` in the native format (vLLM, z-lab dflash, SpecForge; module docstring).

    Args:
        model: a :class:`training.drafter.Drafter`.
        target_config: the target's ``config.json`` as a dict (Qwen3).
        temperatures: per-position STS temperatures to record (``gamma`` floats), None for all 1.
        folded: the temperature folded into the confidence head, or None.
    Returns:
        a JSON-able dict; ``block_size`` is the slot count (``DrafterConfig.slots``).
    Raises:
        ExportError: as :func:`architecture`, or a target dtype that is not float32/bfloat16/float16.
    """
    c = model.config
    arch = architecture(c)
    cfg = _qwen3_config(model, target_config)
    ids = [int(i) for i in c.target_layer_ids]
    cfg.update(architectures=[arch], num_target_layers=int(target_config["num_hidden_layers"]),
               target_hidden_size=int(target_config["hidden_size"]), block_size=c.slots)
    if c.draft_vocab_size is not None:
        cfg["draft_vocab_size"] = int(c.draft_vocab_size)
    block = {"mask_token_id": int(c.mask_token_id), "target_layer_ids": ids,
             "sample_from_anchor": bool(c.sample_from_anchor)}
    if arch == DFLASH_ARCH:
        cfg["dflash_config"] = block
        return cfg
    has_conf = c.confidence_head
    block.update(markov_rank=int(c.markov_rank), enable_confidence_head=has_conf,
                 confidence_head_with_markov=has_conf, block_size=c.slots)
    cfg.update(block)
    gqa = int(cfg["num_key_value_heads"]) < int(cfg["num_attention_heads"])
    # SpecForge reads the DSpark keys from dflash_config; sample_from_anchor stays top-level only: vLLM's
    # DSpark speculator inherits the DFlash one, which refuses dflash_config.sample_from_anchor = true at
    # engine start (DFlash's anchor is the bonus token), and reads DSpark's from the top level
    mirror = {k: v for k, v in block.items() if k != "sample_from_anchor"}
    cfg["dflash_config"] = dict(mirror, projector_type="dspark", attention_mode="gqa" if gqa else "mha")
    cfg.update(_confidence_keys(model, temperatures, folded))
    return cfg


def speculators_config(model, target_config: Mapping[str, Any], temperatures: Sequence[float] | None = None,
                       folded: float | None = None, verifier: str | None = None) -> dict[str, Any]:
    """The drafter's ``config.json`` in the speculators 0.9 format (``DFlashSpeculatorConfig`` /
    ``DSparkSpeculatorConfig`` fields, written without the speculators package).

    Args:
        model, target_config, temperatures, folded: as :func:`native_config`.
        verifier: the target's name or path recorded as ``speculators_config.verifier.name_or_path``.
    Returns:
        a JSON-able dict. ``aux_hidden_state_layer_ids`` are ``target_layer_ids + 1`` (speculators counts
        the embedding output as 0); ``proposal_methods[0].speculative_tokens`` is gamma.
    Raises:
        ExportError: as :func:`native_config`.
    """
    c = model.config
    arch = architecture(c)
    algo = "dspark" if arch == DSPARK_ARCH else "dflash"
    V = int(target_config["vocab_size"])
    cfg = {"architectures": ["DSparkSpeculator" if algo == "dspark" else "DFlashSpeculator"],
           "speculators_model_type": algo, "speculators_version": SPECULATORS_VERSION,
           "speculators_config": {
               "algorithm": algo, "default_proposal_method": "greedy",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(c.block_size)}],
               "verifier": {"name_or_path": verifier, "architectures": list(target_config.get("architectures") or [])}},
           "transformer_layer_config": _qwen3_config(model, target_config),
           "draft_vocab_size": int(c.draft_vocab_size or V), "block_size": c.slots,
           "target_hidden_size": int(target_config["hidden_size"]),
           "aux_hidden_state_layer_ids": [int(i) + 1 for i in c.target_layer_ids],
           "mask_token_id": int(c.mask_token_id), "sample_from_anchor": bool(c.sample_from_anchor),
           # blocks attend bidirectionally, as trained: vLLM maps this key to dflash_config.causal for every
           # layer (false would run the drafter causally); speculators applies it to sliding-window layers only
           "sliding_window_non_causal": True, "dtype": _dtype_name(target_config)}
    if algo == "dspark":
        cfg.update(markov_rank=int(c.markov_rank), markov_head_type="vanilla",
                   enable_confidence_head=c.confidence_head, confidence_head_with_markov=c.confidence_head)
        cfg.update(_confidence_keys(model, temperatures, folded))
    return cfg


_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling",
               "rope_parameters", "initializer_range")


def eagle3_config(model, target_config: Mapping[str, Any], verifier: str | None = None) -> dict[str, Any]:
    """An eagle3 drafter's ``config.json``: the speculators 0.9 ``eagle3`` format (``Eagle3SpeculatorConfig``
    fields), which vLLM loads as ``Eagle3LlamaForCausalLM`` and speculators as ``Eagle3Speculator``.

    The decoder layer is described as a Llama layer (``transformer_layer_config.model_type = "llama"``: no
    qk-norm, as :class:`training.eagle3.Eagle3Layer`) with the target's width, heads, RoPE and vocabulary;
    ``norm_before_residual`` is false (the residual is the unnormed hidden input; vLLM's default when the key
    is absent is true, so it is written); ``eagle_aux_hidden_state_layer_ids`` are the fused layers
    (:attr:`training.drafter.DrafterConfig.eagle3_layer_ids`) + 1, vLLM's and speculators' count;
    ``speculative_tokens`` is gamma (the steps drafted per round).
    """
    c = model.config
    layer = {k: target_config[k] for k in _LLAMA_KEYS if k in target_config}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1, attention_bias=False,
                 mlp_bias=False, tie_word_embeddings=False, dtype=_dtype_name(target_config))
    V = int(target_config["vocab_size"])
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(c.block_size)}],
                "verifier": {"name_or_path": verifier, "architectures": list(target_config.get("architectures") or [])}},
            "transformer_layer_config": layer, "draft_vocab_size": int(c.draft_vocab_size or V),
            "norm_before_residual": False, "target_hidden_size": int(target_config["hidden_size"]),
            "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in c.eagle3_layer_ids],
            "dtype": _dtype_name(target_config)}


def export_config(fmt: str, model, target_config: Mapping[str, Any], temperatures: Sequence[float] | None = None,
                  folded: float | None = None, verifier: str | None = None) -> dict[str, Any]:
    """``config.json`` of ``model`` in format ``fmt`` (one of :data:`FORMATS`).

    Raises:
        ExportError: an unknown format (names the valid ones), or as :func:`native_config`.
    """
    if fmt in FORMATS and model.config.architecture == "eagle3":
        return eagle3_config(model, target_config, verifier)  # the one format vLLM and speculators read for it
    if fmt == "native":
        return native_config(model, target_config, temperatures, folded)
    if fmt == "speculators":
        return speculators_config(model, target_config, temperatures, folded, verifier)
    raise ExportError(f"export.format={fmt!r} is not one of {list(FORMATS)}")


def read_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The drafter described by an exported ``config.json`` of either format, in the product's terms.

    Returns:
        ``{"format", "architecture", "qwen3" (the draft Qwen3 config dict), "target_layer_ids"
        (product convention), "mask_token_id", "slots", "block_size" (gamma), "sample_from_anchor",
        "markov_rank", "confidence_head", "confidence_with_markov", "vocab_size", "draft_vocab_size",
        "target_hidden_size", "dtype"}``.
    Raises:
        ExportError: an architecture / speculators model type other than the exported ones.
    """
    if config.get("speculators_model_type") == "eagle3":
        layer = dict(config["transformer_layer_config"])
        V = int(layer["vocab_size"])
        Vd = int(config.get("draft_vocab_size") or V)
        gamma = int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
        return {"format": "speculators", "architecture": EAGLE3_ARCH, "qwen3": layer,
                "target_layer_ids": [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]],
                "mask_token_id": 0, "slots": gamma, "block_size": gamma, "sample_from_anchor": True, "markov_rank": 0,
                "confidence_head": False, "confidence_with_markov": False, "vocab_size": V,
                "draft_vocab_size": None if Vd == V else Vd,
                "target_hidden_size": int(config.get("target_hidden_size") or layer["hidden_size"]),
                "dtype": config.get("dtype") or layer.get("dtype")}
    if "speculators_model_type" in config:
        algo = config["speculators_model_type"]
        if algo not in ("dflash", "dspark"):
            raise ExportError(f"speculators_model_type {algo!r} is not dflash, dspark or eagle3")
        qwen3 = dict(config["transformer_layer_config"])
        arch = DSPARK_ARCH if algo == "dspark" else DFLASH_ARCH
        ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
        top, fmt = config, "speculators"
        dtype = config.get("dtype") or qwen3.get("dtype")
    else:
        arch = config["architectures"][0]
        if arch not in (DSPARK_ARCH, DFLASH_ARCH):
            raise ExportError(f"unknown drafter architecture {arch!r}; expected {DSPARK_ARCH} or {DFLASH_ARCH}")
        qwen3, fmt, dtype = dict(config), "native", config["dtype"]
        top = config["dflash_config"] if arch == DFLASH_ARCH else config
        ids = list(top["target_layer_ids"])
    dspark = arch == DSPARK_ARCH
    anchor = bool(top.get("sample_from_anchor", False))
    slots, V = int(config["block_size"]), int(qwen3["vocab_size"])
    Vd = int(config.get("draft_vocab_size") or V)
    conf = dspark and bool(top.get("enable_confidence_head"))
    return {"format": fmt, "architecture": arch, "qwen3": qwen3, "target_layer_ids": ids,
            "mask_token_id": int(top["mask_token_id"]), "slots": slots,
            "block_size": slots if anchor else slots - 1, "sample_from_anchor": anchor,
            "markov_rank": int(top["markov_rank"]) if dspark else 0, "confidence_head": conf,
            "confidence_with_markov": conf and bool(top.get("confidence_head_with_markov")),
            "vocab_size": V, "draft_vocab_size": None if Vd == V else Vd,
            "target_hidden_size": int(config.get("target_hidden_size") or qwen3["hidden_size"]), "dtype": dtype}


def expected_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors the loaders fill for a drafter ``config.json`` (either format): name -> (shape, dtype).

    Derived from the config alone (Qwen3 attention/MLP shapes; ``fc`` [H, len(ids) * H_target];
    Markov ``markov_w1`` [V, r] and ``markov_w2`` [V_draft, r]; confidence ``proj`` [1, H + r] and
    bias [1], float32; reduced vocabulary: ``lm_head`` [V_draft, H], ``d2t`` [V_draft] int64 and
    ``t2d`` [V] bool).

    Raises:
        ExportError: an architecture other than the two exported ones.
    """
    f = read_fields(config)
    q = f["qwen3"]
    dt = _DTYPES[f["dtype"]]
    H, n_h, n_kv = q["hidden_size"], q["num_attention_heads"], q["num_key_value_heads"]
    hd = q.get("head_dim") or H // n_h
    inter, V = q["intermediate_size"], f["vocab_size"]
    Vd = f["draft_vocab_size"] or V
    out = {"fc.weight": ((H, len(f["target_layer_ids"]) * f["target_hidden_size"]), dt),
           "hidden_norm.weight": ((H,), dt), "norm.weight": ((H,), dt)}
    if f["architecture"] == EAGLE3_ARCH:  # one layer, attention over [embeds ; hidden] (2H), no qk-norm
        del out["hidden_norm.weight"]
        shapes = {"self_attn.q_proj.weight": (n_h * hd, 2 * H), "self_attn.k_proj.weight": (n_kv * hd, 2 * H),
                  "self_attn.v_proj.weight": (n_kv * hd, 2 * H), "self_attn.o_proj.weight": (H, n_h * hd),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                  "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,), "hidden_norm.weight": (H,),
                  "post_attention_layernorm.weight": (H,)}
        out.update({"layers.0." + k: (s, dt) for k, s in shapes.items()})
        out["lm_head.weight"] = ((Vd, H), dt)  # always: speculators' Eagle3 does not take a missing one from the verifier
    for i in range(q["num_hidden_layers"] if f["architecture"] != EAGLE3_ARCH else 0):
        p = f"layers.{i}."
        shapes = {"self_attn.q_proj.weight": (n_h * hd, H), "self_attn.k_proj.weight": (n_kv * hd, H),
                  "self_attn.v_proj.weight": (n_kv * hd, H), "self_attn.o_proj.weight": (H, n_h * hd),
                  "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                  "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,),
                  "post_attention_layernorm.weight": (H,)}
        if q.get("attention_bias"):
            shapes.update({f"self_attn.{x}_proj.bias": (s,) for x, s in
                           (("q", n_h * hd), ("k", n_kv * hd), ("v", n_kv * hd), ("o", H))})
        out.update({p + k: (s, dt) for k, s in shapes.items()})
    if f["markov_rank"]:
        r = f["markov_rank"]
        out["markov_head.markov_w1.weight"] = ((V, r), dt)
        out["markov_head.markov_w2.weight"] = ((Vd, r), dt)
    if f["confidence_head"]:
        width = H + (f["markov_rank"] if f["confidence_with_markov"] else 0)
        out["confidence_head.proj.weight"] = ((1, width), torch.float32)
        out["confidence_head.proj.bias"] = ((1,), torch.float32)
    if Vd != V:
        out["lm_head.weight"] = ((Vd, H), dt)
        out["d2t"] = ((Vd,), torch.int64)
        out["t2d"] = ((V,), torch.bool)
    return out


def drafter_tensors(model, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                    target_embed: torch.Tensor | None = None, target_lm_head: torch.Tensor | None = None
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The drafter's tensors under vLLM's names, cast to the expected dtypes.

    ``embed_tokens`` / ``lm_head`` are kept only where the config expects them (reduced vocabulary) or
    where they differ from the given target tensors; tensors vLLM has no slot for (a DFlash
    drafter's confidence head, ``target_lm_head``) are dropped and named in the second result. A
    reduced vocabulary adds ``t2d`` [V] bool, True at the drafted target ids (the inverse of ``d2t``).

    Returns:
        ``(tensors, dropped)``: name -> contiguous CPU tensor, and the dropped names.
    """
    from training.draft_vocab import target_to_draft_ids

    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "target_lm_head"}
    targets = {"embed_tokens.weight": target_embed, "lm_head.weight": target_lm_head}
    backbone_dtype = expected["norm.weight"][1]
    tensors, dropped = {}, []
    for name, t in state.items():
        if name in _SHARED and name not in expected:
            ref = targets[name]
            if ref is None or (ref.shape == t.shape and torch.equal(ref.to(t.dtype), t)):
                continue
        elif name not in expected:
            dropped.append(name)
            continue
        dtype = expected[name][1] if name in expected else backbone_dtype
        tensors[name] = t.to(dtype).contiguous()
    if "t2d" in expected:
        tensors["t2d"] = target_to_draft_ids(model.draft_to_target.cpu(), expected["t2d"][0][0]) >= 0
    return tensors, dropped


def _init_constant(name: str, t: torch.Tensor) -> bool:
    """True if ``t`` still holds the constant it is initialised to (norms 1, biases 0, ``markov_w2`` 0)."""
    if name.endswith("norm.weight"):
        return bool((t == 1).all())
    if name.endswith(".bias") or name == "markov_head.markov_w2.weight":
        return bool((t == 0).all())
    return False


def _untrained(name: str, w: torch.Tensor, initial: Mapping[str, torch.Tensor] | None) -> bool:
    """True if the trained weight ``w`` still holds its init constant or, when given, ``initial[name]``."""
    return _init_constant(name, w) or (initial is not None and name in initial
                                       and torch.equal(initial[name].to(w.dtype), w))


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  initial: Mapping[str, torch.Tensor] | None = None, *,
                  weights: Mapping[str, torch.Tensor] | None = None, master_ahead: Collection[str] = ()) -> None:
    """Refuse an incomplete or untrained checkpoint before vLLM silently loads it.

    Checks: the key set equals ``expected`` (``embed_tokens`` / ``lm_head`` may be extra: a drafter
    whose own copies differ from the target's), shapes and dtypes match, floating tensors are finite,
    and no tensor was left untrained: its trained weight (``weights``, the drafter's own state before
    the cast to the export dtype; default ``tensors``) still holds its init constant (norm weights
    all 1, biases all 0, ``markov_w2`` all 0, as ``training.drafter.Drafter._init_trainable``) or, when
    ``initial`` is given, exactly the tensor of a freshly initialised drafter with the training seed,
    in the training dtype, and its name is not in ``master_ahead``. ``master_ahead`` is the
    checkpoint's record of the tensors whose fp32 master weights moved while their stored bf16 copy
    did not (``training.loop.master_ahead``): a short bf16 run moves a norm weight at 1.0 by less than
    bf16's spacing there (2**-7), so the stored weights alone would call it untrained.

    Raises:
        ExportError: listing every problem found.
    """
    weights = tensors if weights is None else weights
    problems = [f"missing {k}" for k in sorted(set(expected) - set(tensors))]
    problems += [f"unexpected {k} (vLLM rejects unknown names)" for k in sorted(set(tensors) - set(expected))
                 if k not in _SHARED]
    for name, t in sorted(tensors.items()):
        if name in expected and (tuple(t.shape), t.dtype) != expected[name]:
            problems.append(f"{name} is {tuple(t.shape)} {t.dtype}, expected {expected[name][0]} {expected[name][1]}")
        elif t.is_floating_point() and not torch.isfinite(t).all():
            problems.append(f"{name} holds NaN/inf")
        elif name not in _FROZEN and name not in master_ahead and _untrained(name, weights.get(name, t), initial):
            problems.append(f"{name} still holds its initial value (never trained)")
    if problems:
        raise ExportError("the drafter does not make a complete vLLM checkpoint: " + "; ".join(problems)
                          + ". Train it (+stage=train) and export the newest checkpoint; a missing tensor "
                          "would load as uninitialised memory in vLLM")


def fold_confidence(tensors: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
    """Fold one STS temperature into the confidence head: ``sigmoid((w^T x + b) / T)`` becomes the
    head's raw sigmoid by dividing ``proj.weight`` and ``proj.bias`` by ``T`` (DSpark sec. 3.2.1).

    Returns:
        a new dict (other tensors shared). Raises ExportError if ``T`` is not finite and > 0.
    """
    if not (0 < temperature < float("inf")):
        raise ExportError(f"cannot fold temperature {temperature}: it must be finite and > 0")
    out = dict(tensors)
    for k in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
        out[k] = (tensors[k].double() / temperature).to(tensors[k].dtype)
    return out


def _write(out_url: str, config: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> int:
    from safetensors.torch import save

    data = save(dict(tensors), metadata={"format": "pt"})
    fs, path = filesystem(join(out_url, "model.safetensors"))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)
    write_json(join(out_url, "config.json"), config)  # last: a config.json means a complete export
    return len(data)


def export_drafter(model, target_dir: str, out_url: str, *, temperatures: Sequence[float] | None = None,
                   global_temperature: float | None = None, fold_tolerance: float | None = None,
                   initial: Mapping[str, torch.Tensor] | None = None, master_ahead: Collection[str] = (),
                   fmt: str = "native", verifier: str | None = None,
                   enable_thinking: bool | None = None) -> dict[str, Any]:
    """Write ``config.json`` + ``model.safetensors`` of one drafter in format ``fmt`` (module docstring).

    Args:
        model: a trained :class:`training.drafter.Drafter`.
        target_dir: local target directory (its ``config.json``, ``embed_tokens``, ``lm_head``).
        out_url: destination folder, any fsspec URL.
        temperatures: STS temperatures [gamma] (``pipeline.stages.calibrate``), or None (uncalibrated).
        global_temperature: the one temperature to fold into the confidence head (module docstring).
        fold_tolerance: without ``global_temperature``, fold the geometric mean of ``temperatures``
            when ``max(T)/min(T) - 1 <= fold_tolerance``; None never folds.
        initial: the state dict of a freshly initialised drafter with the training seed, in the
            training dtype (see :func:`check_tensors`); None checks the init constants only.
        master_ahead: the checkpoint's tensors whose fp32 master weights moved past their stored bf16
            weights (its ``master_ahead`` record; :func:`check_tensors`): trained, whatever they hold.
        fmt: one of :data:`FORMATS`. verifier: the target's name or path for the speculators format
            (default ``target_dir``).
        enable_thinking: the thinking mode the drafter was trained for (``data.render.enable_thinking``;
            None: the template's default), recorded as ``enable_thinking`` in ``config.json``.
    Returns:
        ``{"format", "architecture" (vLLM's), "num_speculative_tokens" (gamma), "block_size" (slots),
        "num_tensors", "bytes", "dropped", "confidence": "none" | "uncalibrated" | "folded" |
        "config", "folded_temperature", "confidence_temperatures"}``.
    Raises:
        ExportError: not servable by vLLM (:func:`architecture`), an unknown format, incomplete or
            untrained (:func:`check_tensors`), or temperatures of the wrong length.
    """
    from training.target_weights import load_shared_weights
    from training.sts import foldable_temperature

    with open(f"{target_dir}/config.json") as f:
        target_config = json.load(f)
    gamma = model.config.block_size
    if temperatures is not None and len(temperatures) != gamma:
        raise ExportError(f"got {len(temperatures)} temperatures for block size {gamma}: rerun +stage=calibrate")
    folded = None
    if model.confidence_head is not None and global_temperature is not None:
        folded = float(global_temperature)
    elif temperatures is not None and fold_tolerance is not None and model.confidence_head is not None:
        folded = foldable_temperature(temperatures, rtol=fold_tolerance)
    config = export_config(fmt, model, target_config, temperatures, folded, verifier or target_dir)
    config["enable_thinking"] = enable_thinking  # which prompts the drafter was trained for
    expected = expected_tensors(config)
    embed, lm_head = load_shared_weights(target_dir)
    tensors, dropped = drafter_tensors(model, expected, embed, lm_head)
    init = None if initial is None else {k: v for k, v in initial.items() if k in expected}
    check_tensors(tensors, expected, init, weights={k: v.detach().cpu() for k, v in model.state_dict().items()},
                  master_ahead=master_ahead)
    arch = architecture(model.config)
    if folded is not None and arch == DSPARK_ARCH:
        tensors = fold_confidence(tensors, folded)
    size = _write(out_url, config, tensors)
    has_conf = "confidence_temperatures" in config
    mode = ("none" if not has_conf else "uncalibrated" if temperatures is None
            else "folded" if folded is not None else "config")
    fmt = "speculators" if arch == EAGLE3_ARCH else fmt
    return {"format": fmt, "architecture": arch, "num_speculative_tokens": gamma, "block_size": config.get("block_size", gamma),
            "num_tensors": len(tensors), "bytes": size,
            "dropped": dropped, "confidence": mode, "folded_temperature": folded,
            "confidence_temperatures": config.get("confidence_temperatures"), "enable_thinking": enable_thinking}


def load_export(url: str, target_dir: str):
    """Read an export of either format back into the product's drafter.

    Builds a :class:`training.drafter.Drafter` from ``config.json`` alone (:func:`read_fields`: gamma
    from the slot count and layout) on the target's frozen ``embed_tokens`` / ``lm_head``, and loads
    every tensor of ``model.safetensors`` into it. The confidence head is the exported one (folded
    when ``confidence_temperature_folded`` is set).

    Args:
        url: the export folder (any fsspec URL). target_dir: the local target it was trained on.
    Returns:
        the drafter in eval mode, float32 as trained where the export is float32.
    Raises:
        ExportError: an incomplete export (:func:`check_tensors`), a tensor the drafter has no slot
            for, or a ``t2d`` that is not the inverse of ``d2t``.
    """
    from safetensors.torch import load
    from transformers import Qwen3Config

    from training.target_weights import load_shared_weights
    from training.draft_vocab import target_to_draft_ids
    from training.drafter import DrafterConfig, new_drafter

    config = read_json(join(url, "config.json"))
    fs, path = filesystem(join(url, "model.safetensors"))
    tensors = load(fs.cat_file(path))
    expected = expected_tensors(config)
    check_tensors(tensors, expected)
    f = read_fields(config)
    dc = DrafterConfig(target_layer_ids=f["target_layer_ids"], mask_token_id=f["mask_token_id"],
                       architecture="eagle3" if f["architecture"] == EAGLE3_ARCH else "dflash",
                       num_layers=f["qwen3"]["num_hidden_layers"], block_size=f["block_size"],
                       sample_from_anchor=f["sample_from_anchor"], markov_rank=f["markov_rank"],
                       confidence_head=f["confidence_head"], draft_vocab_size=f["draft_vocab_size"])
    with open(f"{target_dir}/config.json") as fh:
        target_config = Qwen3Config(**json.load(fh))
    embed, lm_head = load_shared_weights(target_dir)
    model = new_drafter(dc, target_config, embed, lm_head, tensors.get("d2t"))
    if "t2d" in tensors and not torch.equal(
            tensors["t2d"], target_to_draft_ids(model.draft_to_target, f["vocab_size"]) >= 0):
        raise ExportError(f"{url}: t2d is not the inverse of d2t; re-export the drafter")
    state = {k: v for k, v in tensors.items() if k != "t2d"}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = sorted(set(missing) - {*_SHARED, "target_lm_head"})
    if missing or unexpected:
        raise ExportError(f"{url}: the drafter has no slot for {unexpected} and nothing for {missing}")
    return model.eval()
