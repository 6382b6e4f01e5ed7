"""The model card of an export: ``<run_dir>/export/<drafter>/README.md`` and ``training_summary.json``.

Written by :func:`write_model_cards` after the export stage and again after the evaluate stage
(:func:`pipeline.run.run_stages`), from the run's own records only, never hand-written figures:
the export stage's ``summary.json`` (architecture, format, calibration), the cache's committed shards
(samples, tokens, supervised tokens), the train stage's ``result.json`` (steps, held-out learning
curve), the calibrate stage's ``report.json`` (STS, the on-policy refit) and the evaluate stage's
``summary.json`` (decoding-loop tau per task with its standard error, macro-averaged over tasks as the
DSpark paper's Table 1 reports, and the paired block-level tau). A card written before evaluate says
that the drafter was not evaluated yet.

``training_summary.json`` holds the same facts machine-readably (:func:`card_facts`); ``README.md``
renders them (:func:`card_markdown`) under a Hugging Face metadata header (``license`` from
``export.license``, ``base_model`` when ``target.path`` is a hub id). ``ops publish`` uploads the
directory (:mod:`ops.publish`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import RunConfig, to_dict
from pipeline.errors import PipelineError
from pipeline.eval_report import DISPLAY, macro_average, tau_cell
from storage import filesystem, join, read_json
from training.spec_sampling import Sampling

CARD = "README.md"
SUMMARY = "training_summary.json"
SCHEMA_VERSION = 1
METHODS = {"Qwen3DSparkModel": "dspark", "DFlashDraftModel": "dflash",
           "Eagle3LlamaForCausalLM": "eagle3"}  # vLLM's speculative_config method
KINDS = {"dflash": "DFlash (block-parallel backbone)",
         "eagle3": "EAGLE-3 (one decoder layer over fused low / middle / high target features, drafting "
                   "autoregressively)"}
RECIPE_KEYS = ("optimizer", "lr", "muon_lr", "epochs", "max_steps", "global_batch_samples", "micro_batch_samples",
               "num_anchors", "precision", "zero_stage", "num_workers", "loss_ce", "loss_tv", "loss_conf",
               "decay_lambda", "warmup_ratio", "weight_decay", "grad_clip", "seed")


def _read(url: str) -> Any | None:
    try:
        return read_json(url)
    except FileNotFoundError:
        return None


def _hub_id(path: str) -> str | None:
    """``org/name`` when ``target.path`` is a hub id rather than a local folder or the embedded target."""
    if path.startswith(("embedded:", "/", ".", "~")) or "://" in path or Path(path).exists():
        return None
    return path if path.count("/") == 1 else None


def _evaluation(ev: dict[str, Any] | None, name: str) -> list[dict[str, Any]] | None:
    """Per sampling setting: decoding-loop tau per task and overall, the macro average, the speed-up
    over the target alone on the machine evaluate ran on, and the paired block-level tau."""
    if not ev:
        return None
    out = []
    for setting in ev.get("settings", []):
        key = f"T={Sampling(setting['temperature'], setting['top_p'], setting['top_k']):g}"  # the evaluate stage's key
        d = ev.get("results", {}).get(key, {}).get("drafters", {}).get(name)
        if d is None:
            continue
        ov = d["overall"]
        block = ((ev.get("blocks") or {}).get("drafters", {}).get(name, {}) or {}).get(repr(float(setting["temperature"])))
        out.append({"setting": key, **setting,
                    "tasks": {t: {k: m.get(k) for k in ("tau", "tau_se", "rounds")} for t, m in d["tasks"].items()},
                    "macro": macro_average(d["tasks"]),
                    "overall": {k: ov.get(k) for k in ("tau", "tau_se", "rounds", "speedup_vs_target")},
                    "block": None if block is None else {k: block.get(k) for k in ("tau", "tau_se", "n")}})
    return out


def card_facts(cfg: RunConfig, name: str) -> dict[str, Any]:
    """Everything the card states about drafter ``name`` of the run, read from the run's records
    (module docstring). Missing records (a stage not run yet) leave their field None.

    Raises:
        FileNotFoundError: the export stage has not written drafter ``name``.
    """
    from pipeline.stages.cache import cache_totals, cache_url

    export = _read(join(cfg.run_dir, "export", "summary.json")) or {}
    info = export.get("drafters", {}).get(name)
    if info is None:
        raise FileNotFoundError(f"no export of drafter {name!r} in {cfg.run_dir}/export/summary.json: "
                                "run +stage=export first")
    out = info["path"]
    shape = _target_shape(_read(join(out, "config.json")) or {})
    run = to_dict(cfg)
    spec = run["train"]["drafters"][name]
    try:
        cache = cache_totals(cache_url(cfg))
        cache.pop("fingerprint", None)
    except Exception:  # noqa: BLE001 - no cache (yet) or not readable: the card says unknown
        cache = None
    result = _read(join(cfg.run_dir, "train", name, "result.json")) or {}
    report = _read(join(cfg.run_dir, "calibrate", name, "report.json")) or {}
    evaluation = _evaluation(_read(join(cfg.run_dir, "evaluate", "summary.json")), name)
    method = METHODS.get(info["architecture"], info["architecture"])
    return {
        "schema_version": SCHEMA_VERSION, "drafter": name, "method": method,
        "architecture": info["architecture"], "format": info["format"], "spec": spec,
        "num_speculative_tokens": info["num_speculative_tokens"], "export_bytes": info.get("bytes"),
        "parameters": _parameters(join(out, "model.safetensors")),
        "target": {"path": cfg.target.path, "hub_id": _hub_id(cfg.target.path), "dtype": str(cfg.target.dtype.value),
                   "target_layer_ids": list(cfg.target.target_layer_ids),
                   "hidden_size": shape.get("hidden_size"), "vocab_size": shape.get("vocab_size"),
                   "enable_thinking": info.get("enable_thinking")},
        "data": {"train_files": list(cfg.data.train_files), "eval_files": list(cfg.data.eval_files),
                 "answers": ("regenerated by the target (generate stage, T={temperature:g} top-p {top_p:g} top-k "
                             "{top_k})".format(**run["generate"]) if cfg.generate.enabled
                             else "as in the input files"),
                 "max_length": cfg.data.max_length, "cache": cache},
        "recipe": {**{k: run["train"][k] for k in RECIPE_KEYS},
                   "steps": result.get("steps"), "world_size": result.get("world_size")},
        "validation": result.get("validation"),
        "calibration": {"confidence": info.get("confidence"), "folded_temperature": info.get("folded_temperature"),
                        "sts_temperatures": report.get("temperatures"),
                        "ece_before": info.get("ece_before"), "ece_sts": info.get("ece_sts"),
                        "ece_vllm": info.get("ece_vllm"), "refit": report.get("refit")} if report else None,
        "evaluation": evaluation,
        "license": cfg.export.license,
    }


def _target_shape(config: dict[str, Any]) -> dict[str, Any]:
    """The target's ``hidden_size`` and ``vocab_size`` as an export's ``config.json`` records them: read by
    :func:`pipeline.stages.export_format.read_fields` (nested in the speculators format), else its top-level
    keys; None where neither says."""
    from pipeline.stages.export_format import read_fields

    try:
        f = read_fields(config)
        return {"hidden_size": f["target_hidden_size"], "vocab_size": f["vocab_size"]}
    except (KeyError, IndexError, TypeError, PipelineError):
        return {k: config.get(k) for k in ("hidden_size", "vocab_size")}


def _parameters(url: str) -> int | None:
    """Elements of every tensor in a safetensors file, read from its header only."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def _serve(facts: dict[str, Any], model_ref: str) -> str:
    path = facts["target"]["path"]
    target = facts["target"]["hub_id"] or ("<the target's folder>" if path.startswith("embedded:") else path)
    conf = json.dumps({"method": facts["method"], "model": model_ref,
                       "num_speculative_tokens": facts["num_speculative_tokens"]})
    return f"vllm serve {target} \\\n    --speculative-config '{conf}'"


def card_markdown(facts: dict[str, Any], model_ref: str = "<this directory or repo id>") -> str:
    """The ``README.md`` of an export: Hugging Face metadata, then what the drafter is, how to serve
    it, its evaluation per task, calibration, data and recipe. Only figures from ``facts``."""
    meta: dict[str, Any] = {"library_name": "vllm", "pipeline_tag": "text-generation",
                            "tags": ["speculative-decoding", facts["method"], "drafter"]}
    if facts["license"]:
        meta["license"] = facts["license"]
    if facts["target"]["hub_id"]:
        meta["base_model"] = facts["target"]["hub_id"]
    t, spec = facts["target"], facts["spec"]
    kind = ("DSpark (DFlash block-parallel backbone + Markov head" + (" + confidence head)" if spec.get("confidence_head")
                                                                     else ")")
            if facts["method"] == "dspark" else KINDS.get(facts["method"], facts["method"]))
    params = "unknown" if facts["parameters"] is None else f"{facts['parameters']:,}"
    lines = ["---", yaml.safe_dump(meta, sort_keys=True).strip(), "---", "",
             f"# {DISPLAY.get(facts['method'], facts['method'])} drafter `{facts['drafter']}` for "
             f"{t['hub_id'] or t['path']}", "",
             f"- Drafter: {kind}, {spec['num_layers']} layer{'s' if spec['num_layers'] != 1 else ''}, "
             f"{facts['num_speculative_tokens']} drafted tokens "
             f"per block, {params} parameters in `model.safetensors` ({facts['format']} format)",
             f"- Target: `{t['path']}` (hidden {t['hidden_size']}, vocabulary {t['vocab_size']}), captured layers "
             f"{t['target_layer_ids']}, thinking mode {t['enable_thinking']}",
             f"- Licence: {facts['license'] or 'not set (export.license)'}", "",
             "## Serving", "", "```sh", _serve(facts, model_ref), "```", "",
             "Prompts should be rendered in the thinking mode above (`chat_template_kwargs`).", ""]
    lines += ["## Acceptance length", ""]
    if not facts["evaluation"]:
        lines += ["Not evaluated yet (run `+stage=evaluate`; the card is rewritten then).", ""]
    else:
        lines += ["Decoding-loop acceptance length tau (tokens per target forward, bonus token included) on "
                  "held-out prompts, mean ± standard error with prompts as clusters; `macro` is the unweighted "
                  "mean over tasks; block level: the paired evaluation on held-out cache blocks.", ""]
        tasks = sorted({k for s in facts["evaluation"] for k in s["tasks"]})
        lines += ["| setting | " + " | ".join(tasks) + " | macro | all prompts | block level |",
                  "|---|" + "---:|" * (len(tasks) + 3)]
        for s in facts["evaluation"]:
            cells = [tau_cell(s["tasks"].get(k)) for k in tasks]
            lines.append(f"| {s['setting']} | " + " | ".join(cells) + f" | {tau_cell(s['macro'])} | "
                         f"{tau_cell(s['overall'])} | {tau_cell(s['block'])} |")
        lines.append("")
    cal = facts["calibration"]
    lines += ["## Confidence calibration", ""]
    if not cal or cal["confidence"] in (None, "none"):
        lines += ["No confidence head." if spec.get("confidence_head") is False or facts["method"] != "dspark"
                  else "Not calibrated (run `+stage=calibrate`).", ""]
    else:
        refit = cal.get("refit") or {}
        lines += [f"- Confidence: {cal['confidence']}, folded temperature {cal['folded_temperature']}",
                  f"- STS temperatures per position: {_fmt(cal['sts_temperatures'])}",
                  f"- ECE per position before / after STS / as vLLM applies it: {_fmt(cal['ece_before'])} / "
                  f"{_fmt(cal['ece_sts'])} / {_fmt(cal['ece_vllm'])}",
                  f"- On-policy refit on the drafter's own decoding rounds: {_refit(refit)}", ""]
    cache, r = facts["data"]["cache"] or {}, facts["recipe"]
    val = (facts["validation"] or {}).get("last") or {}
    lines += ["## Data and training", "",
              f"- Data: {', '.join(facts['data']['train_files']) or '-'}; answers {facts['data']['answers']}; "
              f"at most {facts['data']['max_length']} tokens per sample",
              f"- Cache: {cache.get('samples', '-')} samples, {cache.get('tokens', '-')} tokens, "
              f"{cache.get('supervised_tokens', '-')} supervised tokens, {cache.get('shards', '-')} shards",
              f"- Recipe: {r['optimizer']} (lr {r['lr']}, Muon lr {r['muon_lr']}), {r['steps']} steps of "
              f"{r['global_batch_samples']} samples, {r['num_anchors']} anchors per sample, {r['precision']}, "
              f"ZeRO-{r['zero_stage']} on {r['world_size']} workers; loss CE {r['loss_ce']} + TV {r['loss_tv']} "
              f"+ confidence {r['loss_conf']}, slot decay {r['decay_lambda']}, seed {r['seed']}",
              f"- Held-out learning curve, last point: step {val.get('step', '-')}, expected tau "
              f"{_fmt(val.get('tau_expected'))}, slot-1 acceptance {_fmt(val.get('slot1_acceptance'))}", "",
              f"Every figure here is read from the run's records; `{SUMMARY}` holds them machine-readably.", ""]
    return "\n".join(lines)


def _refit(refit: dict[str, Any]) -> str:
    if not refit:
        return "off"
    if "skipped" in refit:
        return f"skipped ({refit['skipped']})"
    auc = refit.get("heldout_auc", {})
    settings = " and ".join(f"T={Sampling(**s):g}" for s in refit.get("settings", []))
    return (("adopted" if refit["adopted"] else "not adopted") + f" on {refit.get('prompts')} prompts"
            + (f" decoded at {settings}" if settings else "") + f", {refit.get('slots')} slots; "
            f"held-out AUC trained {_fmt(auc.get('trained'))} -> refit {_fmt(auc.get('refit'))}")


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def write_model_cards(cfg: RunConfig) -> dict[str, str]:
    """(Re)write ``README.md`` and ``training_summary.json`` in every export directory of the run.

    Returns:
        ``{drafter: export directory URL}`` of the cards written (none before the export stage).
    """
    export = _read(join(cfg.run_dir, "export", "summary.json")) or {}
    written = {}
    for name, info in export.get("drafters", {}).items():
        if name not in cfg.train.drafters:
            continue
        facts = card_facts(cfg, name)
        fs, path = filesystem(join(info["path"], SUMMARY))
        fs.pipe_file(path, json.dumps(facts, indent=1, default=str).encode())
        fs.pipe_file(filesystem(join(info["path"], CARD))[1], card_markdown(facts).encode())
        written[name] = info["path"]
    return written
