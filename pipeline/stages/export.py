"""Export stage: write each trained drafter of the run in ``export.format`` (the contract, both
formats and what vLLM applies to the confidence: :mod:`pipeline.stages.export_format`)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from pipeline.config import RunConfig
from pipeline.stages.export_format import DSPARK_ARCH, FORMATS, ExportError, architecture, export_drafter
from storage import filesystem, join, read_json

log = logging.getLogger("pipeline.stages.export")


def _fresh_state(model, seed: int, target_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The initial weights training started from, floating tensors in the training ``dtype`` (a bf16
    engine rounds the fp32 initialisation to bf16 before its first step): ``train_worker`` seeds
    ``train.seed`` right before building the drafter of its recorded config (no other torch draw in
    between), so the same seed and config rebuild them exactly.

    Memory: the frozen target weights are built in ``dtype`` (one copy of a tied embedding) and each
    parameter is rounded to ``dtype`` in place, its float32 initialisation freed as it goes, so the
    peak is the float32 trainable weights plus one bf16 embedding, where rounding a copy of the whole
    state beside two float32 embeddings held about four times more (at the real Qwen3-4B width with
    a 1-layer drafter, peak RSS 0.69 vs 5.36 GiB: ``bench/bench_shape_memory.py``)."""
    from training.loop import build_drafter_from

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fresh = build_drafter_from(model.config, target_dir, getattr(model, "d2t", None), dtype=dtype)
    for p in fresh.parameters():
        p.data = p.data.to(dtype)
    return {k: v.detach().to(dtype) if v.is_floating_point() else v.detach() for k, v in fresh.state_dict().items()}


def _training_record(cfg: RunConfig, name: str) -> tuple[list[str], torch.dtype]:
    """What drafter ``name``'s newest committed checkpoint records for the export guard: the tensors
    whose fp32 master weights moved past their stored bf16 copy (``master_ahead``) and the stored
    weights' dtype (``weights_dtype``); checkpoints written before these records: none, float32."""
    from training.checkpoint import latest_checkpoint

    state = latest_checkpoint(join(cfg.run_dir, "train", name))[1]
    return list(state.get("master_ahead", [])), getattr(torch, state.get("weights_dtype", "float32"))


def _vllm_view(cfg: RunConfig, name: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """ECE per position of the confidence as vLLM computes it (raw sigmoid of the exported head), on the
    calibrate stage's report half (as its before / after figures)."""
    from pipeline.stages.calibrate import load_confidence
    from training.sts import calibration_report

    data = load_confidence(join(cfg.run_dir, "calibrate", name, "confidence.safetensors")).split()[1]
    gamma = data.z.shape[1]
    T = [info["folded_temperature"] or 1.0] * gamma
    report = calibration_report(data.z, data.y, data.valid, T, n_bins=cfg.calibrate.bins)
    return {"ece_vllm": [p["after"]["ece"] for p in report["positions"]]}


def run_export(cfg: RunConfig) -> dict[str, Any]:
    """``+stage=export``: export every trained drafter to ``<run_dir>/export/<name>/`` in
    ``export.format`` (:data:`FORMATS`; the speculators format records ``target.path``, or the local
    directory of an embedded target, as verifier).

    Temperatures come from ``<run_dir>/calibrate/<name>/report.json`` when present. A drafter vLLM
    cannot serve (see :func:`architecture`) is listed under ``skipped`` with the reason.

    Returns:
        ``{"drafters": {name: export info + "path" + calibration ECEs}, "skipped": {name: reason}}``.
    Raises:
        ExportError: an unknown ``export.format``, no drafter could be exported, or a drafter is
            incomplete/untrained.
        FileNotFoundError: a drafter has no committed checkpoint (run the train stage).
    """
    from pipeline.target_model.loader import resolve_target_path
    from pipeline.drafters import load_trained_drafter

    if cfg.export.format not in FORMATS:
        raise ExportError(f"export.format={cfg.export.format!r} is not one of {list(FORMATS)}")
    target_dir = resolve_target_path(cfg.target.path)
    summary: dict[str, Any] = {"drafters": {}, "skipped": {}}
    for name in cfg.train.drafters:
        model = load_trained_drafter(cfg, name, target_dir, calibrated=True)
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
        ahead, dtype = _training_record(cfg, name)
        info = export_drafter(model, target_dir, out,
                              temperatures=None if report is None else report["temperatures"],
                              global_temperature=None if report is None else report.get("global_temperature"),
                              fold_tolerance=cfg.export.fold_temperature_tolerance,
                              initial=_fresh_state(model, cfg.train.seed, target_dir, dtype), master_ahead=ahead,
                              fmt=cfg.export.format,
                              verifier=target_dir if cfg.target.path.startswith("embedded:") else cfg.target.path,
                              enable_thinking=cfg.data.render.enable_thinking)
        info["path"] = out
        if report is not None and info["architecture"] == DSPARK_ARCH:
            info["ece_before"] = [p["before"]["ece"] for p in report["positions"]]
            info["ece_sts"] = [p["after"]["ece"] for p in report["positions"]]
            info.update(_vllm_view(cfg, name, info))
        summary["drafters"][name] = info
        log.info("export %s: %s (%s format), %d tensors, confidence %s -> %s", name, info["architecture"],
                 info["format"], info["num_tensors"], info["confidence"], out)
    if not summary["drafters"]:
        raise ExportError(f"no drafter could be exported: {summary['skipped']}")
    return summary
