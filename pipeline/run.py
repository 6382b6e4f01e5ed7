"""Command line: ``python -m pipeline.run +stage=<name|all> <config.yaml> [key=value ...]``.

The same command runs on a workstation and under ``ray job submit -- python -m pipeline.run ...``.
A positional YAML path is not Hydra syntax, so it is rewritten into an absolute ``--config-path`` /
``--config-name`` pair before Hydra parses argv; Hydra flags, overrides and ``-m`` keep working.
Without a YAML path the embedded default ``conf/tiny.yaml`` is used.
"""
from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from cache_schema import CacheError
from pipeline.config import STAGE_ORDER, RunConfig, Stage, to_dict, to_run_config
from pipeline.errors import ConfigError, PipelineError
from storage import configure_storage, join, write_json
from pipeline.target_model.loader import resolve_target_path
from training.checkpoint import CheckpointError
from training.target_weights import TargetWeightsError

log = logging.getLogger("pipeline")

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "conf" / "tiny.yaml"

# stage name -> "module:function"; a stage function takes a RunConfig and returns its summary dict.
STAGES: dict[str, str] = {
    "generate": "pipeline.stages.generate:run_generate",
    "cache": "pipeline.stages.cache:run_cache",
    "train": "pipeline.stages.train:run_train",
    "calibrate": "pipeline.stages.calibrate:run_calibrate",
    "export": "pipeline.stages.export:run_export",
    "evaluate": "pipeline.stages.evaluate:run_evaluate",
}

USER_ERRORS = (PipelineError, CacheError, CheckpointError, TargetWeightsError)
"""The error families the command line reports as one ``error:`` line (each message names the fix)."""


def user_error(exc: BaseException) -> BaseException | None:
    """The product error behind ``exc``, or None when it is not one of :data:`USER_ERRORS`.

    An error raised inside a Ray task or actor (a cache or generate shard, a train worker) reaches
    the driver wrapped, often several times (``RayTaskError`` carries it as ``.cause``, Ray Data and
    Ray Train chain it as ``__cause__``); the innermost product error is the one whose message names
    the fix, so the chain is followed to its end.
    """
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, USER_ERRORS) and getattr(exc, "cause", None) is None:
            found = exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return found


_HYDRA_DEFAULTS = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout")


def _forced(arg: str) -> str:
    """``key=value`` -> ``++key=value``: an unknown key then reaches the typed schema check,
    which names it in one line, instead of Hydra's multi-line hint."""
    if "=" in arg and not arg.startswith(("-", "+", "~", "hydra")):
        return "++" + arg
    return arg


def rewrite_argv(argv: Sequence[str]) -> list[str]:
    """Turn ``[... conf/x.yaml ...]`` into Hydra's ``--config-path ABS --config-name x`` form.

    Plain ``key=value`` overrides become ``++key=value`` (see :func:`_forced`). Also adds run-directory defaults (no ``outputs/<date>`` folder in the working directory) unless
    the user set them.

    Raises:
        ConfigError: two YAML paths, or a YAML path that does not exist.
    """
    rest, yamls = [], []
    for arg in argv:
        is_yaml = not arg.startswith("-") and "=" not in arg and arg.endswith((".yaml", ".yml"))
        (yamls if is_yaml else rest).append(_forced(arg))
    if len(yamls) > 1:
        raise ConfigError(f"config: one YAML file expected, got {yamls}")
    named = any(a in ("--config-name", "-cn") or a.startswith("--config-name=") for a in rest)
    if yamls or not named:
        path = Path(yamls[0]).expanduser().resolve() if yamls else DEFAULT_CONFIG
        if not path.is_file():
            raise ConfigError(f"config: no such file {path}")
        rest = ["--config-path", str(path.parent), "--config-name", path.stem, *rest]
    for default in _HYDRA_DEFAULTS:
        key = default.split("=")[0]
        if not any(a.split("=")[0].lstrip("+~") == key for a in rest):
            rest.append(default)
    return rest


def load_config(config_file: str | Path = DEFAULT_CONFIG, overrides: Sequence[str] = ()) -> RunConfig:
    """Compose a config with Hydra's compose API (tests, notebooks, Ray workers).

    Gives the same :class:`RunConfig` as the CLI for the same file and overrides.

    Raises:
        ConfigError: unknown key, bad value or missing file.
    """
    from hydra import compose, initialize_config_dir

    path = Path(config_file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"config: no such file {path}")
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        raw = compose(config_name=path.stem, overrides=[_forced(o) for o in overrides])
    return to_run_config(raw)


def _stage_fn(name: str) -> Callable[[RunConfig], dict[str, Any]]:
    module, fn = STAGES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def check_target_layers(cfg: RunConfig, target_dir: str) -> None:
    """Refuse ``target.target_layer_ids`` the target does not have (checked in dry runs too).

    Raises:
        ConfigError: an id above ``num_hidden_layers - 2`` (the last layer's output is returned after
            the final norm, so it is not a feature).
    """
    from transformers import AutoConfig

    from pipeline.target_model.prefill import check_layer_ids

    check_layer_ids(cfg.target.target_layer_ids,
                    AutoConfig.from_pretrained(target_dir, local_files_only=True).num_hidden_layers)


def run_stages(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run one stage, or every built stage in order for ``stage=all``.

    Each stage's summary is written to ``<run_dir>/<stage>/summary.json`` (with ``seconds``).

    Raises:
        ConfigError: a stage that this build does not have.
        TargetNotFoundError: the target is not on this machine (checked before any stage starts).
        ConfigError: target layer ids the target does not have (:func:`check_target_layers`).
    """
    configure_storage(cfg.storage)  # every S3 client of this process from here on (workers: their own call)
    check_target_layers(cfg, resolve_target_path(cfg.target.path))  # fail fast, before any Ray or model start-up
    if cfg.stage == Stage.all:
        names = [n for n in STAGE_ORDER if n in STAGES and (n != "generate" or cfg.generate.enabled)]
    elif cfg.stage.value in STAGES:
        names = [cfg.stage.value]
    else:
        raise ConfigError(f"stage: {cfg.stage.value!r} is not available in this build "
                          f"(available: {', '.join(STAGES) or 'none'})")
    if cfg.dry_run:
        print(json.dumps({"stages": names, "config": to_dict(cfg)}, indent=2))
        return {}
    summaries = {}
    for name in names:
        t0 = time.perf_counter()
        log.info("stage %s: starting (run_dir=%s)", name, cfg.run_dir)
        summary = _stage_fn(name)(cfg)
        summary["seconds"] = round(time.perf_counter() - t0, 3)
        write_json(join(cfg.run_dir, name, "summary.json"), summary)
        summaries[name] = summary
        log.info("stage %s: done in %.1f s", name, summary["seconds"])
    if cfg.stage == Stage.all and summaries:
        from pipeline.eval_report import write_text
        from pipeline.results import results_table

        table = results_table(cfg.run_dir, summaries)
        write_text(join(cfg.run_dir, "results.md"), table)
        print("\n" + table, flush=True)
    return summaries


def _hydra_entry() -> None:
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base=None, config_path=None, config_name=None)
    def _main(raw: DictConfig) -> None:
        try:
            run_stages(to_run_config(raw))
        except Exception as e:  # noqa: BLE001 - a product error, however deep in Ray's wrapping, is one line
            cause = user_error(e)
            if cause is None:
                raise
            print(f"error: {cause}", file=sys.stderr)
            sys.exit(2)

    _main()


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``python -m pipeline.run`` and the ``dspark`` script)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        sys.argv = [sys.argv[0], *rewrite_argv(argv)]
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_entry()


if __name__ == "__main__":
    main()
