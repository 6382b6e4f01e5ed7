"""Drafters on held-out cache blocks: their logits, then paired speculative sampling.

:func:`block_slots` lays out one drafter's blocks at given anchors and runs the drafter on the
drafter's device; :func:`slot_logits` turns some of its supervised slots into the draft logits
(backbone + sequential-head bias on the true previous token, DSpark sec. 3.1) and the target logits
(frozen ``lm_head`` on the cached final hidden state). By default every slot's head reads the cached
previous token (teacher forcing), consistent with the cached target distribution, which is conditioned
on the data's tokens. ``sequential=True`` drafts a sequential head slot by slot as it is served
(:func:`sequential_draft_logits`: slot k's head fed the token drawn at slot k - 1); the target's
distribution then stays conditioned on the data's token while the head follows the drawn one, which
penalises DSpark where they differ (the demo, 2026-12-05: DSpark block tau at T=0 2.76 sequential vs
3.84 teacher-forced, against 3.90 in the decoding loop; at T=1 2.47 vs 4.36, against 2.44), so it is
a diagnostic, not the default (docs/results.md). :func:`evaluate_blocks` runs every drafter on
the same anchors (drawn once per batch, independent of the drafters' layouts and block sizes) and
hands the logits to :func:`training.block_eval.speculative_outcomes` with the same uniforms, so the
comparison is paired.

Memory: the ``[blocks, gamma, V]`` draft and target distributions are built ``chunk_blocks`` blocks at
a time (:data:`EVAL_CHUNK_BLOCKS`), and only the per-block outcomes the tables need are kept, so the
peak is a few ``chunk_blocks x gamma x V`` float32 tensors whatever the batch's block count (at
V = 151,936, gamma = 7 and 16 blocks: 68 MB each). Speculative sampling is row-wise, so chunking
changes no outcome; the float statistics (``c*``, entropy, max q) may differ from a one-shot
evaluation in the last bits, as BLAS picks its kernels by row count.

One of the evaluation modules, each for one question: this one runs drafters on cache blocks;
:mod:`training.block_eval` the paired statistics; :mod:`training.validation` the learning curves.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from training.blocks import build_blocks, collate_samples, sample_anchors
from training.block_eval import PairedTally, block_uniforms, draw_tokens, speculative_outcomes
from training.data import module_device, to_device
from training.spec_sampling import Sampling, temperature_probs

__all__ = ["EVAL_CHUNK_BLOCKS", "eval_drafter", "block_slots", "slot_logits", "sequential_draft_logits",
           "chunked_outcomes", "evaluate_blocks"]

BLOCK_EVAL_SEED = 104729  # anchors and uniforms of the block-level evaluation
EVAL_CHUNK_BLOCKS = 16  # blocks whose [gamma, V] distributions are held at once
TARGET_VOCAB_CHUNK = 8192  # target-vocabulary rows of a non-fp32 lm_head upcast at once
KEPT = ("accepted", "reached", "accepted_at", "tau", "tau_expected", "target_entropy")
"""The :func:`speculative_outcomes` fields the tally and the records read (the rest is dropped per chunk)."""


def eval_drafter(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype | None = None):
    """``model`` ready for evaluation on ``device``: eval mode, cast to ``dtype`` (None: kept), and a
    tied target (``lm_head == embed_tokens``) held once: the drafter is built with separate float32
    copies of the two (``training.loop.build_drafter_from``), 1.56 GB each at V = 151,936, H = 2,560.

    The frozen full-vocabulary ``lm_head`` (``target_lm_head`` with a reduced draft vocabulary) is
    replaced by the embedding's parameter when the two are equal element for element, so the values
    and every result stay the same. Floating-point buffers keep their dtype (the RoPE ``inv_freq``
    stays float32, as DeepSpeed's bf16 engine and vLLM keep it: rounded to bf16 its phase at 4,000
    tokens is off by up to 4.6 rad at theta = 1e6). Returns ``model`` itself (modified in place).
    """
    embed = model.embed_tokens.weight
    owner, attr = (model, "target_lm_head") if model.draft_to_target is not None else (model.lm_head, "weight")
    head = getattr(owner, attr)
    if head is not embed and head.shape == embed.shape and head.dtype == embed.dtype and torch.equal(head, embed):
        setattr(owner, attr, embed)
    buffers = {name: b for name, b in model.named_buffers() if b.is_floating_point()}
    model.to(device=device, dtype=dtype)
    for name, b in buffers.items():
        path, _, leaf = name.rpartition(".")
        model.get_submodule(path)._buffers[leaf] = b.to(device)
    return model.eval()


@torch.no_grad()
def block_slots(model, batch, anchors: torch.Tensor, keep: torch.Tensor):
    """Teacher-forced forward of ``model``'s blocks at ``anchors`` on the model's device.

    Args:
        model: a :class:`training.drafter.Drafter`. batch: a :class:`training.blocks.DraftBatch` (any
            device; the blocks are laid out where it is, then both move to the model's device with
            :func:`training.data.to_device`). anchors, keep: [B, N] from ``sample_anchors``.
    Returns:
        the :class:`training.losses.SupervisedSlots` (flat block index ``b * N + n``).
    """
    cfg = model.config
    blocks = build_blocks(batch.input_ids, batch.loss_mask, anchors, keep, block_size=cfg.block_size,
                          sample_from_anchor=cfg.sample_from_anchor, mask_token_id=cfg.mask_token_id)
    batch, blocks = to_device((batch, blocks), module_device(model))
    return model(batch, blocks)


def _fp32_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x.float() @ weight.float().t()`` [r, V]; a non-float32 ``weight`` is upcast
    :data:`TARGET_VOCAB_CHUNK` rows at a time (never a whole float32 copy of it)."""
    x = x.float()
    if weight.dtype == torch.float32:
        return torch.matmul(x, weight.t(), out=out)
    for v in range(0, weight.shape[0], TARGET_VOCAB_CHUNK):
        out[:, v:v + TARGET_VOCAB_CHUNK] = x @ weight[v:v + TARGET_VOCAB_CHUNK].float().t()
    return out


@torch.no_grad()
def slot_logits(model, slots, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft and target logits of the supervised slots ``rows``.

    Args:
        model: the drafter that produced ``slots``. slots: :class:`training.losses.SupervisedSlots`.
        rows: [r] int64 indices into the slots (on their device).
    Returns:
        ``(q_logits, p_logits)``, each [r, V] float32 over the full target vocabulary: the draft
        logits' two terms (backbone, Markov bias) each in the drafter's dtype, summed in float32 as
        training and decoding sum them (``-inf`` outside a reduced draft vocabulary);
        the target logits ``target_hidden @ lm_head^T`` in float32.
    """
    logits = (slots.hidden[rows] @ model.lm_head.weight.t()).float()  # each term rounded once, summed in float32
    if slots.bias_features is not None:                                # as training and decoding sum them
        logits = logits + (slots.bias_features[rows] @ model.markov_head.markov_w2.weight.t()).float()
    target_w = model.target_lm_head_weight
    V = target_w.shape[0]
    if model.draft_to_target is not None:
        full = logits.new_full((logits.shape[0], V), float("-inf"))
        logits = full.index_copy_(1, model.draft_to_target, logits)
    p = _fp32_logits(slots.target_hidden[rows], target_w,
                     torch.empty(rows.numel(), V, device=logits.device, dtype=torch.float32))
    return logits.float(), p


@torch.no_grad()
def sequential_draft_logits(model, hidden: torch.Tensor, first_prev: torch.Tensor, valid: torch.Tensor,
                            u_draw: torch.Tensor, setting) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits of whole blocks drawn slot by slot, as served (DSpark sec. 3.1): slot k's head is
    fed ``x_{k-1}``, the token drawn at slot k - 1 with :func:`training.block_eval.draw_tokens` (the
    anchor's teacher token at the first slot), so the draws of :func:`speculative_outcomes` on the
    result are the tokens the head was fed.

    Args:
        model: a drafter with a sequential head. hidden: [c, gamma, H] backbone output of the blocks'
            predicting slots (zeros past a block's valid prefix). first_prev: [c] int64 the first slot's
            ``x_0``. valid: [c, gamma] bool. u_draw: [c, gamma] the blocks' draw uniforms.
            setting: T >= 0 or a :class:`training.spec_sampling.Sampling`.
    Returns:
        ``(q_logits [c, gamma, V] float32 over the full target vocabulary (-inf outside a reduced
        draft vocabulary; 0 past the valid prefix), confidence logits [c, gamma] float32 on
        ``[h_k ; W1[x_{k-1}]]`` with the drawn ``x_{k-1}``, or None without a confidence head)``.
    """
    head, d2t = model.markov_head, model.draft_to_target
    V = model.target_lm_head_weight.shape[0]
    c, gamma = valid.shape
    base = hidden @ model.lm_head.weight.t()
    q = torch.zeros(c, gamma, V, device=hidden.device, dtype=torch.float32)
    prev, state, prevs = first_prev.long(), None, []
    for k in range(gamma):
        u, state = head.step(state, prev, hidden[:, k])
        row = base[:, k].float() + head.bias(u).float()  # summed in float32, as training and decoding do
        if d2t is not None:
            row = row.new_full((c, V), float("-inf")).index_copy_(1, d2t, row)
        q[:, k] = torch.where(valid[:, k, None], row, 0.0)
        prevs.append(prev)
        prev = draw_tokens(q[:, k], u_draw[:, k], setting)
    conf = model.confidence(hidden, torch.stack(prevs, 1))
    return q, None if conf is None else torch.where(valid, conf, 0.0)


def _scatter(values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = values.new_zeros(shape)
    out[rows, slots] = values
    return out


@torch.no_grad()
def chunked_outcomes(model, slots, blocks: torch.Tensor, u_draw: torch.Tensor, u_accept: torch.Tensor,
                     temperatures: Sequence[float], *, chunk_blocks: int = EVAL_CHUNK_BLOCKS,
                     max_q: bool = False, sequential: bool = False
                     ) -> tuple[dict[float, dict[str, torch.Tensor]], torch.Tensor, dict | None]:
    """Speculative-sampling outcomes of ``model``'s blocks ``blocks``, ``chunk_blocks`` at a time.

    Per chunk the dense draft / target logits [c, gamma, V] are laid out as a one-shot evaluation
    would (0 at slots past a block's supervised prefix), :func:`speculative_outcomes` runs per
    temperature, and only :data:`KEPT` (plus ``max_q``) is kept. With ``sequential`` a drafter
    with a sequential head has its draft logits (and confidence) redrawn slot by slot per setting
    (:func:`sequential_draft_logits`) for every realised outcome (``tau``, ``accepted``, ``reached``,
    ``max_q``, the confidence), while ``tau_expected`` stays the teacher-forced closed form, the training
    and validation metric; without, every slot's head reads the cached previous token (teacher forcing,
    the evaluation before it). Peak memory ~ a few ``chunk_blocks x gamma x V``
    float32 tensors.

    Args:
        model: the drafter (block size gamma). slots: its :class:`training.losses.SupervisedSlots`.
        blocks: [n] int64 flat block indices to evaluate, ascending, each with a valid first slot.
        u_draw, u_accept: [n, >= gamma] uniforms of those blocks (:func:`block_uniforms`).
        temperatures: sampling settings (T values or :class:`training.spec_sampling.Sampling`).
            chunk_blocks: blocks per chunk (>= 1). max_q: also return ``max_q`` [n, gamma] float32,
            the largest draft probability at the setting (top-k / top-p applied; ``softmax(q_logits)`` at T = 0).
        sequential: draft a sequential head's blocks slot by slot (above).
    Returns:
        ``({Sampling: {field: tensor}}, valid [n, gamma] bool, {Sampling: confidence [n, gamma] float32} or
        None)``, all on the slots' device, rows in ``blocks``' order (the confidence is the same tensor at
        every setting unless drafted sequentially).
    Raises:
        ValueError: ``chunk_blocks < 1``; as :func:`speculative_outcomes`.
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1 blocks per chunk, got {chunk_blocks}")
    dev, gamma, n = slots.hidden.device, model.config.block_size, blocks.numel()
    V = model.target_lm_head_weight.shape[0]
    row_of = torch.full((slots.num_blocks,), -1, dtype=torch.long, device=dev)
    row_of[blocks.to(dev)] = torch.arange(n, device=dev)
    slot_row = row_of[slots.block]
    seq = sequential and model.markov_head is not None and slots.prev_ids is not None
    outs: dict[Sampling, dict[str, list]] = {Sampling.of(T): {} for T in temperatures}
    confs: dict[Sampling, list] = {Sampling.of(T): [] for T in temperatures}
    valids = []
    for start in range(0, max(n, 1), chunk_blocks):  # one empty chunk when n = 0: empty outcomes
        stop = min(n, start + chunk_blocks)
        sel = ((slot_row >= start) & (slot_row < stop)).nonzero().squeeze(1)
        r, k, shape = slot_row[sel] - start, slots.slot[sel], (stop - start, gamma)
        q_rows, p_rows = slot_logits(model, slots, sel)
        q, p = _scatter(q_rows, r, k, (*shape, V)), _scatter(p_rows, r, k, (*shape, V))
        del q_rows, p_rows
        valid = _scatter(torch.ones_like(r, dtype=torch.bool), r, k, shape)
        valids.append(valid)
        conf = None if slots.confidence_logits is None else _scatter(slots.confidence_logits[sel].float(), r, k, shape)
        if seq:
            hidden = _scatter(slots.hidden[sel], r, k, (*shape, slots.hidden.shape[-1]))
            first_prev = _scatter(slots.prev_ids[sel], r, k, shape)[:, 0]
        for T in temperatures:
            out = speculative_outcomes(q, p, valid, u_draw[start:stop], u_accept[start:stop], T)
            q_T = q
            if seq:  # realised outcomes of the sequential draft; tau_expected stays the teacher-forced closed form
                q_T, conf = sequential_draft_logits(model, hidden, first_prev, valid, u_draw[start:stop], T)
                out = {**speculative_outcomes(q_T, p, valid, u_draw[start:stop], u_accept[start:stop], T),
                       "tau_expected": out["tau_expected"]}
            kept = {f: out[f] for f in KEPT}
            if max_q:
                kept["max_q"] = (temperature_probs(q_T, T) if T > 0 else torch.softmax(q_T, dim=-1)).amax(-1)
            for f, v in kept.items():
                outs[Sampling.of(T)].setdefault(f, []).append(v)
            if conf is not None:
                confs[Sampling.of(T)].append(conf)
        del q, p
    cat = {T: {f: torch.cat(v) for f, v in d.items()} for T, d in outs.items()}
    has_conf = slots.confidence_logits is not None
    return cat, torch.cat(valids), {T: torch.cat(v) for T, v in confs.items()} if has_conf else None


@torch.no_grad()
def evaluate_blocks(drafters: Mapping[str, torch.nn.Module], batches: Iterable[Sequence[Mapping]], *,
                    temperatures: Sequence[float], num_anchors: int, seed: int = BLOCK_EVAL_SEED,
                    tally: PairedTally | None = None, records: dict | None = None,
                    chunk_blocks: int = EVAL_CHUNK_BLOCKS, sequential: bool = False) -> PairedTally:
    """Paired block-level speculative sampling of every drafter on the same held-out blocks.

    Anchors (``sample_anchors``) and uniforms (:func:`block_uniforms`) are drawn on the CPU from
    CPU generators, so they are the same whatever device a drafter runs on; each drafter runs on its
    own device (:func:`block_slots`; :func:`eval_drafter` puts it there) and its outcomes are moved
    to the CPU once per batch and temperature.

    Args:
        drafters: name -> drafter (any layouts and block sizes; one target).
        batches: lists of cache sample mappings (``training.data.as_mapping``).
        temperatures: sampling settings: T values (0 = greedy) or :class:`training.spec_sampling.Sampling`
            (T, top-p, top-k; a plain T is the setting without truncation). num_anchors: anchors per sample (distinct, uniform
            over positions whose token and next token are supervised, as in training).
        seed: anchors and uniforms are a pure function of ``(seed, batch index)``.
        tally: add to this tally (e.g. drafters of an fp8 cache, fed the same samples of that cache:
            the anchors depend only on the loss masks and the seed, so the blocks stay paired).
        records: if given, ``records[(name, T)]`` collects per-block realised outcomes for the
            calibration on realised acceptance (:class:`pipeline.inference.realised.Outcomes` fields): lists of
            ``z`` [n, gamma] confidence logits (drafters with a head), ``max_q`` [n, gamma] (largest
            draft probability, of ``softmax(q_logits / T)``, at T = 0 of ``softmax(q_logits)``),
            ``accepted`` [n], ``verified`` [n] (valid prefix length) and ``group`` [n] (batch index).
        chunk_blocks: blocks whose [gamma, V] distributions are held at once (:func:`chunked_outcomes`).
        sequential: draft a sequential head's blocks slot by slot, its head fed the drawn tokens
            (:func:`chunked_outcomes`); default False: teacher forcing (module docstring says why).
    Returns:
        a :class:`training.block_eval.PairedTally` (summarise it with
        :func:`training.block_eval.summarise`).
    Raises:
        ValueError: ``chunk_blocks < 1``.
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1 blocks per chunk, got {chunk_blocks}")
    tally = PairedTally() if tally is None else tally
    max_gamma = max(m.config.block_size for m in drafters.values())
    for model in drafters.values():
        model.eval()
    for i, samples in enumerate(batches):
        batch = collate_samples(samples)
        anchors, keep = sample_anchors(batch.loss_mask, num_anchors, torch.Generator().manual_seed(seed + i))
        kept = keep.flatten().nonzero().squeeze(1)
        u_draw, u_accept = block_uniforms(seed, i, kept.numel(), max_gamma)
        for name, model in drafters.items():
            dev, g = module_device(model), model.config.block_size
            slots = block_slots(model, batch, anchors, keep)
            with_conf = records is not None and slots.confidence_logits is not None
            per_t, valid, conf = chunked_outcomes(model, slots, kept.to(dev), u_draw[:, :g].to(dev),
                                                  u_accept[:, :g].to(dev), temperatures,
                                                  chunk_blocks=chunk_blocks, max_q=with_conf, sequential=sequential)
            for T, out in per_t.items():
                out = {f: v.cpu() for f, v in out.items()}
                tally.add(name, T, out)
                if with_conf:
                    rec = records.setdefault((name, T), {k: [] for k in ("z", "max_q", "accepted",
                                                                         "verified", "group")})
                    rec["z"].append(conf[T].cpu())
                    rec["max_q"].append(out["max_q"])
                    rec["accepted"].append(out["accepted"])
                    rec["verified"].append(valid.sum(-1).cpu())
                    rec["group"].append(torch.full((kept.numel(),), i, dtype=torch.long))
    return tally
