"""Calibrate stage: sequential temperature scaling (STS) of each drafter's confidence head.

For every trained drafter with a confidence head, the drafter runs over the **held-out** cache
shards (``training.data.split_shards``: the last ``train.heldout_shards`` non-empty shards; at most
``calibrate.max_samples`` of their samples, the first ones in stored order: :func:`select_heldout`) with
blocks at anchors drawn from a fixed seed, exactly as in training (teacher forcing). Each block
gives, per predicting position k = 1..gamma, the confidence logit ``z_k`` and the label ``c*_k =
1 - 0.5 ||p_d - p_t||_1`` (the expected acceptance of that slot given an accepted prefix, DSpark
sec. 3.3), valid on the block's supervised prefix. The blocks are split by batch: even batches fit,
odd batches report (so the "after" figures are out-of-sample). :func:`training.sts.fit_temperatures`
fits ``T_1..T_gamma`` left to right (DSpark sec. 3.2.1, STS), minimising the equal-width-bin ECE of
the survival ``a_k = prod_{i<=k} sigmoid(z_i / T_i)`` against ``prod_{i<=k} c*_i``, with the guards
recorded in the report's ``sts`` entry: temperatures bounded to ``[t_min, t_max]``, the Brier score
deciding where the ECE is flat (within ``ece_tol`` of its minimum), and a position with fewer than
``min_blocks`` fitting blocks keeping the previous position's temperature; ``at_bounds`` lists the
positions whose temperature still sits at a bound. :func:`training.sts.fit_global_temperature` fits
the one temperature that the export folds into the head (what vLLM's raw sigmoid can express).

Which labels (``train.drafters.<name>.confidence_calibration``): ``realised`` (default) fits and reports
on the realised 0/1 prefix survival ``1[accepted >= k]`` of the drafter's own drafts, sampled at the
head's serving setting (``confidence_temperature`` / ``_top_p`` / ``_top_k`` of the run config at calibrate
time, default the generate stage's setting, :func:`pipeline.config.confidence_sampling`)
and verified by speculative sampling against the cached target distribution on the same held-out
blocks (:func:`realised_confidence`, the block-level evaluation's
``training.block_runner.evaluate_blocks``); ``expected`` on the teacher-forced ``c*_k`` at T = 1
(:func:`collect_confidence`). The survival is what a serving engine's scheduler ranks and what the
decoding loop realises (docs/results.md: a head calibrated on ``c*`` is over-confident on decoding
rounds).

The on-policy refit (first, ``calibrate.refit_prompts`` > 0): the drafter decodes the prompts of the
first held-out samples with the target at its head's setting and, with ``calibrate.refit_greedy``,
greedily (:func:`refit_settings`), and its head is refitted on the realised
acceptance of its own drafts (:mod:`training.confidence_refit`; teacher forcing is why the trained head
ranks decoding rounds worse than max-q: docs/confidence.md). It is adopted when it ranks the odd
prompts' slots better than the trained head; STS then calibrates whichever head is kept.

Outputs under ``<run_dir>/calibrate/<drafter>/``: ``report.json`` (temperatures; ECE, Brier and AUC
per position before and after; the refit's figures), ``confidence_head.safetensors`` (the adopted
refitted head, :func:`pipeline.drafters.save_calibrated_head`; export and evaluate load it),
``gate_rounds.safetensors`` (the kept head's own decoding rounds on the next ``calibrate.gate_prompts``
held-out prompts at its setting, :func:`gate_rounds`: where evaluate fits its estimators and decides
where adaptive verification runs),
``reliability.png`` and ``confidence.safetensors`` (the ``z``, ``y``,
``valid`` arrays, so that the export stage can report the ECE of the confidence as vLLM sees it).
The evaluate stage judges every estimator again on the decoding loop's rounds of held-out prompts.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import RunConfig, confidence_sampling
from pipeline.errors import ConfigError, PipelineError
from storage import filesystem, join, read_json, read_tensors, write_json, write_tensors

log = logging.getLogger("pipeline.stages.calibrate")

__all__ = ["ConfidenceSet", "HeldoutSelection", "select_heldout", "heldout_batches", "collect_confidence",
           "realised_confidence", "calibrate_drafter", "save_confidence", "load_confidence", "task_options", "task_device", "run_task",
           "gate_rounds_url", "gate_rounds", "run_calibrate"]

LABEL_KINDS = {"expected": "expected_acceptance",  # c*_k = 1 - 0.5 ||p_d - p_t||_1 from the cached target states
               "realised": "realised_acceptance"}  # 1[accepted >= k] of the drafter's own drafts at its T


@dataclass
class ConfidenceSet:
    """Per-block confidence logits and labels of one drafter on held-out data.

    Attributes:
        z: [N, gamma] float32 confidence logits (0 where not valid).
        y: [N, gamma] float32 labels ``c*_k`` in [0, 1] (0 where not valid).
        valid: [N, gamma] bool, each block's supervised prefix (blocks with no valid slot dropped).
        batch: [N] int64 index of the held-out batch each block came from, or None (unknown).
    """

    z: torch.Tensor
    y: torch.Tensor
    valid: torch.Tensor
    batch: torch.Tensor | None = None

    def split(self) -> tuple["ConfidenceSet", "ConfidenceSet"]:
        """(fit, report) halves: even / odd batches, or even / odd rows when fewer than 2 batches."""
        key = self.batch if self.batch is not None and self.batch.unique().numel() > 1 else torch.arange(self.num_blocks)
        fit = key % 2 == 0
        part = lambda m: ConfidenceSet(self.z[m], self.y[m], self.valid[m],  # noqa: E731
                                       None if self.batch is None else self.batch[m])
        return part(fit), part(~fit)

    @property
    def num_blocks(self) -> int:
        """Blocks N (rows)."""
        return self.z.shape[0]


@dataclass(frozen=True)
class HeldoutSelection:
    """The held-out samples calibrate reads: the first ``samples_used`` of the held-out shards' samples
    in stored order (shard by shard, each shard's samples in order), so every rerun reads the same ones.

    Attributes:
        shards: the held-out shards read, in order (a prefix of the split's held-out shards: those
            holding the used samples). samples_used: samples read (and run through the drafter).
        samples_available: samples in all the held-out shards.
    """

    shards: tuple[int, ...]
    samples_used: int
    samples_available: int


def select_heldout(counts: Mapping[int, int], heldout: Sequence[int], max_samples: int | None) -> HeldoutSelection:
    """Choose calibrate's held-out samples: the first ``max_samples`` of ``heldout``'s samples in
    stored order, or all of them when ``max_samples`` is None (or not below their number).

    Args:
        counts: samples per shard (``ShardSplit.counts``: the committed records' ``num_samples``).
        heldout: the held-out shard indices in reading order (``ShardSplit.heldout``).
        max_samples: the cap (``calibrate.max_samples``, samples, >= 1), or None for all.
    Returns:
        the :class:`HeldoutSelection`.
    Raises:
        ConfigError: ``max_samples`` < 1 (set ``calibrate.max_samples`` >= 1, or null for all).
    """
    if max_samples is not None and max_samples < 1:
        raise ConfigError(f"calibrate.max_samples: must be >= 1 held-out samples, or null to use all "
                          f"(got {max_samples})")
    available = sum(int(counts[s]) for s in heldout)
    used = available if max_samples is None else min(max_samples, available)
    shards, seen = [], 0
    for s in heldout:
        if seen >= used:
            break
        shards.append(s)
        seen += int(counts[s])
    return HeldoutSelection(tuple(shards), used, available)


def heldout_batches(reader, selection: HeldoutSelection, micro_batch: int) -> Iterator[list[dict]]:
    """The selected held-out samples, read lazily in lists of ``micro_batch`` sample mappings
    (``training.data.as_mapping``; the last list may be shorter): no sample past
    ``selection.samples_used`` is ever read from the cache.

    Args:
        reader: a :class:`cache_schema.CacheReader` of the cache (``iter_samples``).
        selection: from :func:`select_heldout`. micro_batch: samples per list (>= 1).
    Raises:
        ShardNotCommittedError, MissingObjectError: as ``CacheReader.iter_samples``.
    """
    from training.data import as_mapping

    samples = itertools.islice(reader.iter_samples(selection.shards), selection.samples_used)
    while batch := [as_mapping(s) for s in itertools.islice(samples, micro_batch)]:
        yield batch


def collect_confidence(model, batches: Iterable[Sequence[Mapping[str, torch.Tensor]]], loss_cfg, *,
                       seed: int) -> ConfidenceSet:
    """Run a drafter over cache samples and arrange its confidence logits and ``c*`` labels per block.

    Anchors are drawn as in training (``model.make_blocks``, ``config.num_anchors`` per sample) from a
    generator seeded with ``seed + i`` for the i-th batch, so the set is a pure function of
    (weights, samples, seed).

    Args:
        model: a :class:`training.drafter.Drafter` with a confidence head (eval mode is set here).
        batches: lists of cache sample mappings (``training.data.as_mapping``).
        loss_cfg: :class:`training.losses.LossConfig` (only ``chunk_size`` matters for ``c*``).
        seed: anchor seed.
    Returns:
        :class:`ConfidenceSet` with ``gamma = model.config.block_size`` columns.
    Raises:
        ValueError: the drafter has no confidence head, or the batches hold no supervised block.
    """
    from training.blocks import collate_samples
    from training.data import module_device, to_device

    if model.confidence_head is None:
        raise PipelineError("this drafter has no confidence head: nothing to calibrate (set "
                         "train.drafters.<name>.confidence_head=true and retrain)")
    gamma, dev = model.config.block_size, module_device(model)
    zs, ys, vs, bs = [], [], [], []
    model.eval()
    with torch.no_grad():
        for i, samples in enumerate(batches):
            batch = collate_samples(samples)  # anchors from a CPU generator on the CPU batch: any device, same blocks
            blocks = model.make_blocks(batch, torch.Generator().manual_seed(seed + i))
            slots = model(*to_device((batch, blocks), dev))
            out = model.loss(slots, loss_cfg)
            z = torch.zeros(slots.num_blocks, gamma, device=dev)
            y = torch.zeros(slots.num_blocks, gamma, device=dev)
            valid = torch.zeros(slots.num_blocks, gamma, dtype=torch.bool, device=dev)
            z[slots.block, slots.slot] = slots.confidence_logits.float()
            y[slots.block, slots.slot] = out.c_star.float()
            valid[slots.block, slots.slot] = True
            keep = valid[:, 0]
            zs.append(z[keep])
            ys.append(y[keep])
            vs.append(valid[keep])
            bs.append(torch.full((int(keep.sum()),), i, dtype=torch.long, device=dev))
    if not zs or sum(v.shape[0] for v in vs) == 0:
        raise PipelineError("the held-out samples hold no supervised block: cache more rows or raise "
                         "train.heldout_shards")
    return ConfidenceSet(*(torch.cat(t).cpu() for t in (zs, ys, vs, bs)))


def realised_confidence(model, batches: Iterable[Sequence[Mapping[str, torch.Tensor]]], *, sampling,
                        num_anchors: int, seed: int) -> tuple[ConfidenceSet, float]:
    """The drafter's confidence logits against the realised acceptance of its own drafts on cache blocks.

    Anchors are those of :func:`collect_confidence` (``sample_anchors`` seeded ``seed + i`` for the
    i-th batch, ``num_anchors`` per sample); each block is drafted at the setting ``sampling`` and verified by
    speculative sampling against the cached target distribution
    (``training.block_runner.evaluate_blocks(records=...)``, uniforms a pure function of
    ``(seed, batch)``), so the set is a pure function of (weights, samples, seed, temperature).

    Args:
        model: a :class:`training.drafter.Drafter` with a confidence head. batches: lists of cache
            sample mappings. sampling: the setting of the drafts and the target, a temperature T >= 0
            (0 = greedy) or a :class:`training.spec_sampling.Sampling` (top-p / top-k).
        num_anchors: anchors per sample. seed: anchors and uniforms.
    Returns:
        ``(set, tau_expected)``: the :class:`ConfidenceSet` (``z`` the logits [N, gamma], ``y`` the prefix
        survival ``1[accepted >= k]`` (0/1 float32), ``valid`` ``k <= verified`` (the block's supervised
        prefix), ``batch``) and the mean over the same blocks of ``1 + sum_j prod_{i<=j} c*_i`` at T = 1
        (the figure :func:`collect_confidence`'s labels give, :func:`training.losses.expected_tau`).
    Raises:
        PipelineError: no confidence head, or no supervised block in ``batches``.
        ValueError: a sampling setting out of range.
    """
    from training.block_runner import evaluate_blocks

    if model.confidence_head is None:
        raise PipelineError("this drafter has no confidence head: nothing to calibrate (set "
                            "train.drafters.<name>.confidence_head=true and retrain)")
    records: dict = {}
    settings = [sampling] if sampling == 1.0 else [sampling, 1.0]
    tally = evaluate_blocks({"drafter": model}, batches, temperatures=settings, num_anchors=num_anchors, seed=seed,
                            records=records)
    rec = {k: torch.cat(v) for k, v in next(iter(records.values()), {}).items()}
    if not rec or rec["accepted"].numel() == 0:
        raise PipelineError("the held-out samples hold no supervised block: cache more rows or raise "
                            "train.heldout_shards")
    k = torch.arange(1, model.config.block_size + 1)
    data = ConfidenceSet(rec["z"].float(), (rec["accepted"][:, None] >= k).float(), rec["verified"][:, None] >= k,
                         rec["group"].long())
    return data, float(tally.values("drafter", 1.0, "tau_expected").mean())


def calibrate_drafter(data: ConfidenceSet, *, n_bins: int, grid_step: float, label: str = "expected"
                      ) -> dict[str, Any]:
    """Fit STS temperatures and the global temperature on the fit half of ``data`` and report the
    calibration on the other half (:meth:`ConfidenceSet.split`; DSpark sec. 3.2.1).

    Args:
        data: confidence logits, labels and prefix mask. n_bins: ECE bins. grid_step: coarse search
            step for each ``T_k`` (refined tenfold around the best point). label: what ``data.y`` is,
            ``"expected"`` (``c*``) or ``"realised"`` (0/1 survival).
    Returns:
        :func:`training.sts.calibration_report` on the report half (``before``, ``after`` = STS,
        ``global``) plus ``global_temperature``, ``num_blocks``, ``fit_blocks``, ``report_blocks``,
        ``label`` (``"expected_acceptance"`` or ``"realised_acceptance"``) and ``sts``: the guards ``{"t_min", "t_max", "ece_tol",
        "min_blocks", "at_bounds" (1-based positions), "global_at_bound"}``.
    Raises:
        ValueError: as :func:`training.sts.fit_temperatures`.
    """
    from training.sts import (ECE_TOL, MIN_BLOCKS, T_MAX, T_MIN, at_bounds, calibration_report,
                              fit_global_temperature, fit_temperatures)

    fit, held = data.split()
    T = fit_temperatures(fit.z, fit.y, fit.valid, n_bins=n_bins, grid_step=grid_step)
    T_g = fit_global_temperature(fit.z, fit.y, fit.valid, n_bins=n_bins)
    report = calibration_report(held.z, held.y, held.valid, T, n_bins=n_bins, global_temperature=T_g)
    return {**report, "global_temperature": T_g, "num_blocks": data.num_blocks, "fit_blocks": fit.num_blocks,
            "report_blocks": held.num_blocks, "label": LABEL_KINDS[label],
            "sts": {"t_min": T_MIN, "t_max": T_MAX, "ece_tol": ECE_TOL, "min_blocks": MIN_BLOCKS,
                    "at_bounds": at_bounds(T), "global_at_bound": bool(at_bounds([T_g]))}}


def save_confidence(url: str, data: ConfidenceSet) -> None:
    """Write ``z``, ``y``, ``valid`` (uint8) and ``batch`` (if known) to a safetensors file at ``url``."""
    tensors = {"z": data.z, "y": data.y, "valid": data.valid.to(torch.uint8)}
    if data.batch is not None:
        tensors["batch"] = data.batch
    write_tensors(url, tensors)


def load_confidence(url: str) -> ConfidenceSet:
    """Read what :func:`save_confidence` wrote. Raises FileNotFoundError if absent."""
    t = read_tensors(url)
    return ConfidenceSet(t["z"], t["y"], t["valid"].bool(), t.get("batch"))


TASK_RETRIES = 2
"""Reruns of a stage task whose worker process or node was lost (Ray's ``max_retries``: system failures
only, so an exception raised by the task itself surfaces at once), as ``train.max_failures``."""


def task_options(gpus: float, cpus: float, name: str) -> dict[str, Any]:
    """Ray options of a stage's task (``ray.remote(**options)``): ``num_gpus``, ``num_cpus``,
    ``max_retries`` (:data:`TASK_RETRIES`: a lost node or worker reruns the task from its start), the task's name.

    Raises:
        ConfigError: ``gpus`` < 0 or ``cpus`` <= 0 (set ``<stage>.gpus`` >= 0 and ``<stage>.cpus`` > 0).
    """
    if gpus < 0 or cpus <= 0:
        raise ConfigError(f"{name}: need gpus >= 0 and cpus > 0 for its Ray task, got gpus={gpus}, cpus={cpus}: "
                          f"set {name}.gpus (0 = run in the driver on its CPU) and {name}.cpus")
    return {"num_gpus": gpus, "num_cpus": cpus, "max_retries": TASK_RETRIES, "name": f"dspark-{name}"}


def _attempt(url: str, fn, *args):
    """A stage task's body: record this attempt (``{"started_at": Unix seconds, "node": Ray node id}``
    as ``<url>/<ns>.json``), then ``fn(*args)``."""
    import ray

    write_json(join(url, f"{time.time_ns()}.json"),
               {"started_at": time.time(), "node": ray.get_runtime_context().get_node_id()})
    return fn(*args)


def task_faults(attempts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What lost nodes or workers cost a stage task, from its attempt records (:func:`_attempt`):
    ``task_attempts`` (1 undisturbed), ``nodes`` (distinct nodes the attempts ran on) and
    ``retry_seconds`` (wall seconds from the first attempt's start to the last one's: the work lost
    with the failed attempts plus the time to detect the loss and reschedule)."""
    starts = sorted(a["started_at"] for a in attempts)
    return {"task_attempts": len(starts), "nodes": len({a["node"] for a in attempts}),
            "retry_seconds": round(starts[-1] - starts[0], 2) if starts else 0}


def task_device() -> str:
    """Where a stage task runs its models: ``"cuda"`` when Ray gave it a GPU (``CUDA_VISIBLE_DEVICES``)
    and torch sees one, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_task(cfg: RunConfig, fn, *args, gpus: float, cpus: float, name: str) -> tuple[Any, dict[str, Any] | None]:
    """``fn(*args)`` where the accelerator is: with ``gpus`` > 0 as one Ray task asking for
    ``num_gpus=gpus`` and ``num_cpus=cpus`` (:func:`task_options`) on the cluster :func:`pipeline.cluster.init_ray`
    joins (the job's runtime env ships the code), its result returned to the driver; with ``gpus`` 0
    in this process (a CPU run as before: no Ray start-up, the same results bit for bit).

    Returns:
        ``(result, faults)``: ``faults`` is :func:`task_faults` over the task's attempts (recorded under
        ``<run_dir>/<name>/attempts/``), None in this process.

    Raises:
        ConfigError: as :func:`task_options`. Whatever ``fn`` raises (through Ray a ``RayTaskError`` that
            is also an instance of the original exception's class, with the worker's traceback).
    """
    options = task_options(gpus, cpus, name)
    if gpus == 0:
        return fn(*args), None
    import ray

    from pipeline.cluster import init_ray

    init_ray(cfg.ray)
    url = join(cfg.run_dir, name, "attempts", str(time.time_ns()))
    result = ray.get(ray.remote(**options)(_attempt).remote(url, fn, *args))
    fs, path = filesystem(url)
    return result, task_faults([read_json(join(url, f.rsplit("/", 1)[-1])) for f in fs.ls(path, detail=False)])


def prompt_start(cfg: RunConfig, selection: HeldoutSelection) -> int:
    """Index of the first held-out sample whose prompt the refit and the gate rounds take: the first
    sample past both calibrate's STS samples (``selection.samples_used``) and evaluate's block-level
    samples (``evaluate.block_samples``, the first of the same held-out shards) when the held-out
    shards hold ``calibrate.refit_prompts + calibrate.gate_prompts`` more, so that no conversation is
    both fitted on and reported on; else 0, the same conversations reused (the tiny default holds 128
    held-out samples and uses all of them in both; the Qwen3-4B recipe reads 256 of ~2,048)."""
    after = max(selection.samples_used, cfg.evaluate.block_samples)
    need = cfg.calibrate.refit_prompts + cfg.calibrate.gate_prompts
    return after if selection.samples_available - after >= need else 0


def sample_prompts(reader, heldout: Sequence[int], start: int, count: int) -> list[list[int]]:
    """The prompts of ``count`` held-out samples from sample ``start`` of the ``heldout`` shards (in
    stored order): each sample's ``input_ids`` up to its first supervised token (the rendered
    conversation before the first assistant answer, with the generation prompt), samples with no
    supervised token skipped. Reads token arrays only (``CacheReader.sample_tokens``).

    Raises:
        ShardNotCommittedError, MissingObjectError: as ``CacheReader.sample_tokens``.
    """
    out = []
    for ids, mask in itertools.islice(reader.sample_tokens(heldout), start, None):
        if len(out) == count:
            break
        first = torch.as_tensor(mask).nonzero()
        if first.numel() and int(first[0, 0]) > 0:
            out.append(ids[: int(first[0, 0])].tolist())
    return out


def gate_rounds_url(cfg: RunConfig, name: str) -> str:
    """Where calibrate writes drafter ``name``'s gate rounds (:func:`gate_rounds`) and evaluate reads them."""
    return join(cfg.run_dir, "calibrate", name, "gate_rounds.safetensors")


def decode_prompts(target, tap, stop: set[int], drafter, prompts: Sequence[Sequence[int]], *, sampling,
                   max_new_tokens: int, seed: int, keep_confidence_inputs: bool = False) -> list:
    """The drafter's own decoding of ``prompts`` (:func:`pipeline.inference.speculate.speculative_decode` at
    ``sampling``, every block verified; one generator on the target's device seeded ``seed``, prompts in
    order): a pure function of (weights, prompts, setting, seed).

    Returns:
        one ``pipeline.inference.speculate.Decoded`` per prompt (its rounds with the confidence head's
        inputs [gamma, D] when ``keep_confidence_inputs``). Raises nothing of its own (``sampling`` is
        validated where it is built: :class:`training.spec_sampling.Sampling`).
    """
    from pipeline.inference.speculate import device_generator, speculative_decode

    gen = device_generator(target.device, seed)
    return [speculative_decode(target, drafter, ids, tap=tap, max_new_tokens=max_new_tokens, temperature=sampling,
                               stop_ids=stop, generator=gen, keep_confidence_inputs=keep_confidence_inputs)
            for ids in prompts]


def onpolicy_rounds(target, tap, stop: set[int], drafter, prompts: Sequence[Sequence[int]], *, sampling,
                    max_new_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The drafter's own decoding rounds on ``prompts`` (:func:`decode_prompts`), arranged as the refit's rows.

    Args:
        target: the frozen target (HF causal LM, eval). tap: a ``LayerTap`` on it at the drafter's layer
            ids. stop: stop ids. drafter: a drafter with a confidence head. prompts: token id lists.
        sampling: a T >= 0 or a :class:`training.spec_sampling.Sampling`. max_new_tokens: per prompt.
        seed: the generator seed.
    Returns:
        ``(x [n, D] float32, y [n] float32, group [n] int64 prompt index, z [n] float32 the trained
        head's logits)`` over the reached slots (:func:`training.confidence_refit.reached_rows`).
    """
    from training.confidence_refit import reached_rows

    xs, ys, gs, zs = [], [], [], []
    for p, decoded in enumerate(decode_prompts(target, tap, stop, drafter, prompts, sampling=sampling,
                                               max_new_tokens=max_new_tokens, seed=seed, keep_confidence_inputs=True)):
        rounds = decoded.rounds
        if not rounds:
            continue
        x, y, r, k = reached_rows(torch.stack([rd.confidence_input for rd in rounds]),
                                  torch.tensor([rd.accepted for rd in rounds]), torch.tensor([rd.verified for rd in rounds]))
        z = torch.tensor([rd.confidence_logits for rd in rounds], dtype=torch.float32)
        xs.append(x), ys.append(y), gs.append(torch.full_like(r, p)), zs.append(z[r, k])
    if not xs:
        raise PipelineError(f"calibrate: no decoding round on {len(prompts)} refit prompts (each stopped at once): "
                            "raise calibrate.refit_prompts or set it to 0")
    return tuple(torch.cat(t) for t in (xs, ys, gs, zs))


def gate_rounds(cfg: RunConfig, model, target, tap, stop: set[int], prompts: Sequence[Sequence[int]], sampling,
                head: str) -> tuple[Any, dict[str, Any]]:
    """The gate rounds: ``model`` (with the head calibrate keeps) decodes ``prompts`` at ``sampling`` (the
    head's serving setting; ``calibrate.refit_max_new_tokens`` each, seed ``train.seed + 1``), every block
    verified. These on-policy rounds, of prompts the refit does not use (nor, where the held-out shards
    hold enough, STS or evaluate's block level: :func:`prompt_start`; evaluate decodes prompts of other
    files), are where
    evaluate fits its estimators at that setting and decides at which concurrency adaptive verification
    runs (:func:`pipeline.inference.realised.compare`): teacher-forced blocks misjudge both (docs/confidence.md).

    Returns:
        ``(outcomes, report)``: a :class:`pipeline.inference.realised.Outcomes` (group = prompt index) and
        ``{"prompts", "rounds", "full_blocks", "sampling" ({temperature, top_p, top_k}), "head"
        (``head``: the :func:`pipeline.drafters.head_digest` of the float32 head ``model`` carries, taken
        by the caller before the device cast), "seconds"}``; without a
        prompt or a round: ``(None, {"skipped": reason, "prompts"})`` (no error raised for either).
    """
    from pipeline.inference.realised import from_rounds

    if not prompts:
        return None, {"skipped": "no held-out sample left after the refit's prompts (calibrate.gate_prompts, "
                                 "train.heldout_shards)", "prompts": 0}
    t0 = time.perf_counter()
    runs = decode_prompts(target, tap, stop, model, prompts, sampling=sampling,
                          max_new_tokens=cfg.calibrate.refit_max_new_tokens, seed=cfg.train.seed + 1)
    try:
        data = from_rounds(runs)
    except ValueError as e:
        return None, {"skipped": str(e), "prompts": len(prompts)}
    return data, {"prompts": len(prompts), "rounds": data.num_blocks, "full_blocks": data.full().num_blocks,
                  "sampling": sampling.to_dict(), "head": head, "seconds": time.perf_counter() - t0}


def refit_settings(cfg: RunConfig, sampling: "float | Sampling") -> list:
    """The sampling settings the on-policy refit decodes its prompts at: the head's serving setting
    ``sampling`` first, then greedy decoding (T = 0) when ``calibrate.refit_greedy`` and the serving
    setting samples. One exported head serves every request of a deployment, greedy ones included, and
    greedy acceptance, ``1[argmax q = argmax p]``, is another function of the head's inputs than sampled
    acceptance: rows of both teach the head both (docs/confidence.md, "The on-policy refit").

    Args:
        cfg: the run config (``calibrate.refit_greedy``). sampling: the head's serving setting (a plain
            float is that temperature, untruncated).
    Returns:
        list of :class:`training.spec_sampling.Sampling`, no duplicates.
    """
    from training.spec_sampling import Sampling

    sampling = Sampling.of(sampling)
    return [sampling] + ([Sampling(0.0)] if cfg.calibrate.refit_greedy and sampling.temperature > 0 else [])


def refit_confidence_head(cfg: RunConfig, model, target, tap, stop: set[int], prompts: Sequence[Sequence[int]],
                          sampling, replaces: str) -> dict[str, Any]:
    """The on-policy refit of ``model``'s confidence head (:mod:`training.confidence_refit`): its own
    decoding rounds on ``prompts`` at each of :func:`refit_settings` (the head's serving setting
    ``sampling``, and greedy decoding by default), their reached slots pooled (a prompt's rows of every
    setting on the same side of the even / odd split), the logistic fit, and the new head put into
    ``model`` when it ranks the odd prompts' slots better than the trained head (AUC pooled over the
    settings; per setting in the report). A setting without a round skips the whole refit.

    Returns:
        ``{"adopted", "seconds" (decoding and fit), "prompts", "settings" ([{temperature, top_p, top_k}]),
        "slots_per_setting" (list[int], in ``settings`` order), "heldout_auc_by_setting" ([{"refit",
        "trained"}] in that order), "slots" (reached slots fitted), "accepted_slots", "l2", "heldout_auc": {"refit",
        "trained"}, "heldout_logloss": {...}, "weight" [1, D] float32, "bias" [1] float32, "replaces"}``
        (the fitted head, adopted or not; ``replaces`` as given: the trained head's
        :func:`pipeline.drafters.head_digest` on the checkpoint's float32 weights, which export and evaluate compare).
        Too few rounds to fit (no round, fewer than 2 prompts on a side, one class only): ``{"adopted": False,
        "skipped": reason, "seconds", "prompts"}``, the trained head kept.
    """
    from training.confidence_refit import fit_logistic_head

    t0 = time.perf_counter()
    settings = refit_settings(cfg, sampling)
    try:
        parts = [onpolicy_rounds(target, tap, stop, model, prompts, sampling=s,
                                 max_new_tokens=cfg.calibrate.refit_max_new_tokens, seed=cfg.train.seed)
                 for s in settings]
        per_setting = [len(part[1]) for part in parts]
        x, y, group, z = (torch.cat([part[i] for part in parts]) for i in range(4))
        del parts  # the rows are held once during the fit
        fit = fit_logistic_head(x, y, group, z, part=torch.repeat_interleave(torch.arange(len(settings)),
                                                                             torch.tensor(per_setting)))
    except (ValueError, PipelineError) as e:  # too few rounds or one class only: keep the trained head
        log.warning("calibrate: no on-policy refit of the confidence head: %s", e)
        return {"adopted": False, "skipped": str(e), "seconds": time.perf_counter() - t0, "prompts": len(prompts)}
    adopted = fit.heldout_auc["refit"] > fit.heldout_auc["trained"]
    if adopted:
        proj = model.confidence_head.proj
        with torch.no_grad():
            proj.weight.copy_(fit.weight.to(proj.weight))
            proj.bias.copy_(fit.bias.to(proj.bias))
    return {"adopted": adopted, "seconds": time.perf_counter() - t0, "prompts": len(prompts),
            "settings": [s.to_dict() for s in settings], "slots_per_setting": per_setting,
            "slots": fit.rows, "accepted_slots": fit.positives,
            "l2": fit.l2, "heldout_auc": fit.heldout_auc, "heldout_auc_by_setting": fit.heldout_auc_by_part,
            "heldout_logloss": fit.heldout_logloss,
            "weight": fit.weight, "bias": fit.bias, "replaces": replaces}


def collect_all(cfg: RunConfig, names: Sequence[str], selection: HeldoutSelection, heldout: Sequence[int]
                ) -> dict[str, tuple[ConfidenceSet, float, dict | None, tuple | None]]:
    """``{name: (ConfidenceSet, tau_expected, refit, gate)}`` for each drafter in ``names``: first the on-policy
    refit of its head (:func:`refit_confidence_head` on the prompts of ``calibrate.refit_prompts`` samples of
    the ``heldout`` shards from :func:`prompt_start`; ``refit`` None when that is 0), then, with the head it
    keeps, the gate rounds on the prompts of the next ``calibrate.gate_prompts`` samples (:func:`gate_rounds`;
    ``gate`` None when that is 0), and the
    :class:`ConfidenceSet` over the ``selection`` of held-out samples on the labels its
    ``confidence_calibration`` names (:func:`realised_confidence` or :func:`collect_confidence`) and its
    held-out ``tau_expected`` at T = 1 (``1 + sum_j prod_{i<=j} c*_i``, block mean). Each drafter runs on
    :func:`task_device` in the target's dtype on a GPU (float32 on the CPU, as trained there): the
    body of calibrate's task."""
    from cache_schema import CacheReader
    from pipeline.drafters import head_digest, load_trained_drafter
    from pipeline.stages.cache import cache_url
    from pipeline.stages.train import expected_fingerprint
    from pipeline.config import torch_dtype
    from pipeline.target_model.loader import resolve_target_path
    from training.block_runner import eval_drafter
    from training.losses import LossConfig, expected_tau
    from training.spec_sampling import Sampling

    device = task_device()
    dtype = torch_dtype(cfg.target.dtype) if device != "cpu" else None
    target_dir = resolve_target_path(cfg.target.path)
    reader = CacheReader(cache_url(cfg), expected_fingerprint(cfg, target_dir))
    loss_cfg = LossConfig(ce_weight=cfg.train.loss_ce, tv_weight=cfg.train.loss_tv,
                          confidence_weight=cfg.train.loss_conf, decay_lambda=cfg.train.decay_lambda)
    target, n_refit = None, cfg.calibrate.refit_prompts
    if (n_refit or cfg.calibrate.gate_prompts) and names:
        from pipeline.target_model.loader import load_target, stop_ids
        from pipeline.target_model.prefill import LayerTap

        target, tok, _ = load_target(cfg.target, device)
        tap, stop = LayerTap(target, cfg.target.target_layer_ids), stop_ids(target, tok)
        prompts = sample_prompts(reader, heldout, prompt_start(cfg, selection), n_refit + cfg.calibrate.gate_prompts)
    out = {}
    for name in names:
        model = load_trained_drafter(cfg, name, target_dir)
        trained = None if target is None else head_digest(model)  # float32, before the cast to the target's dtype on a GPU
        model = eval_drafter(model, device, dtype)
        sampling = Sampling(*confidence_sampling(cfg.train.drafters[name], cfg))  # the run config's, not the record's
        refit = None if target is None or not n_refit else refit_confidence_head(cfg, model, target, tap, stop,
                                                                                 prompts[:n_refit], sampling, trained)
        kept = head_digest((refit["weight"], refit["bias"])) if refit and refit["adopted"] else trained
        gate = None if target is None or not cfg.calibrate.gate_prompts else gate_rounds(
            cfg, model, target, tap, stop, prompts[n_refit:], sampling, kept)
        batches = heldout_batches(reader, selection, cfg.train.micro_batch_samples)
        if cfg.train.drafters[name].confidence_calibration == "realised":
            data, tau = realised_confidence(model, batches, sampling=sampling,
                                            num_anchors=model.config.num_anchors, seed=cfg.train.seed)
        else:
            data = collect_confidence(model, batches, loss_cfg, seed=cfg.train.seed)
            tau = float(expected_tau(data.y, data.valid).mean())
        out[name] = data, tau, refit, gate
        del model
    return out


def run_calibrate(cfg: RunConfig) -> dict[str, Any]:
    """``+stage=calibrate``: STS for every trained drafter that has a confidence head.

    Returns:
        ``{"heldout_shards": [...], "samples_used", "samples_available", "drafters": {name: {"temperatures",
        "global_temperature", "at_bounds", "num_blocks", "block_size", "label" (``"realised_acceptance"`` or
        ``"expected_acceptance"``), "confidence_sampling" ({temperature, top_p, top_k}), "heldout_tau_expected", "ece_before",
        "ece_after", "ece_global", "refit" (:func:`refit_confidence_head`'s figures, or None: ``calibrate.refit_prompts``
        0), "gate" (:func:`gate_rounds`'s report, or None: ``calibrate.gate_prompts`` 0), "samples_used",
        "samples_available"} | {"skipped": reason}}}`` with ECE lists per position on the report half (None where undefined); ``heldout_tau_expected`` is the mean over held-out blocks of
        ``1 + sum_j prod_{i<=j} c*_i`` (:func:`training.losses.expected_tau`). ``samples_used`` of the
        ``samples_available`` held-out samples were run (``calibrate.max_samples``: :func:`select_heldout`);
        each drafter's ``report.json`` records both too.
    Raises:
        FingerprintMismatchError: the cache does not fit the config.
        FileNotFoundError: a drafter has no committed checkpoint (run the train stage).
    """
    from cache_schema import CacheReader
    from pipeline.drafters import calibrated_head_url, save_calibrated_head
    from pipeline.inference.realised import save_outcomes
    from pipeline.stages.cache import cache_url
    from pipeline.target_model.loader import resolve_target_path
    from pipeline.stages.train import expected_fingerprint
    from training.data import split_shards
    from training.sts import plot_reliability

    target_dir = resolve_target_path(cfg.target.path)
    reader = CacheReader(cache_url(cfg), expected_fingerprint(cfg, target_dir))
    split = split_shards({s: r.num_samples for s, r in reader.records.items()}, cfg.train.heldout_shards)
    selection = select_heldout(split.counts, split.heldout, cfg.calibrate.max_samples)
    sampled = {"samples_used": selection.samples_used, "samples_available": selection.samples_available}
    summary: dict[str, Any] = {"heldout_shards": list(split.heldout), **sampled, "drafters": {}}
    names = [n for n, spec in cfg.train.drafters.items() if spec.confidence_head]
    sets, summary["faults"] = run_task(cfg, collect_all, cfg, names, selection, split.heldout, gpus=cfg.calibrate.gpus,
                                       cpus=cfg.calibrate.cpus, name="calibrate") if names else ({}, None)
    for name, spec in cfg.train.drafters.items():
        if not spec.confidence_head:
            summary["drafters"][name] = {"skipped": "no confidence head"}
            continue
        data, tau_expected, refit, gate = sets[name]
        label = spec.confidence_calibration
        out = join(cfg.run_dir, "calibrate", name)
        head_url = calibrated_head_url(cfg, name)
        refit_report = None if refit is None else {k: v for k, v in refit.items() if k not in ("weight", "bias", "replaces")}
        outcomes, gate_report = (None, None) if gate is None else gate
        report = {**calibrate_drafter(data, n_bins=cfg.calibrate.bins, grid_step=cfg.calibrate.grid_step, label=label),
                  "confidence_sampling": dict(zip(("temperature", "top_p", "top_k"), confidence_sampling(spec, cfg))),
                  "refit": refit_report, "gate": gate_report, **sampled}
        # An earlier calibrate's report, head and gate rounds go first and the report comes last: a failure
        # in between leaves no report naming files of another run (evaluate and export read the report).
        fs = filesystem(head_url)[0]
        for stale in (join(out, "report.json"), head_url, gate_rounds_url(cfg, name)):
            if fs.exists(filesystem(stale)[1]):
                fs.rm(filesystem(stale)[1])
        if refit is not None and refit.get("adopted"):
            save_calibrated_head(head_url, refit["weight"], refit["bias"], refit["replaces"])
        if outcomes is not None:
            save_outcomes(gate_rounds_url(cfg, name), outcomes)
        write_json(join(out, "report.json"), report)
        save_confidence(join(out, "confidence.safetensors"), data)
        held = data.split()[1]
        plot_reliability(join(out, "reliability.png"), held.z, held.y, held.valid, report["temperatures"],
                         n_bins=cfg.calibrate.bins)
        pos = report["positions"]
        summary["drafters"][name] = {
            "temperatures": report["temperatures"], "global_temperature": report["global_temperature"],
            "at_bounds": report["sts"]["at_bounds"], "num_blocks": data.num_blocks,
            "block_size": data.z.shape[1], "label": report["label"],
            "confidence_sampling": report["confidence_sampling"],
            "heldout_tau_expected": tau_expected,
            "ece_before": [p["before"]["ece"] for p in pos], "ece_after": [p["after"]["ece"] for p in pos],
            "ece_global": [p["global"]["ece"] for p in pos], "refit": refit_report, "gate": gate_report, **sampled}
        log.info("calibrate %s: %d blocks of %d/%d held-out samples, T=%s", name, data.num_blocks,
                 selection.samples_used, selection.samples_available, [round(t, 3) for t in report["temperatures"]])
    return summary
