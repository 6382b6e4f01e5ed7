"""Export stage: write each trained drafter as a directory that vLLM loads as a speculative drafter.

Layout (vLLM 0.32, ``vllm/model_executor/models/qwen3_dspark.py`` and ``qwen3_dflash.py``):

- ``config.json``: the target's Qwen3 config with ``architectures`` ``["Qwen3DSparkModel"]`` (drafters
  with a Markov head) or ``["DFlashDraftModel"]`` (no sequential head), ``model_type: "qwen3"``,
  ``num_hidden_layers`` = draft layers, and no ``quantization_config`` / ``layer_types``.
  DSpark keys: ``target_layer_ids``, ``mask_token_id``, ``markov_rank``, ``enable_confidence_head``,
  ``confidence_head_with_markov``, ``block_size``, ``sample_from_anchor``, ``confidence_temperatures``
  (STS, one per position). DFlash keys: ``dflash_config: {mask_token_id, target_layer_ids}``.
- ``model.safetensors``: the names vLLM's loader expects, without a ``model.`` prefix (the loader
  adds it). ``embed_tokens`` / ``lm_head`` are left out (vLLM shares the target's) unless they differ
  from the target's; ``lm_head`` and ``d2t`` ship with a reduced draft vocabulary.

``target_layer_ids`` convention (DeepSpec / DFlash, and this project's ``target.target_layer_ids``):
id k is the output of target decoder layer k (0-based), -1 the embedding output. vLLM captures
"aux hidden state" ``k + 1`` for it (``get_eagle3_aux_layers_from_config`` adds 1; aux state j is the
residual stream after j decoder layers, so aux 0 is the embedding output): the ids are written as
they are.

Serving constraints checked here: vLLM's DFlash method always uses the ``[anchor, mask x gamma]``
layout (``sample_from_anchor=false``) and has no confidence head; its DSpark model has only the
vanilla Markov head. vLLM rejects unknown tensor names but never reports a missing one (it stays
uninitialised), so :func:`check_tensors` checks the key set and shapes derived from ``config.json``
itself, finiteness, and that no tensor still holds its initial value.

Confidence: vLLM applies the raw ``sigmoid`` of the confidence head (no temperature). The calibrate
stage's global temperature ``T`` (``training.sts.fit_global_temperature``, the best transform that
raw sigmoid can express) is folded into the head, weight and bias divided by ``T``
(:func:`fold_confidence`), so vLLM's raw sigmoid is ``sigmoid(z / T)`` exactly; the per-position STS
temperatures stay a separate key, ``confidence_temperatures``, as the residual ``T_k / T`` for
runtimes that read it (``sigmoid(z_folded / (T_k / T)) = sigmoid(z / T_k)``). Reports from before
the global temperature fall back to folding only when all ``T_k`` agree within
``export.fold_temperature_tolerance``.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.errors import PipelineError
from pipeline.storage import filesystem, join, read_json, write_json

log = logging.getLogger("pipeline.export")

__all__ = ["ExportError", "DSPARK_ARCH", "DFLASH_ARCH", "architecture", "vllm_config", "expected_tensors",
           "drafter_tensors", "check_tensors", "fold_confidence", "export_drafter", "run_export"]

DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DROP_KEYS = ("quantization_config", "layer_types", "auto_map", "_name_or_path", "architectures",
              "torch_dtype")
_SHARED = ("embed_tokens.weight", "lm_head.weight")
_FROZEN = (*_SHARED, "d2t")  # copied from the target / fixed before training: never "trained"


class ExportError(PipelineError):
    """The drafter cannot be exported as a complete vLLM checkpoint (message names the fix)."""


def architecture(config) -> str:
    """The vLLM architecture of a drafter: ``Qwen3DSparkModel`` with a Markov head, else ``DFlashDraftModel``.

    Args:
        config: a :class:`training.drafter.DrafterConfig`.
    Raises:
        ExportError: a gated/RNN head (vLLM has the vanilla Markov head only), or a head-less drafter
            with ``sample_from_anchor=true`` (vLLM's DFlash drafts ``[anchor, mask x gamma]`` only).
    """
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


def vllm_config(model, target_config: Mapping[str, Any], temperatures: Sequence[float] | None = None,
                folded: float | None = None) -> dict[str, Any]:
    """The drafter's ``config.json`` for vLLM (see the module docstring for the keys).

    Args:
        model: a :class:`training.drafter.Drafter`.
        target_config: the target's ``config.json`` as a dict (Qwen3).
        temperatures: per-position STS temperatures to record (``gamma`` floats), None for all 1.
        folded: the temperature folded into the confidence head, or None.
    Returns:
        a JSON-able dict.
    Raises:
        ExportError: as :func:`architecture`, or a target dtype that is not float32/bfloat16/float16.
    """
    c = model.config
    arch = architecture(c)
    cfg = {k: v for k, v in target_config.items() if k not in _DROP_KEYS}
    ids = [int(i) for i in c.target_layer_ids]
    cfg.update(architectures=[arch], model_type="qwen3", num_hidden_layers=c.num_layers,
               num_target_layers=int(target_config["num_hidden_layers"]),
               target_hidden_size=int(target_config["hidden_size"]), tie_word_embeddings=False,
               use_sliding_window=False, block_size=c.block_size, dtype=_dtype_name(target_config))
    if c.draft_vocab_size is not None:
        cfg["draft_vocab_size"] = int(c.draft_vocab_size)
    if arch == DFLASH_ARCH:
        cfg["dflash_config"] = {"mask_token_id": int(c.mask_token_id), "target_layer_ids": ids}
        return cfg
    has_conf = c.confidence_head
    cfg.update(target_layer_ids=ids, mask_token_id=int(c.mask_token_id), markov_rank=int(c.markov_rank),
               enable_confidence_head=has_conf, confidence_head_with_markov=has_conf,
               sample_from_anchor=bool(c.sample_from_anchor))
    if has_conf:
        T = [1.0] * c.block_size if temperatures is None else [float(t) for t in temperatures]
        cfg["confidence_temperatures"] = [t / folded for t in T] if folded else T
        cfg["confidence_temperature_folded"] = folded
    return cfg


def expected_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors vLLM's loader fills for a drafter ``config.json``: name -> (shape, dtype).

    Derived from the config alone (Qwen3 attention/MLP shapes; ``fc`` [H, len(ids) * H_target];
    Markov ``markov_w1`` [V, r] and ``markov_w2`` [V_draft, r]; confidence ``proj`` [1, H + r] and
    bias [1], float32; reduced vocabulary: ``lm_head`` [V_draft, H] and ``d2t`` [V_draft] int64).

    Raises:
        ExportError: an architecture other than the two exported ones.
    """
    arch = config["architectures"][0]
    if arch not in (DSPARK_ARCH, DFLASH_ARCH):
        raise ExportError(f"unknown drafter architecture {arch!r}; expected {DSPARK_ARCH} or {DFLASH_ARCH}")
    dt = _DTYPES[config["dtype"]]
    H, n_h, n_kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or H // n_h
    inter, V = config["intermediate_size"], config["vocab_size"]
    Vd = config.get("draft_vocab_size") or V
    ids = config["dflash_config"]["target_layer_ids"] if arch == DFLASH_ARCH else config["target_layer_ids"]
    out = {"fc.weight": ((H, len(ids) * config["target_hidden_size"]), dt), "hidden_norm.weight": ((H,), dt),
           "norm.weight": ((H,), dt)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes = {"self_attn.q_proj.weight": (n_h * hd, H), "self_attn.k_proj.weight": (n_kv * hd, H),
                  "self_attn.v_proj.weight": (n_kv * hd, H), "self_attn.o_proj.weight": (H, n_h * hd),
                  "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                  "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,),
                  "post_attention_layernorm.weight": (H,)}
        if config.get("attention_bias"):
            shapes.update({f"self_attn.{x}_proj.bias": (s,) for x, s in
                           (("q", n_h * hd), ("k", n_kv * hd), ("v", n_kv * hd), ("o", H))})
        out.update({p + k: (s, dt) for k, s in shapes.items()})
    if arch == DSPARK_ARCH:
        r = config["markov_rank"]
        out["markov_head.markov_w1.weight"] = ((V, r), dt)
        out["markov_head.markov_w2.weight"] = ((Vd, r), dt)
        if config.get("enable_confidence_head"):
            width = H + (r if config.get("confidence_head_with_markov") else 0)
            out["confidence_head.proj.weight"] = ((1, width), torch.float32)
            out["confidence_head.proj.bias"] = ((1,), torch.float32)
    if Vd != V:
        out["lm_head.weight"] = ((Vd, H), dt)
        out["d2t"] = ((Vd,), torch.int64)
    return out


def drafter_tensors(model, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                    target_embed: torch.Tensor | None = None, target_lm_head: torch.Tensor | None = None
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The drafter's tensors under vLLM's names, cast to the expected dtypes.

    ``embed_tokens`` / ``lm_head`` are kept only where the config expects them (reduced vocabulary) or
    where they differ from the given target tensors; tensors vLLM has no slot for (a DFlash
    drafter's confidence head, ``target_lm_head``) are dropped and named in the second result.

    Returns:
        ``(tensors, dropped)``: name -> contiguous CPU tensor, and the dropped names.
    """
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
    return tensors, dropped


def _init_constant(name: str, t: torch.Tensor) -> bool:
    """True if ``t`` still holds the constant it is initialised to (norms 1, biases 0, ``markov_w2`` 0)."""
    if name.endswith("norm.weight"):
        return bool((t == 1).all())
    if name.endswith(".bias") or name == "markov_head.markov_w2.weight":
        return bool((t == 0).all())
    return False


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  initial: Mapping[str, torch.Tensor] | None = None) -> None:
    """Refuse an incomplete or untrained checkpoint before vLLM silently loads it.

    Checks: the key set equals ``expected`` (``embed_tokens`` / ``lm_head`` may be extra: a drafter
    whose own copies differ from the target's), shapes and dtypes match, floating tensors are finite,
    and no tensor still holds its initial value: neither its init constant (norm weights all 1, biases
    all 0, ``markov_w2`` all 0, as ``training.drafter.Drafter._init_trainable``) nor, when ``initial``
    is given, exactly the tensor of a freshly initialised drafter with the training seed.

    Raises:
        ExportError: listing every problem found.
    """
    problems = [f"missing {k}" for k in sorted(set(expected) - set(tensors))]
    problems += [f"unexpected {k} (vLLM rejects unknown names)" for k in sorted(set(tensors) - set(expected))
                 if k not in _SHARED]
    for name, t in sorted(tensors.items()):
        if name in expected and (tuple(t.shape), t.dtype) != expected[name]:
            problems.append(f"{name} is {tuple(t.shape)} {t.dtype}, expected {expected[name][0]} {expected[name][1]}")
        elif t.is_floating_point() and not torch.isfinite(t).all():
            problems.append(f"{name} holds NaN/inf")
        elif name not in _FROZEN and (_init_constant(name, t) or (
                initial is not None and name in initial and torch.equal(initial[name].to(t.dtype), t))):
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
                   initial: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Write ``config.json`` + ``model.safetensors`` of one drafter for vLLM (module docstring).

    Args:
        model: a trained :class:`training.drafter.Drafter`.
        target_dir: local target directory (its ``config.json``, ``embed_tokens``, ``lm_head``).
        out_url: destination folder, any fsspec URL.
        temperatures: STS temperatures [gamma] (``pipeline.calibrate``), or None (uncalibrated).
        global_temperature: the one temperature to fold into the confidence head (module docstring).
        fold_tolerance: without ``global_temperature``, fold the geometric mean of ``temperatures``
            when ``max(T)/min(T) - 1 <= fold_tolerance``; None never folds.
        initial: the state dict of a freshly initialised drafter with the training seed (see
            :func:`check_tensors`); None checks the init constants only.
    Returns:
        ``{"architecture", "num_tensors", "bytes", "dropped", "confidence": "none" | "uncalibrated"
        | "folded" | "config", "folded_temperature", "confidence_temperatures"}``.
    Raises:
        ExportError: not servable by vLLM (:func:`architecture`), incomplete or untrained
            (:func:`check_tensors`), or temperatures of the wrong length.
    """
    from pipeline.target import load_shared_weights
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
    config = vllm_config(model, target_config, temperatures, folded)
    expected = expected_tensors(config)
    embed, lm_head = load_shared_weights(target_dir)
    tensors, dropped = drafter_tensors(model, expected, embed, lm_head)
    init = None if initial is None else {k: v for k, v in initial.items() if k in expected}
    check_tensors(tensors, expected, init)
    if folded is not None and config["architectures"][0] == DSPARK_ARCH:
        tensors = fold_confidence(tensors, folded)
    size = _write(out_url, config, tensors)
    has_conf = "confidence_temperatures" in config
    mode = ("none" if not has_conf else "uncalibrated" if temperatures is None
            else "folded" if folded is not None else "config")
    return {"architecture": config["architectures"][0], "num_tensors": len(tensors), "bytes": size,
            "dropped": dropped, "confidence": mode, "folded_temperature": folded,
            "confidence_temperatures": config.get("confidence_temperatures")}


def _fresh_state(spec, cfg: RunConfig, target_dir: str, d2t) -> dict[str, torch.Tensor]:
    """The initial weights training started from: ``train_worker`` seeds ``train.seed`` right before
    ``build_drafter`` (no other torch draw in between), so the same seed rebuilds them exactly."""
    from training.loop import build_drafter

    with torch.random.fork_rng():
        torch.manual_seed(cfg.train.seed)
        fresh = build_drafter(spec, cfg, target_dir, d2t)
    return {k: v.detach() for k, v in fresh.state_dict().items()}


def _vllm_view(cfg: RunConfig, name: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """ECE per position of the confidence as vLLM computes it (raw sigmoid of the exported head), on the
    calibrate stage's report half (as its before / after figures)."""
    from pipeline.calibrate import load_confidence
    from training.sts import calibration_report

    data = load_confidence(join(cfg.run_dir, "calibrate", name, "confidence.safetensors")).split()[1]
    gamma = data.z.shape[1]
    T = [info["folded_temperature"] or 1.0] * gamma
    report = calibration_report(data.z, data.y, data.valid, T, n_bins=cfg.calibrate.bins)
    return {"ece_vllm": [p["after"]["ece"] for p in report["positions"]]}


def run_export(cfg: RunConfig) -> dict[str, Any]:
    """``+stage=export``: export every trained drafter to ``<run_dir>/export/<name>/``.

    Temperatures come from ``<run_dir>/calibrate/<name>/report.json`` when present. A drafter vLLM
    cannot serve (see :func:`architecture`) is listed under ``skipped`` with the reason.

    Returns:
        ``{"drafters": {name: export info + "path" + calibration ECEs}, "skipped": {name: reason}}``.
    Raises:
        ExportError: no drafter could be exported, or a drafter is incomplete/untrained.
        FileNotFoundError: a drafter has no committed checkpoint (run the train stage).
    """
    from pipeline.target import resolve_target_path
    from training.loop import load_trained_drafter

    target_dir = resolve_target_path(cfg.target.path)
    summary: dict[str, Any] = {"drafters": {}, "skipped": {}}
    for name, spec in cfg.train.drafters.items():
        model = load_trained_drafter(cfg, name, target_dir)
        try:
            architecture(model.config)
        except ExportError as e:
            summary["skipped"][name] = str(e)
            log.warning("export %s skipped: %s", name, e)
            continue
        report_url = join(cfg.run_dir, "calibrate", name, "report.json")
        fs, path = filesystem(report_url)
        report = read_json(report_url) if fs.exists(path) else None
        out = join(cfg.run_dir, "export", name)
        info = export_drafter(model, target_dir, out,
                              temperatures=None if report is None else report["temperatures"],
                              global_temperature=None if report is None else report.get("global_temperature"),
                              fold_tolerance=cfg.export.fold_temperature_tolerance,
                              initial=_fresh_state(spec, cfg, target_dir, getattr(model, "d2t", None)))
        info["path"] = out
        if report is not None and info["architecture"] == DSPARK_ARCH:
            info["ece_before"] = [p["before"]["ece"] for p in report["positions"]]
            info["ece_sts"] = [p["after"]["ece"] for p in report["positions"]]
            info.update(_vllm_view(cfg, name, info))
        summary["drafters"][name] = info
        log.info("export %s: %s, %d tensors, confidence %s -> %s", name, info["architecture"],
                 info["num_tensors"], info["confidence"], out)
    if not summary["drafters"]:
        raise ExportError(f"no drafter could be exported: {summary['skipped']}")
    return summary
