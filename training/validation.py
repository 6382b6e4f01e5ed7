"""Held-out learning curves: the drafter evaluated on the validation shards during training.

Every ``validate_every_steps`` optimizer steps each rank runs the teacher-forced forward and loss
(no gradient) over its share of a fixed list of validation micro-batches, anchors drawn from a
generator seeded with ``(seed, batch index)``; the summed statistics are all-reduced once, so the
figures are those of one process holding every batch, whatever the world size. Reported: per-slot
expected acceptance (mean ``c*_k``), ``tau_expected = 1 + sum_j prod_{i<=j} c*_i`` (DSpark sec. 3.2),
CE and TV (weighted as the training loss, DSpark sec. 3.3 eq. 12).

One of the evaluation modules, each for one question: this one the learning curves during training;
:mod:`training.block_eval` the paired statistics; :mod:`training.block_runner` drafters on cache blocks.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from training.blocks import collate_samples
from training.data import ShardSplit, as_mapping, module_device, to_device
from training.losses import LossConfig, metrics_from_stats

__all__ = ["validation_batches", "validate", "curve_summary", "plot_curves"]

VALIDATION_SEED = 7919  # anchors of validation blocks: fixed, apart from the training draws


def validation_batches(split: ShardSplit, reader, *, micro_batch: int, max_samples: int, world: int
                       ) -> list[list[int]]:
    """The validation micro-batches as lists of global sample indices of ``reader``.

    The first ``max_samples`` samples of the validation shards (shard order, then position), cut
    into micro-batches of ``micro_batch``; the count is rounded down to a multiple of ``world`` so
    that every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively).

    Returns:
        a list of micro-batches (empty when the split has no validation shard or too few samples).
    """
    if not split.validation:
        return []
    starts = dict(zip(reader.shards, torch.tensor([0] + [reader.records[s].num_samples for s in reader.shards])
                      .cumsum(0).tolist()))
    idx = [starts[s] + k for s in split.validation for k in range(split.counts[s])][:max_samples]
    batches = [idx[i:i + micro_batch] for i in range(0, len(idx) - micro_batch + 1, micro_batch)]
    return batches[:len(batches) // world * world]


@torch.no_grad()
def validate(model, reader, batches: Sequence[Sequence[int]], loss_cfg: LossConfig, *, rank: int, world: int
             ) -> dict[str, Any]:
    """Teacher-forced held-out metrics of ``model`` over ``batches`` (this rank takes ``rank::world``).

    Each batch is collated and its blocks drawn on the CPU (a CPU generator: the same anchors on
    every device), then both are moved to the model's device (:func:`training.data.to_device`; a
    no-op on a CPU model) before the forward.

    Args:
        model: a :class:`training.drafter.Drafter` (or the module an engine wraps), on any device;
            its training mode is restored afterwards.
        reader: the cache reader. batches: from :func:`validation_batches`. loss_cfg: loss weights.
    Returns:
        ``{"tau_expected", "acceptance_per_position" (list, one per slot), "ce", "tv", "loss",
        "blocks"}`` as plain floats, identical on every rank.
    Raises:
        ValueError: ``batches`` is empty.
    """
    if not batches:
        raise ValueError("no validation batch: set train.validation_shards >= 1 with enough samples")
    was_training = model.training
    model.eval()
    device = module_device(model)
    total = None
    for i in range(rank, len(batches), world):
        batch = collate_samples([as_mapping(reader.sample(j)) for j in batches[i]])
        blocks = model.make_blocks(batch, torch.Generator().manual_seed(VALIDATION_SEED * 1_000_003 + i))
        out = model.loss(model(to_device(batch, device), to_device(blocks, device)), loss_cfg, reduce=False)
        total = out.stats if total is None else total + out.stats
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    model.train(was_training)
    m = metrics_from_stats(total, model.config.block_size, loss_cfg,
                           has_confidence=model.confidence_head is not None)
    return {"tau_expected": float(m["tau_expected"]), "acceptance_per_position": m["acceptance_per_position"].tolist(),
            "ce": float(m["ce"]), "tv": float(m["tv"]), "loss": float(m["loss"]), "blocks": int(total[7])}


def curve_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Best and last validation point of a run's metrics rows (those carrying ``val_tau_expected``).

    Returns:
        ``{"best": {"step", "tau_expected", "slot1_acceptance"}, "last": {...}, "points": n}`` or
        None when no row was validated.
    """
    pts = [r for r in rows if "val_tau_expected" in r]
    if not pts:
        return None

    def point(r):
        return {"step": r["step"], "tau_expected": r["val_tau_expected"],
                "slot1_acceptance": r["val_acceptance_per_position"][0], "ce": r["val_ce"], "tv": r["val_tv"]}

    return {"best": point(max(pts, key=lambda r: r["val_tau_expected"])), "last": point(pts[-1]),
            "points": len(pts)}


def plot_curves(path: str, rows: Sequence[dict[str, Any]], title: str) -> None:
    """Write a PNG of the held-out curves (``tau_expected``, per-slot acceptance, CE) and the
    training-batch ``tau_expected`` against optimizer steps to the local file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = [r for r in rows if "val_tau_expected" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["tau_expected"] for r in rows], color="0.75", lw=0.8, label="training batch")
    axes[0].plot([r["step"] for r in val], [r["val_tau_expected"] for r in val], "o-", ms=3, label="held out")
    axes[0].set(title="tau_expected", xlabel="optimizer step")
    axes[0].legend()
    if val:
        per_slot = torch.tensor([r["val_acceptance_per_position"] for r in val])
        for k in range(per_slot.shape[1]):
            axes[1].plot([r["step"] for r in val], per_slot[:, k], lw=1, label=f"slot {k + 1}")
        axes[1].legend(fontsize=6, ncol=2)
        axes[2].plot([r["step"] for r in val], [r["val_ce"] for r in val], "o-", ms=3, label="CE")
        axes[2].plot([r["step"] for r in val], [r["val_tv"] for r in val], "o-", ms=3, label="TV")
        axes[2].legend()
    axes[1].set(title="held-out expected acceptance c*_k", xlabel="optimizer step")
    axes[2].set(title="held-out loss terms (weighted)", xlabel="optimizer step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
