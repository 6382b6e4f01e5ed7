"""Build the embedded default target and chat data once, into a cache folder, and reuse it.

Layout under ``<home>/embedded-v1-py<major>.<minor>/``::

    spec.json                  the BuildSpec the folder was built with
    stdlib/train.jsonl         chats from train modules (OpenAI ``messages`` rows)
    stdlib/heldout.jsonl       chats from held-out modules
    target/                    Qwen3ForCausalLM (safetensors) + tokenizer, loadable offline
    target/metrics.json        params, steps, seconds, held-out loss and top-1

The default spec's target ships with the package (``shipped_target/``: 4.8 MiB of fp32 weights,
the tokenizer, the metrics and the spec it was trained with), so a first use only builds the chats
(seconds) and every machine runs the demo on the same target; ``train_target=True`` (``python -m
pipeline.embedded --train-target``) trains it instead, as any other spec always does (about 6
minutes on 2 cores for the default). A build goes to a temporary sibling folder that is renamed into
place when complete, under an exclusive ``fcntl`` lock, so concurrent callers build once and never
see a partial folder.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.embedded.stdlib_chats import build_stdlib_chats, read_stdlib, split_modules
from pipeline.embedded.target import (TargetSpec, chat_eval_batch, evaluate, new_model,
                                      pack_windows, render_training_chat, train)
from pipeline.embedded.tokenizer import build_tokenizer
from storage import local_home

VERSION = "v1"
URLS = ("embedded:tiny", "embedded:stdlib/train.jsonl", "embedded:stdlib/heldout.jsonl")
SHIPPED_TARGET = Path(__file__).with_name("shipped_target")


@dataclass(frozen=True)
class BuildSpec:
    """Every knob of an embedded build; a folder is only reused for an equal spec.

    ``module_stride`` keeps every k-th stdlib module (sorted by name): 1 for the real build, larger
    for quick test builds. Chat caps are in rows; ``vocab_size`` in tokens.
    """

    vocab_size: int = 2048
    heldout_fraction: float = 0.1
    max_train_chats: int = 4000
    max_heldout_chats: int = 400
    module_stride: int = 1
    target: TargetSpec = field(default_factory=TargetSpec)


@dataclass(frozen=True)
class EmbeddedPaths:
    """Where a complete embedded build lives (all absolute)."""

    home: Path
    target_dir: Path
    train_chats: Path
    heldout_chats: Path
    metrics: Path

    @classmethod
    def at(cls, home: Path) -> EmbeddedPaths:
        """The paths of a build folder ``home`` (whether or not it exists yet)."""
        return cls(home, home / "target", home / "stdlib" / "train.jsonl",
                   home / "stdlib" / "heldout.jsonl", home / "target" / "metrics.json")


class EmbeddedSpecMismatch(RuntimeError):
    """An existing embedded build was made with a different BuildSpec."""


def default_home() -> Path:
    """``$DSPARK_HOME`` if set, else ``~/.cache/dspark`` (:func:`storage.local_home`)."""
    return local_home()


def _spec_json(spec: BuildSpec) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def shipped_target(spec: BuildSpec) -> Path | None:
    """The target folder shipped with the package if it was trained with ``spec``, else None."""
    found = SHIPPED_TARGET / "spec.json"
    if found.is_file() and json.loads(found.read_text("utf-8")) == _spec_json(spec):
        return SHIPPED_TARGET
    return None


def build_embedded(out_dir: str | Path, spec: BuildSpec = BuildSpec(),
                   progress: bool = False, train_target: bool = False) -> dict:
    """Build chats, tokenizer and trained target into ``out_dir`` (no locking, no reuse).

    With ``spec``'s target shipped (:func:`shipped_target`) and ``train_target`` False, only the
    chats are built and the shipped target (weights, tokenizer, metrics) is copied; its metrics
    then say ``"target": "shipped"`` and keep the figures of the build that trained it.

    Steps of a full build: read the stdlib sources, split modules (sha256 of the name), write the chat files,
    train the tokenizer on train-module sources and prompts, train the target on train-module
    sources mixed with the train chats rendered by the tokenizer's own template (alternately the
    whole ChatML conversation and the ``enable_thinking=False`` generation prompt + answer, so the
    target answers in both forms), evaluate on held-out modules, save.

    Returns:
        The metrics dict also written to ``target/metrics.json``: ``params``, ``steps``,
        ``train_seconds`` (wall), ``steps_per_s``, ``tokens_per_s``, ``build_seconds``, and
        ``heldout_source`` (held-out modules' source in windows of ``eval_window`` tokens, at most
        ``eval_tokens``), ``heldout_chat`` / ``heldout_chat_no_think`` (the held-out chats' answer
        tokens + ``<|im_end|>``, plain or non-thinking prompt), each ``{"loss": nats per token,
        "top1": fraction of argmax hits, "tokens": count}``; data counts, versions.
    """
    start = time.perf_counter()
    paths = EmbeddedPaths.at(Path(out_dir))
    modules = read_stdlib()[::spec.module_stride]
    train_mods, held_mods = split_modules(modules, spec.heldout_fraction)
    counts = build_stdlib_chats(paths.train_chats.parent, modules, spec.heldout_fraction,
                                spec.max_train_chats, spec.max_heldout_chats)
    shipped = None if train_target else shipped_target(spec)
    if shipped is not None:
        shutil.copytree(shipped, paths.target_dir, ignore=shutil.ignore_patterns("spec.json", "README.md"))
        metrics = json.loads(paths.metrics.read_text("utf-8"))
        metrics.update(target="shipped", trained_chats=metrics["chats"], chats=counts,
                       build_seconds=round(time.perf_counter() - start, 2))
        paths.metrics.write_text(json.dumps(metrics, indent=2) + "\n", "utf-8")
        return metrics
    train_rows = [json.loads(line) for line in paths.train_chats.read_text("utf-8").splitlines()]
    held_rows = [json.loads(line) for line in paths.heldout_chats.read_text("utf-8").splitlines()]

    t = spec.target
    tokenizer = build_tokenizer([m.source for m in train_mods]
                                + [r["messages"][0]["content"] for r in train_rows],
                                spec.vocab_size, t.max_position_embeddings)
    texts = [m.source for m in train_mods] + [
        render_training_chat(tokenizer, r["messages"], thinking_off_prompt=i % 2 == 1)
        for i, r in enumerate(train_rows)]
    random.Random(t.seed).shuffle(texts)
    windows = pack_windows(texts, tokenizer, t.seq_len)
    held_windows = pack_windows([m.source for m in held_mods], tokenizer, t.seq_len, t.eval_tokens)

    model = new_model(t, tokenizer)
    stats = train(model, windows, t, on_step=_progress_bar(t.steps) if progress else None)
    metrics = {
        "params": sum(p.numel() for p in model.parameters()), "steps": t.steps,
        "train_tokens_seen": t.steps * t.batch_size * t.seq_len,
        "train_tokens_available": windows.numel(), "train_seconds": round(stats["seconds"], 2),
        "steps_per_s": round(stats["steps_per_s"], 3), "tokens_per_s": round(stats["tokens_per_s"]),
        "final_train_loss": stats["final_loss"],
        "eval_window": t.seq_len, "heldout_source": evaluate(model, held_windows),
        "heldout_chat": evaluate(model, *chat_eval_batch(tokenizer, held_rows)),
        "heldout_chat_no_think": evaluate(model, *chat_eval_batch(tokenizer, held_rows, True)),
        "chats": counts, "python": platform.python_version(), "torch": torch.__version__,
        "target": "trained",
    }
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(paths.target_dir, safe_serialization=True)
    tokenizer.save_pretrained(paths.target_dir, save_jinja_files=False)
    metrics["build_seconds"] = round(time.perf_counter() - start, 2)
    paths.metrics.write_text(json.dumps(metrics, indent=2) + "\n", "utf-8")
    return metrics


def _progress_bar(total: int):
    """An ``on_step(step, loss)`` callback drawing a tqdm bar that closes itself at ``total``."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="train target", unit="step")

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if step == total:
            bar.close()
    return on_step


def _check_spec(path: Path, spec: BuildSpec) -> None:
    found = json.loads((path / "spec.json").read_text("utf-8"))
    wanted = _spec_json(spec)
    if found != wanted:
        diff = sorted(k for k in wanted if found.get(k) != wanted[k])
        raise EmbeddedSpecMismatch(
            f"{path} was built with a different spec (fields {diff}: found "
            f"{ {k: found.get(k) for k in diff} }, wanted { {k: wanted[k] for k in diff} }); "
            "delete that folder to rebuild, or pass another home / set DSPARK_HOME")


def ensure_embedded(home: str | Path | None = None, spec: BuildSpec = BuildSpec(),
                    progress: bool = False, train_target: bool = False) -> EmbeddedPaths:
    """Return the embedded build under ``home``, building it first if needed (minutes, once).

    Args:
        home: cache root; default ``default_home()``. The build lives in
            ``<home>/embedded-v1-py<major>.<minor>/`` (the stdlib differs between Pythons).
        spec: the build's knobs; tests pass small ones with their own ``home``.
        progress: show a progress bar while training.
        train_target: train the target even where the package ships it (:func:`build_embedded`);
            only for a folder not built yet.

    Returns:
        ``EmbeddedPaths`` of the complete build. A complete build is reused at once; concurrent
        callers wait on a file lock and the second reuses the first's build.

    Raises:
        EmbeddedSpecMismatch: if the folder exists with a different ``spec``.
    """
    root = Path(home) if home is not None else default_home()
    name = f"embedded-{VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    final = root / name
    if not final.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not final.is_dir():
                for stale in root.glob(f".{name}.tmp-*"):
                    shutil.rmtree(stale)
                tmp = root / f".{name}.tmp-{os.getpid()}"
                what = ("stdlib chats (the target ships with the package)"
                        if shipped_target(spec) and not train_target
                        else "target and stdlib chats (about 6 minutes on 2 cores for the default)")
                print(f"building the embedded {what} into {final} (first use only)", file=sys.stderr, flush=True)
                try:
                    build_embedded(tmp, spec, progress, train_target)
                    (tmp / "spec.json").write_text(json.dumps(_spec_json(spec), indent=2) + "\n")
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
    _check_spec(final, spec)
    return EmbeddedPaths.at(final.resolve())


def resolve_embedded(url: str, home: str | Path | None = None,
                     spec: BuildSpec = BuildSpec()) -> str:
    """Map an ``embedded:`` pseudo-URL to a local path, building the embedded data on first use.

    ``embedded:tiny`` -> the target folder (model + tokenizer); ``embedded:stdlib/train.jsonl``
    and ``embedded:stdlib/heldout.jsonl`` -> the chat files. ``home`` and ``spec`` are passed to
    ``ensure_embedded``.

    Raises:
        ValueError: for any other URL (the message lists the known ones).
        EmbeddedSpecMismatch: as ``ensure_embedded``.
    """
    if url not in URLS:
        raise ValueError(f"unknown embedded URL {url!r}: use one of {', '.join(URLS)}")
    paths = ensure_embedded(home, spec, progress=True)
    return str({URLS[0]: paths.target_dir, URLS[1]: paths.train_chats,
                URLS[2]: paths.heldout_chats}[url])
