"""Command line: ``python -m pipeline.run +stage=<name|all> <config.yaml> [key=value ...]``.

The same command runs on a workstation and under ``ray job submit -- python -m pipeline.run ...``.
A positional YAML path is not Hydra syntax, so it is rewritten into an absolute ``--config-path`` /
``--config-name`` pair before Hydra parses argv; Hydra flags (``--cfg job``, ``-m`` ...) may stand
before or after the YAML and the overrides (:func:`rewrite_argv`). Without a YAML path the embedded
default ``conf/tiny.yaml`` is used. ``--help`` prints :func:`help_text`. Before any stage starts (dry
runs too) the target and the input files of the stages to run are checked (:func:`run_stages`).
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
from pipeline.config import STAGE_ORDER, FeatureMode, RunConfig, Stage, to_dict, to_run_config
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


# Hydra writes nothing itself (output_subdir=null): a run in the working directory, a sweep's
# multirun.yaml under runs/ (git-ignored), never an outputs/ or multirun/ folder where the command ran.
_HYDRA_DEFAULTS = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout",
                   "hydra.sweep.dir=runs/multirun/${now:%Y-%m-%d_%H-%M-%S}")
_VALUE_FLAGS = frozenset({"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun"})  # Hydra flags followed by a value
_INFO_CHOICES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})  # --info [X]


def _forced(arg: str) -> str:
    """``key=value`` -> ``++key=value``: an unknown key then reaches the typed schema check,
    which names it in one line, instead of Hydra's multi-line hint."""
    if "=" in arg and not arg.startswith(("-", "+", "~", "hydra")):
        return "++" + arg
    return arg


def is_yaml_arg(arg: str) -> bool:
    """Whether a command-line word names a config file (``conf/x.yaml``): not a flag, not ``key=value``."""
    return not arg.startswith("-") and "=" not in arg and arg.endswith((".yaml", ".yml"))


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """``(YAML paths, Hydra flags with their values, overrides)`` of a command line, each in order.

    Flags may stand anywhere (``--cfg job``, ``-p train``, ``--info [defaults]``, ``-m``, ``--help``,
    ``--resolve`` ...): a flag of :data:`_VALUE_FLAGS` takes the next word as its value, ``--info``/``-i``
    takes it when it is one of its choices. Every other word is an override (``key=value``,
    ``+key=value``, ``~key``).
    """
    yamls, flags, overrides = [], [], []
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg.startswith("-"):
            flags.append(arg)
            takes = arg in _VALUE_FLAGS or (arg in ("--info", "-i") and i < len(argv) and argv[i] in _INFO_CHOICES)
            if takes and i < len(argv):
                flags.append(argv[i])
                i += 1
        elif is_yaml_arg(arg):
            yamls.append(arg)
        else:
            overrides.append(arg)
    return yamls, flags, overrides


def rewrite_argv(argv: Sequence[str]) -> list[str]:
    """Turn ``[... conf/x.yaml ...]`` into Hydra's ``--config-path ABS --config-name x`` form.

    Hydra flags may come before or after the YAML and the overrides: the result is the config pair,
    then every flag with its value, then every override together (Hydra's argparse refuses an override
    after a flag). Plain ``key=value`` overrides become ``++key=value`` (see :func:`_forced`). Also adds
    the run and sweep directory defaults (no ``outputs/`` or ``multirun/`` folder in the working
    directory) unless the user set them.

    Raises:
        ConfigError: two YAML paths, or a YAML path that does not exist.
    """
    yamls, flags, overrides = split_argv(argv)
    overrides = [_forced(o) for o in overrides]
    if len(yamls) > 1:
        raise ConfigError(f"config: one YAML file expected, got {yamls}")
    named = any(a in ("--config-name", "-cn") or a.startswith(("--config-name=", "-cn=")) for a in flags)
    head: list[str] = []
    if yamls or not named:
        path = Path(yamls[0]).expanduser().resolve() if yamls else DEFAULT_CONFIG
        if not path.is_file():
            raise ConfigError(f"config: no such file {path}")
        head = ["--config-path", str(path.parent), "--config-name", path.stem]
    for default in _HYDRA_DEFAULTS:
        key = default.split("=")[0]
        if not any(o.split("=")[0].lstrip("+~") == key for o in overrides):
            overrides.append(default)
    return [*head, *flags, *overrides]


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


def stage_names(cfg: RunConfig) -> list[str]:
    """The stages a run executes, in order: ``stage``, or every built stage for ``stage=all``
    (generate only when ``generate.enabled``).

    Raises:
        ConfigError: a stage that this build does not have.
    """
    if cfg.stage == Stage.all:
        return [n for n in STAGE_ORDER if n in STAGES and (n != "generate" or cfg.generate.enabled)]
    if cfg.stage.value in STAGES:
        return [cfg.stage.value]
    raise ConfigError(f"stage: {cfg.stage.value!r} is not available in this build "
                      f"(available: {', '.join(STAGES) or 'none'})")


def input_keys(cfg: RunConfig, names: Sequence[str]) -> list[str]:
    """The input-file keys the stages ``names`` read: ``data.train_files`` for generate and cache
    (and for train when it prefills itself, ``train.features`` online or hybrid), ``data.eval_files``
    for evaluate (``evaluate.prompt_sets.<task>.path`` instead when prompt sets are set). Calibrate and
    export, and train on a cache, read only what earlier stages wrote."""
    keys = []
    if {"generate", "cache"} & set(names) or ("train" in names and cfg.train.features != FeatureMode.cache):
        keys.append("data.train_files")
    if "evaluate" in names:
        keys += ([f"evaluate.prompt_sets.{t}.path" for t in cfg.evaluate.prompt_sets] if cfg.evaluate.prompt_sets
                 else ["data.eval_files"])
    return keys


def check_input_file(key: str, url: str) -> None:
    """Refuse an input file that is not there: a local path or fsspec URL must be a file (checked
    through :func:`storage.filesystem`), an ``embedded:`` name one of the built-in data sets.

    Args:
        key: the config key that lists it (``data.train_files``), named in the message.
        url: the file, as the config holds it (absolute for local paths).
    Raises:
        ConfigError: naming the key, the file and the fix.
    """
    from storage import filesystem

    if url.startswith("embedded:"):
        from pipeline.embedded.build import URLS

        if url not in URLS[1:]:
            raise ConfigError(f"{key}: unknown embedded data {url!r}; use one of {', '.join(URLS[1:])}")
        return
    try:
        fs, path = filesystem(url)
        if fs.isfile(path):
            return
        what = "is a folder, not a file" if fs.isdir(path) else "does not exist"
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"{key}: cannot check {url} ({type(e).__name__}: {e}); fix the URL or the storage "
                          "credentials (for S3: AWS_* variables or AWS_PROFILE)") from None
    raise ConfigError(f"{key}: {url} {what}; fix the path (JSONL or Parquet files) or remove it from {key}")


def check_inputs(cfg: RunConfig, names: Sequence[str]) -> None:
    """Refuse a run whose stages ``names`` would read a missing input file or an empty file list
    (dry runs too), before any Ray or model start-up.

    Raises:
        ConfigError: the first offending key and file (:func:`check_input_file`), or an empty list.
    """
    for key in input_keys(cfg, names):
        if key.startswith("evaluate.prompt_sets."):
            check_input_file(key, cfg.evaluate.prompt_sets[key.split(".")[2]].path)
            continue
        files = getattr(cfg.data, key.split(".", 1)[1])
        if not files:
            raise ConfigError(f"{key}: is empty, but +stage={cfg.stage.value} reads it; list the chat files "
                              f"(JSONL or Parquet), e.g. {key}=[data/chats.jsonl]")
        for url in files:
            check_input_file(key, url)


def run_stages(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Run one stage, or every built stage in order for ``stage=all``.

    Each stage's summary is written to ``<run_dir>/<stage>/summary.json`` (with ``seconds``).

    Raises:
        ConfigError: a stage that this build does not have (:func:`stage_names`).
        TargetNotFoundError: the target is not on this machine (checked before any stage starts).
        ConfigError: target layer ids the target does not have (:func:`check_target_layers`).
        ConfigError: a missing input file of a stage that reads it (:func:`check_inputs`).
    """
    configure_storage(cfg.storage)  # every S3 client of this process from here on (workers: their own call)
    names = stage_names(cfg)
    check_target_layers(cfg, resolve_target_path(cfg.target.path))  # fail fast, before any Ray or model start-up
    check_inputs(cfg, names)
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
        if name in ("export", "evaluate"):  # the export's model card, from the records written so far
            from pipeline.model_card import write_model_cards

            for drafter, url in write_model_cards(cfg).items():
                log.info("model card of %s: %s/README.md", drafter, url)
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


STAGE_HELP = {
    "generate": "the target rewrites every assistant turn of data.train_files (in +stage=all when generate.enabled)",
    "cache": "target prefill of the chats into the sharded Zarr cache <run_dir>/cache",
    "train": "Ray Train + DeepSpeed training of every drafter of train.drafters",
    "calibrate": "temperature scaling of each drafter's confidence head on the held-out cache shards",
    "export": "each trained drafter written in export.format (native or speculators)",
    "evaluate": "acceptance length of every drafter against plain target decoding, on data.eval_files",
    "all": "every stage above, in order (the default)",
}

KEY_HELP = (
    ("run_dir=DIR", "where every stage reads and writes; a path or any fsspec URL (s3://bucket/run)"),
    ("target.path=DIR", "the target: a local model folder, embedded:tiny, or a hub id already in the HF cache"),
    ("target.dtype=bf16|fp32", "the target's dtype (aliases bfloat16, float32); cache.feature_dtype=bf16|fp8_e4m3"),
    ("data.train_files=[a.jsonl,...]", "chat files (JSONL or Parquet, paths or URLs) to generate from and cache"),
    ("data.eval_files=[b.jsonl,...]", "prompts of the evaluate stage"),
    ("generate.enabled=true|false", "regenerate the answers with the target before caching"),
    ("train.epochs=N", "passes over the training shards (train.max_steps=N caps the steps)"),
    ("train.lr=X", "AdamW's peak learning rate (train.optimizer=muon: train.muon_lr for the matrices)"),
    ("train.num_workers=N", "Ray Train workers per drafter (train.use_gpu=true: one GPU each)"),
    ("train.features=cache|online|hybrid", "where the trainers' target features come from"),
    ("train.precision=fp32|bf16", "the drafters' training precision (aliases float32, bfloat16)"),
    ("dry_run=true", "check the config, the target and the input files, print the plan; run nothing"),
)

FLAG_HELP = (
    ("--cfg job [--resolve]", "print the composed config and exit (--cfg hydra|all; -p PACKAGE for one part)"),
    ("-m, --multirun", "sweep: key=a,b runs one job per value (Hydra's multirun.yaml goes under runs/multirun/)"),
    ("--info [defaults]", "Hydra's view of the config sources"),
    ("--hydra-help", "Hydra's own flags"),
)


def _conf_files() -> list[tuple[str, str]]:
    """``(conf/NAME.yaml, the first sentence of its opening comment)`` of every shipped config."""
    out = []
    for path in sorted(DEFAULT_CONFIG.parent.glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.stat().st_size else ""
        out.append((f"conf/{path.name}", first.lstrip("# ").split(". ")[0].rstrip(".") + "."))
    return out


def help_text() -> str:
    """The text of ``python -m pipeline.run --help``: usage, stages, shipped configs, common keys, flags."""
    def rows(pairs) -> list[str]:
        width = max(len(k) for k, _ in pairs) + 2
        return [f"  {k:<{width}}{v}" for k, v in pairs]

    return "\n".join([
        "usage: python -m pipeline.run [+stage=STAGE] [CONFIG.yaml] [key=value ...] [flags]",
        "       (ray job submit -- python -m pipeline.run ... on a cluster; flags may stand anywhere)", "",
        "Trains DSpark / DFlash speculative-decoding drafters for a frozen target LLM.", "",
        "stages (+stage=STAGE):", *rows(list(STAGE_HELP.items())), "",
        f"config files (default: conf/{DEFAULT_CONFIG.name}):", *rows(_conf_files()), "",
        "most used keys (any key of the config can be set; see them all with --cfg job):", *rows(KEY_HELP), "",
        "flags:", *rows(FLAG_HELP), "",
        "example: python -m pipeline.run +stage=all conf/qwen3_4b.yaml target.path=/models/Qwen3-4B "
        "run_dir=s3://bucket/run dry_run=true"])


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``python -m pipeline.run`` and the ``dspark`` script).

    ``--help``/``-h`` prints :func:`help_text` and exits 0; anything else is rewritten by
    :func:`rewrite_argv` and run by Hydra. Exits 2 with one ``error:`` line on a product error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"--help", "-h"} & set(split_argv(argv)[1]):
        print(help_text())
        sys.exit(0)
    try:
        sys.argv = [sys.argv[0], *rewrite_argv(argv)]
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_entry()


if __name__ == "__main__":
    main()
