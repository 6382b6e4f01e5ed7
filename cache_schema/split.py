"""Which committed shards train, which validate and which are held out: a function of the shard
sample counts alone, shared by the trainer (``training.data``), the online stream and ``ops estimate``."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardSplit", "split_shards"]


@dataclass(frozen=True)
class ShardSplit:
    """Committed shards split into training, validation (learning curves during training) and
    held-out (calibrate, block-level evaluation) shards; the three sets are disjoint.

    ``counts`` maps every shard index to its sample count.
    """

    train: tuple[int, ...]
    heldout: tuple[int, ...]
    counts: dict[int, int]
    validation: tuple[int, ...] = ()


def split_shards(counts: dict[int, int], heldout_shards: int, validation_shards: int = 0) -> ShardSplit:
    """Hold out the last ``heldout_shards`` non-empty shards (by index) and, before them, the
    ``validation_shards`` for the learning curves; the rest train.

    Raises:
        ValueError: fewer than ``heldout_shards + validation_shards + 1`` non-empty shards.
    """
    full = [s for s in sorted(counts) if counts[s] > 0]
    if len(full) <= heldout_shards + validation_shards:
        raise ValueError(f"the cache has {len(full)} non-empty shards; train.heldout_shards={heldout_shards} and "
                         f"train.validation_shards={validation_shards} leave none to train on: cache more rows "
                         "(or a smaller cache.rows_per_shard), or lower them")
    cut = len(full) - heldout_shards
    val = cut - validation_shards
    return ShardSplit(tuple(full[:val]), tuple(full[cut:]), dict(counts), tuple(full[val:cut]))
