"""Evaluate stage: acceptance length (tau) of every trained drafter, against plain target decoding,
plus static confidence thresholds and the hardware-aware scheduler simulated on measured costs.

Every table is computed per sampling setting (``evaluate.sampling``, :func:`pipeline.config.evaluate_settings`:
by default T = 0, T = 1 and the generate stage's own T / top-p / top-k); target and drafter
distributions are truncated as vLLM does (:mod:`training.spec_sampling`). The scheduler runs on two
cost curves: the SPS curve measured where the stage runs (``"cpu"`` on this machine) and the roofline
model of Qwen3-4B on one H200 (``"h200_model"``, :func:`pipeline.inference.roofline.qwen3_4b_h200_curves`).

Prompts come from ``data.eval_files`` through the same chat ingestion and rendering as the cache
(same template and render options, reported in the summary). A prompt is a chat up to its first
assistant turn.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np
import torch

from pipeline.chats.ingest import Chat, RowError, iter_chats
from pipeline.config import RunConfig, evaluate_settings
from pipeline.chats.render import render_options, render_prompt, thinking_mode
from pipeline.inference.speculate import (Decoded, device_generator, plain_decode, speculative_decode,
                                          threshold_policy)
from pipeline.errors import MissingStageOutputError, PipelineError
from pipeline.eval_report import write_bytes
from storage import join, read_json
from pipeline.paths import resolve_input

log = logging.getLogger("pipeline.stages.evaluate")


def prompt_sources(cfg: RunConfig) -> list[tuple[str, str, Any, int | None]]:
    """``(task, file URL, row mapper, limit)`` of the decoding loop's prompts: each of
    ``evaluate.prompt_sets`` (task = its name, limit its ``max_prompts`` or ``evaluate.num_prompts``),
    else each of ``data.eval_files`` (task = the file's name without extension, limit None: the first
    ``evaluate.num_prompts`` usable rows over all files)."""
    from pipeline.chats.prompt_sets import row_mapper

    if cfg.evaluate.prompt_sets:
        return [(task, resolve_input(ps.path), row_mapper(ps.format, ps.field, ps.match),
                 ps.max_prompts or cfg.evaluate.num_prompts)
                for task, ps in cfg.evaluate.prompt_sets.items()]
    return [(url.rsplit("/", 1)[-1].split(".")[0], url, None, None)
            for url in (resolve_input(f) for f in cfg.data.eval_files)]


def eval_prompts(cfg: RunConfig, tokenizer, skipped: dict[str, dict[str, int]] | None = None
                 ) -> list[tuple[str, list[int]]]:
    """``(task, prompt ids)`` of the decoding loop (:func:`prompt_sources`): a chat up to its first
    answer, rendered with the target's template in ``data.render``'s mode; prompts of
    ``data.max_length`` tokens or more are left out. ``skipped`` collects ``{task: {reason: rows}}`` of the
    rows left out (bad rows with their ingest reason, ``too_long``)."""
    out: list[tuple[str, list[int]]] = []
    for source, (task, url, to_chat, limit) in enumerate(prompt_sources(cfg)):
        kept = 0
        for item in iter_chats(url, source, require_answer=False, to_chat=to_chat):
            if (limit is None and len(out) >= cfg.evaluate.num_prompts) or (limit is not None and kept >= limit):
                break
            reason = item.reason if not isinstance(item, Chat) else None
            if reason is None:
                turns = list(item.messages)
                first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
                try:
                    ids = render_prompt(tokenizer, turns[:first], cfg.data.render)
                    reason = None if len(ids) < cfg.data.max_length else "too_long"
                except RowError as e:
                    reason = e.reason
                if reason is None:
                    out.append((task, ids))
                    kept += 1
                    continue
            if skipped is not None:
                counts = skipped.setdefault(task, {})
                counts[reason] = counts.get(reason, 0) + 1
    return out


def tau_standard_error(runs: list[Decoded]) -> float | None:
    """Standard error of tau = (sum of tokens per round) / rounds, prompts as clusters (rounds of
    one prompt are not independent): the delta method for a ratio of means,
    ``SE = sqrt(sum_i (s_i - tau n_i)^2 / (k (k - 1))) / mean(n)`` over k prompts with n_i rounds
    and s_i = sum of (accepted + 1). None with fewer than 2 prompts."""
    n = np.array([len(d.rounds) for d in runs if d.rounds], dtype=float)
    s = np.array([sum(r.accepted + 1 for r in d.rounds) for d in runs if d.rounds], dtype=float)
    if len(n) < 2:
        return None
    tau = s.sum() / n.sum()
    return float(np.sqrt(((s - tau * n) ** 2).sum() / (len(n) * (len(n) - 1))) / n.mean())


def round_metrics(runs: list[Decoded], gamma: int) -> dict[str, Any]:
    """tau (tokens per round incl. the bonus) with its standard error (:func:`tau_standard_error`),
    conditional acceptance and survival per position (over rounds that verified that position),
    verified tokens and times per round."""
    rounds = [r for d in runs for r in d.rounds]
    if not rounds:
        return {"rounds": 0}
    acc = np.array([r.accepted for r in rounds])
    ver = np.array([r.verified for r in rounds])
    cond, surv = [], []
    for k in range(1, gamma + 1):
        seen = ver >= k
        reached = seen & (acc >= k - 1)
        cond.append(float((acc[reached] >= k).mean()) if reached.any() else None)
        surv.append(float((acc[seen] >= k).mean()) if seen.any() else None)
    tokens = sum(len(d.tokens) for d in runs)
    seconds = sum(d.seconds for d in runs)
    return {"rounds": len(rounds), "tau": float((acc + 1).mean()), "tau_se": tau_standard_error(runs),
            "verified_per_round": float(ver.mean()),
            "conditional_acceptance": cond, "survival": surv, "tokens": tokens,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "draft_ms_per_round": 1e3 * float(np.mean([r.draft_s for r in rounds])),
            "verify_ms_per_round": 1e3 * float(np.mean([r.verify_s for r in rounds]))}


def _temperatures(cfg: RunConfig, name: str) -> list[float] | None:
    try:
        return read_json(join(cfg.run_dir, "calibrate", name, "report.json"))["temperatures"]
    except FileNotFoundError:
        return None


def _decode_all(fn, prompts, seed: int, device: torch.device | str = "cpu", **kw) -> dict[str, list[Decoded]]:
    """Decode every prompt with ``fn`` from one generator on ``device`` (the target's) seeded ``seed``."""
    by_task: dict[str, list[Decoded]] = {}
    gen = device_generator(device, seed)
    for task, ids in prompts:
        by_task.setdefault(task, []).append(fn(prompt=ids, generator=gen, **kw))
    return by_task


def _block_records(runs: list[Decoded], temperatures: list[float] | None) -> tuple[np.ndarray, np.ndarray]:
    """Prefix-closed 0/1 outcomes and calibrated confidences of the fully verified blocks."""
    full = [r for d in runs for r in d.rounds if r.verified == r.gamma and r.confidence_logits is not None]
    if not full:
        return np.zeros((0, 0)), np.zeros((0, 0))
    gamma = full[0].gamma
    outcomes = np.array([[1 if k < r.accepted else 0 for k in range(gamma)] for r in full])
    z = torch.tensor([r.confidence_logits for r in full])
    t = torch.ones(gamma) if temperatures is None else torch.tensor(temperatures[:gamma], dtype=torch.float32)
    return outcomes, torch.sigmoid(z / t).numpy()


def block_pairs(drafters: dict[str, Any]) -> list[tuple[str, str]]:
    """Ratios to report: every drafter with a sequential head over every one without (DFlash), every
    DFlash-backbone drafter over every EAGLE-3 one (the DSpark paper's Table 1 rows), and every
    Markov-family drafter over every control (the ablation, DSpark / control)."""
    kinds = {n: ("eagle3" if m.config.architecture == "eagle3" else "none" if m.markov_head is None
                 else m.config.head_type) for n, m in drafters.items()}
    pairs = [(a, b) for a in kinds for b in kinds if kinds[a] not in ("none", "eagle3") and kinds[b] == "none"]
    pairs += [(a, b) for a in kinds for b in kinds if kinds[a] != "eagle3" and kinds[b] == "eagle3"]
    return pairs + [(a, b) for a in kinds for b in kinds if kinds[a] not in ("none", "control")
                    and kinds[b] == "control"]


def block_level(cfg: RunConfig, drafters: dict[str, Any], target_dir: str, records: dict | None = None
                ) -> dict[str, Any]:
    """Paired block-level speculative sampling of every drafter on the held-out cache shards
    (:func:`training.block_runner.evaluate_blocks`): the first ``evaluate.block_samples`` held-out
    samples, ``evaluate.block_anchors`` anchors each, at every sampling setting
    (:func:`pipeline.config.evaluate_settings`); ``records`` collects
    the per-block realised outcomes (``evaluate_blocks(records=...)``).

    Returns:
        :func:`training.block_eval.summarise` with pair keys written ``"a/b"`` and ``table`` (markdown).
    """
    from cache_schema import CacheReader
    from pipeline.stages.cache import cache_url
    from pipeline.stages.train import expected_fingerprint
    from training.block_eval import format_table, summarise
    from training.block_runner import evaluate_blocks
    from training.data import sample_batches, split_shards

    reader = CacheReader(cache_url(cfg), expected_fingerprint(cfg, target_dir))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards,
                         cfg.train.validation_shards)

    batches = sample_batches(reader, split.heldout, cfg.train.micro_batch_samples, cfg.evaluate.block_samples)
    tally = evaluate_blocks(drafters, batches, temperatures=evaluate_settings(cfg),
                            num_anchors=cfg.evaluate.block_anchors, records=records,
                            chunk_blocks=cfg.evaluate.block_chunk)
    summary = summarise(tally, pairs=block_pairs(drafters))
    table = format_table(summary)
    summary["pairs"] = {f"{a}/{b}": v for (a, b), v in summary["pairs"].items()}
    return {**summary, "heldout_shards": list(split.heldout), "table": table}


def _global_temperature(cfg: RunConfig, name: str) -> float | None:
    try:
        return read_json(join(cfg.run_dir, "calibrate", name, "report.json")).get("global_temperature")
    except FileNotFoundError:
        return None


def gate_outcomes(cfg: RunConfig, name: str, head: str | None) -> tuple[Any, dict[str, Any]] | None:
    """Drafter ``name``'s gate rounds from its calibrate report (:func:`pipeline.stages.calibrate.gate_rounds`).

    Returns:
        ``(outcomes, report)`` (a :class:`pipeline.inference.realised.Outcomes`, z and max_q [N, gamma]
        float64, and the report's ``gate`` entry) when calibrate wrote them with the head evaluate judges
        (its :func:`pipeline.drafters.head_digest` equal to ``head``); None without a calibrate report,
        with the rounds skipped, or with a head since replaced (a warning says so).
    Raises:
        MissingStageOutputError (a FileNotFoundError): the report names gate rounds whose file is gone
            (rerun +stage=calibrate).
    """
    from pipeline.inference.realised import load_outcomes
    from pipeline.stages.calibrate import gate_rounds_url

    try:
        gate = read_json(join(cfg.run_dir, "calibrate", name, "report.json")).get("gate")
    except FileNotFoundError:
        return None
    if not gate or "skipped" in gate:
        return None
    if gate.get("head") != head:
        log.warning("evaluate %s: calibrate's gate rounds were scored by another confidence head (rerun "
                    "+stage=calibrate); estimators fitted on held-out blocks instead", name)
        return None
    url = gate_rounds_url(cfg, name)
    try:
        return load_outcomes(url), gate
    except FileNotFoundError as e:
        raise MissingStageOutputError(f"{url}: calibrate's report names gate rounds that are not there (removed, or "
                                      "written by an interrupted run): rerun +stage=calibrate") from e


def realised_calibration(cfg: RunConfig, configs: dict[str, Any], decoded: dict, block_records: dict, sps,
                         model_curves: dict[int, Any] | None = None, heads: dict[str, str] | None = None
                         ) -> tuple[dict[str, Any], str]:
    """Calibration on realised acceptance per drafter with a confidence head and temperature
    (:mod:`pipeline.inference.realised`). The estimators are fitted, and the setting's adaptive policy
    gated (:func:`pipeline.inference.realised.compare`), at the head's own setting on calibrate's gate
    rounds (:func:`gate_outcomes`: on-policy rounds of other held-out prompts, the head's digest in
    ``heads`` matching) and reported on the decoding rounds and on every held-out block; at the other
    settings (or without gate rounds) fitted on the block-level outcomes of even held-out batches and
    reported on the decoding rounds and the odd batches (without a block-level evaluation: fitted on
    the decoding rounds of even prompts, reported on the odd ones). The scheduler simulation replays
    the decoding rounds, on ``sps`` and on ``model_curves`` (``{block size: {R: SPSCurve}}``, the H200
    model) when given. One result per sampling setting; writes ``evaluate/reliability_<drafter>_T<setting>.png``.

    Returns:
        ``({name: {"T=..": pipeline.inference.realised.compare result}}, markdown)``: the tables and, per drafter vLLM
        serves, the serving recommendation (:func:`pipeline.inference.realised.recommendation`).
    """
    from pipeline.stages.export_format import DSPARK_ARCH, ExportError, architecture
    from pipeline.inference.realised import (compare, conditional, format_tables, from_records, from_rounds,
                                   plot_reliability, recommendation)

    ev, out_dir = cfg.evaluate, join(cfg.run_dir, "evaluate")
    result: dict[str, Any] = {}
    text = []
    for name, config in configs.items():
        if not config.confidence_head:
            continue
        gate = gate_outcomes(cfg, name, (heads or {}).get(name))
        for T in evaluate_settings(cfg):
            key = f"T={T:g}"
            try:
                decode = from_rounds(decoded[(key, name)])
            except ValueError:          # no round at all (every prompt stopped at once): nothing to score
                continue
            if gate is not None and gate[1]["sampling"] == T.to_dict() and gate[0].gamma == decode.gamma:
                fit, fit_set = gate[0], f"on-policy gate rounds of {gate[1]['prompts']} calibrate prompts"
                reports = {"decoding": decode}
                if (name, T) in block_records:
                    reports["block level"] = from_records(block_records[(name, T)])
            elif (name, T) in block_records:
                fit, odd = from_records(block_records[(name, T)]).split()
                fit_set, reports = "held-out blocks, even batches", {"decoding": decode, "block level, odd batches": odd}
            else:
                fit, odd = decode.split()
                fit_set, reports = "decoding rounds, even prompts", {"decoding, odd prompts": odd}
            curves = None if model_curves is None else model_curves[config.block_size]
            cmp = compare(fit, reports, sps, concurrency=ev.concurrency, export_temperature=_global_temperature(cfg, name),
                          seed=ev.seed, n_bins=cfg.calibrate.bins, model_curves=curves,
                          min_speedup=ev.scheduler_min_speedup, fit_set=fit_set)
            first = next(iter(reports.values()))
            plot_reliability(join(out_dir, f"reliability_{name}_T{T:g}.png"),
                             {e: conditional(p, first) for e, p in cmp["estimators"].items()}, first,
                             f"{name} {key}: survival vs realised acceptance ({next(iter(reports))})")
            result.setdefault(name, {})[key] = cmp
            text.append(format_tables(name, key, cmp))
        try:
            method = "dspark" if architecture(config) == DSPARK_ARCH else "dflash"
        except ExportError:
            continue
        if name not in result:
            continue
        text += ["", f"serving recommendation, {name} (simulated on the SPS curve and the realised decoding blocks):",
                 recommendation(result[name], method, join(cfg.run_dir, "export", name))]
    return result, "\n".join(text)


def evaluate_on_device(cfg: RunConfig) -> dict[str, Any]:
    """The part of the evaluate stage that runs models, where :func:`pipeline.stages.calibrate.task_device`
    says (a GPU in the stage's Ray task): the block-level evaluation (:func:`block_level`), the decoding
    loop (plain and speculative, at every sampling setting of :func:`pipeline.config.evaluate_settings`;
    generators on the target's device), the thresholds (at the last setting, by default the generate
    stage's) and the SPS curve (profiled on that device unless ``evaluate.sps_table``). The
    target is loaded there in ``target.dtype``, the drafters in the same dtype on a GPU (float32 on
    the CPU, as before) with a tied ``lm_head`` held once (:func:`training.block_runner.eval_drafter`).

    Returns:
        a picklable dict: ``configs`` ({name: DrafterConfig}), ``blocks`` (or None), ``block_records``, ``heads``
        ({name: :func:`pipeline.drafters.head_digest`} of the drafters with a confidence head),
        ``results``, ``thresholds``, ``records`` ({("T=..", name): [Decoded]}), ``sps`` (SPSCurve),
        ``prompts`` (count), ``tasks`` ({task: prompts}), ``skipped_prompts`` ({task: {reason: rows}}), ``device``.
    Raises:
        PipelineError: no usable evaluation prompt. As ``load_trained_drafter`` / ``load_target``.
    """
    from pipeline.config import torch_dtype
    from pipeline.drafters import head_digest, load_trained_drafter
    from pipeline.inference.sps import profile_sps
    from pipeline.inference.scheduler import SPSCurve
    from pipeline.stages.calibrate import task_device
    from pipeline.target_model.loader import load_target, resolve_target_path, stop_ids
    from pipeline.target_model.prefill import LayerTap
    from training.block_runner import eval_drafter

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = task_device()
    dtype = torch_dtype(cfg.target.dtype) if device != "cpu" else None
    target_dir = resolve_target_path(cfg.target.path)  # drafters first: a config they refuse costs nothing
    drafters = {n: load_trained_drafter(cfg, n, target_dir, calibrated=True) for n in cfg.train.drafters}
    heads = {n: head_digest(d) for n, d in drafters.items() if d.confidence_head is not None}  # float32, before the cast
    drafters = {n: eval_drafter(d, device, dtype) for n, d in drafters.items()}
    model, tok, target_dir = load_target(cfg.target, device)
    skipped: dict[str, dict[str, int]] = {}
    prompts = eval_prompts(cfg, tok, skipped)
    if not prompts:
        raise PipelineError("no usable evaluation prompt in "
                            + ("evaluate.prompt_sets" if cfg.evaluate.prompt_sets else "data.eval_files")
                            + f" (rows left out per task and reason: {skipped})")
    stop = stop_ids(model, tok)
    block_records: dict = {}
    blocks = block_level(cfg, drafters, target_dir, block_records) if cfg.evaluate.block_samples else None
    tap = LayerTap(model, cfg.target.target_layer_ids)
    ev = cfg.evaluate
    common = {"max_new_tokens": ev.max_new_tokens, "stop_ids": stop, "device": model.device}
    results: dict[str, Any] = {}
    records: dict[str, Any] = {}
    settings = evaluate_settings(cfg)
    for T in settings:
        key = f"T={T:g}"
        base = _decode_all(lambda **kw: plain_decode(model, **kw), prompts, ev.seed, temperature=T, **common)
        base_tps = sum(len(d.tokens) for v in base.values() for d in v) / sum(d.seconds for v in base.values() for d in v)
        results[key] = {"target_tokens_per_s": base_tps, "drafters": {}}
        for name, drafter in drafters.items():
            runs = _decode_all(lambda **kw: speculative_decode(model, drafter, tap=tap, **kw), prompts, ev.seed,
                               temperature=T, **common)
            gamma = drafter.config.block_size
            overall = round_metrics([d for v in runs.values() for d in v], gamma)
            overall["speedup_vs_target"] = overall.get("tokens_per_s", 0.0) / base_tps
            results[key]["drafters"][name] = {"overall": overall,
                                              "tasks": {t: round_metrics(v, gamma) for t, v in runs.items()}}
            records[(key, name)] = [d for v in runs.values() for d in v]
    t_thr = settings[-1]
    thresholds = {}
    for name, drafter in drafters.items():
        if drafter.confidence_head is None:
            continue
        temps = _temperatures(cfg, name)
        thresholds[name] = []
        for thr in ev.thresholds:
            runs = _decode_all(lambda **kw: speculative_decode(model, drafter, tap=tap, policy=threshold_policy(thr, temps), **kw),
                               prompts, ev.seed, temperature=t_thr, **common)
            m = round_metrics([d for v in runs.values() for d in v], drafter.config.block_size)
            thresholds[name].append({"threshold": thr, "tau": m.get("tau"), "verified_per_round": m.get("verified_per_round")})
    sps = SPSCurve.load(ev.sps_table) if ev.sps_table else profile_sps(model)
    return {"configs": {n: d.config for n, d in drafters.items()}, "blocks": blocks, "block_records": block_records,
            "heads": heads,
            "results": results, "thresholds": thresholds, "records": records, "sps": sps, "prompts": len(prompts),
            "tasks": {t: sum(1 for u, _ in prompts if u == t) for t in dict.fromkeys(t for t, _ in prompts)},
            "skipped_prompts": skipped, "device": str(model.device)}


def run_evaluate(cfg: RunConfig) -> dict[str, Any]:
    """``+stage=evaluate``: paired block-level tau on held-out cache blocks (:func:`block_level`),
    then the decoding loop: tau tables, thresholds, scheduler, per sampling setting
    (:func:`pipeline.config.evaluate_settings`). The models run in :func:`evaluate_on_device`, as one
    Ray task asking for ``evaluate.gpus`` GPUs and ``evaluate.cpus`` CPUs (in this process when
    ``evaluate.gpus`` is 0: :func:`pipeline.stages.calibrate.run_task`); this process writes the tables.

    Writes ``<run_dir>/evaluate/`` ``block_table.md``, ``tau_table.md`` (each headed by the thinking
    mode), ``tau.png``, ``acceptance.png``, ``sps.json``, the calibration on realised acceptance
    (:func:`realised_calibration`): ``calibration_table.md`` and ``reliability_<drafter>_T<setting>.png``,
    and ``confidence.json`` (:func:`confidence_summary`). The scheduler runs on the measured SPS curve
    (``"cpu"``) and on the H200 roofline model of Qwen3-4B (``"h200_model"``) over ``evaluate.concurrency``.
    Prompts are rendered in ``data.render.enable_thinking``'s mode, the drafters' own (a drafter of
    another mode is refused).
    """
    from pipeline.eval_report import plot_acceptance, tau_table, write_text
    from pipeline.inference.roofline import qwen3_4b_h200_curves
    from pipeline.inference.scheduler import simulate
    from pipeline.stages.calibrate import run_task

    ev = cfg.evaluate
    run, faults = run_task(cfg, evaluate_on_device, cfg, gpus=ev.gpus, cpus=ev.cpus, name="evaluate")
    blocks, results, records, sps = run["blocks"], run["results"], run["records"], run["sps"]
    mode = f"Prompts and held-out blocks rendered with {thinking_mode(cfg.data.render)}.\n\n"
    out_dir = join(cfg.run_dir, "evaluate")
    if blocks is not None:
        write_text(join(out_dir, "block_table.md"), mode + blocks["table"])
        print(mode + blocks["table"], flush=True)
    sps.save(join(out_dir, "sps.json"))
    model_curves = {g: qwen3_4b_h200_curves(ev.concurrency, block_size=g)
                    for g in {c.block_size for c in run["configs"].values()}}
    scheduler: dict[str, dict] = {}
    for T in evaluate_settings(cfg):
        for name, config in run["configs"].items():
            outcomes, conf = _block_records(records[(f"T={T:g}", name)], _temperatures(cfg, name))
            if len(outcomes):
                scheduler.setdefault(f"T={T:g}", {})[name] = {
                    curve: simulate(outcomes, conf, c, concurrency=ev.concurrency, seed=ev.seed,
                                    min_speedup=ev.scheduler_min_speedup)
                    for curve, c in (("cpu", sps), ("h200_model", model_curves[config.block_size]))}
    table = mode + tau_table(results, scheduler)
    write_text(join(out_dir, "tau_table.md"), table)
    plot_acceptance(results, join(out_dir, "acceptance.png"), join(out_dir, "tau.png"))
    print(table, flush=True)
    realised, realised_md = realised_calibration(cfg, run["configs"], records, run["block_records"], sps,
                                                 model_curves, run["heads"])
    write_text(join(out_dir, "calibration_table.md"), realised_md)
    print(realised_md, flush=True)
    confidence = confidence_summary(cfg, run["configs"], realised, results, blocks)
    if confidence is not None:
        write_bytes(join(out_dir, "confidence.json"), json.dumps(confidence, indent=1).encode())
    return {"blocks": blocks, "realised": realised, "prompts": run["prompts"], "tasks": run["tasks"],
            "skipped_prompts": run["skipped_prompts"],
            "render_options": render_options(cfg.data.render), "enable_thinking": cfg.data.render.enable_thinking,
            "results": results, "thresholds": run["thresholds"], "scheduler": scheduler,
            "settings": [T.to_dict() for T in evaluate_settings(cfg)], "confidence": confidence,
            "sps": {"batch_tokens": sps.batch_tokens.tolist(), "steps_per_s": sps.steps_per_s.tolist(),
                    "source": ev.sps_table or "profiled on this machine"}, "faults": faults}


def shipped_drafter(configs: dict[str, Any]) -> str | None:
    """The drafter the product ships: the first with a confidence head in the DSpark export
    architecture, else the first with a confidence head; None without one."""
    from pipeline.stages.export_format import DSPARK_ARCH, ExportError, architecture

    headed = [n for n, c in configs.items() if c.confidence_head]
    for name in headed:
        try:
            if architecture(configs[name]) == DSPARK_ARCH:
                return name
        except ExportError:
            continue
    return headed[0] if headed else None


def confidence_summary(cfg: RunConfig, configs: dict[str, Any], realised: dict[str, Any],
                       results: dict[str, Any], blocks: dict[str, Any] | None) -> dict[str, Any] | None:
    """``confidence.json``: per sampling setting, the shipped drafter's (:func:`shipped_drafter`)
    estimators scored on the decoding rounds of the held-out prompts (AUC and equal-mass ECE of
    survival per position k = 1..gamma), the scheduler's tokens/s over the best fixed block per R
    driven by the shipped estimator (``export``, the calibrate stage's folded temperature, what vLLM
    gets; ``raw`` without a calibrate report) on the measured curve (``"cpu"``) and the H200 model
    (``"h200_model"``), and decoding-loop tau beside block-level tau.

    Returns:
        ``{"drafter", "scored_on", "settings": [{"temperature", "top_p", "top_k", "shipped", "scored_on"
        (the report set: ``"decoding"``, or ``"decoding, odd prompts"`` without a block-level evaluation), "fitted_on"
        (where the estimators were fitted and adaptive verification gated: calibrate's on-policy gate rounds at the
        head's setting, else held-out blocks: :func:`realised_calibration`),
        "rounds", "estimators": {name: {"auc": [gamma], "ece": [gamma]}}, "scheduler": {"cpu": {R:
        ratio}, "h200_model": {R: ratio}}, "scheduler_production": {...} (two-step lag), "scheduler_algorithm1": {...} (DSpark
        Algorithm 1 without the fixed-block fallback), "scheduler_oracle": {...} (the bound: the best plan
        knowing the outcomes, what a perfect estimator would reach), "scheduler_by_estimator":
        {name: {"cpu": {R: ratio}, "h200_model": {R: ratio}}}, "tau": {"decoding", "decoding_se",
        "block", "block_se"}}]}`` (estimator names with ``_`` for spaces and dashes: ``max_q``); None
        when no drafter has a confidence head.
    """
    name = shipped_drafter(configs)
    if name is None or name not in realised:
        return None
    settings = []
    for T in evaluate_settings(cfg):
        key = f"T={T:g}"
        cmp = realised[name].get(key)
        if cmp is None:
            continue
        scored_on, decoding = next(iter(cmp["metrics"].items()))   # "decoding" (or its odd prompts)
        est = {e.replace("-", "_").replace(" ", "_"): {"auc": [p["auc"] for p in m], "ece": [p["ece_mass"] for p in m]}
               for e, m in decoding.items() if e != "blocks"}
        shipped = "export" if "export" in cmp["estimators"] else "raw"
        sims = {"cpu": cmp["simulation"], "h200_model": cmp.get("simulation_h200_model", {})}
        by_est = {e.replace("-", "_").replace(" ", "_"): {c: {R: v["ratio"] for R, v in sim[e].items()}
                                                          for c, sim in sims.items() if e in sim}
                  for e in cmp["estimators"]}
        overall = results[key]["drafters"][name]["overall"]
        block = (blocks or {}).get("drafters", {}).get(name, {}).get(T)
        settings.append({**T.to_dict(), "shipped": shipped, "scored_on": scored_on, "fitted_on": cmp.get("fit_set"),
                         "rounds": decoding["blocks"],
                         "estimators": est,
                         "scheduler": by_est[shipped],
                         "scheduler_production": {c: {R: v["ratio_production"] for R, v in sim[shipped].items()}
                                                  for c, sim in sims.items() if shipped in sim},
                         "scheduler_algorithm1": {c: {R: v["ratio_algorithm1"] for R, v in sim[shipped].items()}
                                                  for c, sim in sims.items() if shipped in sim},
                         "scheduler_by_estimator": by_est,
                         "scheduler_oracle": {c: sim["oracle"] for c, sim in sims.items() if "oracle" in sim},
                         "tau": {"decoding": overall.get("tau"), "decoding_se": overall.get("tau_se"),
                                 "block": None if block is None else block["tau"],
                                 "block_se": None if block is None else block["tau_se"]}})
    return {"drafter": name, "scored_on": "decoding rounds of the held-out prompts (data.eval_files)",
            "settings": settings}
