"""Storage size estimate of a target cache, from token counts and the feature configuration.

Counts the array payload of the schema-1 layout (see ``cache_schema.layout``). Left out: Zarr
metadata (about 1 KB per array, 10 arrays per shard group), shard indexes (16 bytes per inner
chunk) and the last inner chunk's padding (under one row per chunk, chunks being balanced), so with
compression off the real size lands slightly above the estimate: well within 5% once a shard
group holds a few hundred KB (the recipe's hold hundreds of MiB).

Why two estimate modules: this is the layout's byte arithmetic (the cache contract; the cache
stage's storage budget uses it); :mod:`ops.estimate` is the tool that renders a dataset to count its tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cache_schema.layout import FEATURE_DTYPES, array_specs


def _payload_bytes(num_samples: int, num_tokens: int, num_hidden_rows: int, **kw) -> int:
    return sum(dtype.itemsize * math.prod(shape)
               for dtype, shape in array_specs(num_samples, num_tokens, num_hidden_rows, **kw).values())


@dataclass(frozen=True)
class SizeEstimate:
    """Estimated cache size.

    Attributes:
        bytes_per_token: payload bytes per token (float: the last-hidden share is fractional).
        total_bytes: estimated bytes of all tokens plus the per-sample index arrays.
    """

    bytes_per_token: float
    total_bytes: int


def estimate_cache_bytes(num_tokens: int, *, hidden_size: int, num_target_layers: int,
                         feature_dtype: str = "bf16", supervised_fraction: float = 1.0,
                         num_samples: int = 0) -> SizeEstimate:
    """Estimate cache bytes for ``num_tokens`` tokens.

    Per token: 4 (input_ids) + 1 (loss_mask) + features (bf16: ``2*L*H``; fp8_e4m3: ``L*H`` + 4 for
    the float32 scale) + ``supervised_fraction * 2*H`` (bf16 last_hidden rows). Per sample: 28
    bytes of offsets and provenance. Example: the Qwen3-4B recipe (L=5, H=2560, fraction 1) gives
    30,725 bytes/token.

    Args:
        num_tokens: total tokens (>= 0).
        hidden_size: H, the target's hidden size (> 0).
        num_target_layers: L, number of target layer ids (> 0).
        feature_dtype: "bf16" or "fp8_e4m3".
        supervised_fraction: fraction of token positions that get a last_hidden row, i.e. whose
            next token is supervised (about supervised tokens / tokens), in [0, 1].
        num_samples: number of samples (>= 0), for the per-sample arrays.
    Raises:
        ValueError: an argument out of range or an unknown feature_dtype.
    """
    if feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype {feature_dtype!r} is not one of {FEATURE_DTYPES}")
    if min(num_tokens, num_samples) < 0 or min(hidden_size, num_target_layers) < 1:
        raise ValueError("need num_tokens, num_samples >= 0 and hidden_size, num_target_layers >= 1")
    if not 0.0 <= supervised_fraction <= 1.0:
        raise ValueError(f"supervised_fraction must be in [0, 1], got {supervised_fraction}")
    kw = dict(feature_width=num_target_layers * hidden_size, hidden_size=hidden_size, feature_dtype=feature_dtype)
    base = _payload_bytes(0, 0, 0, **kw)  # the two offsets arrays' leading 0
    per_token = _payload_bytes(0, 1, 0, **kw) - base + supervised_fraction * (_payload_bytes(0, 0, 1, **kw) - base)
    per_sample = _payload_bytes(1, 0, 0, **kw) - base
    return SizeEstimate(bytes_per_token=per_token,
                        total_bytes=math.ceil(num_tokens * per_token + num_samples * per_sample))


def shard_overhead_bytes(*, hidden_size: int, target_layer_ids: tuple[int, ...], feature_dtype: str = "bf16",
                         storage=None) -> int:
    """Bytes of one empty committed shard group (the zarr metadata every shard carries), measured by
    writing one to an in-memory filesystem; add it once per shard to :func:`estimate_cache_bytes`."""
    import uuid

    from cache_schema.fingerprint import Fingerprint
    from cache_schema.writer import open_cache

    fp = Fingerprint(target={"hidden_size": hidden_size}, embed_hash="", lm_head_hash="", tokenizer_hash="",
                     chat_template_hash="", target_layer_ids=tuple(target_layer_ids), feature_dtype=feature_dtype,
                     max_length=1, min_loss_tokens=0)
    root = open_cache(f"memory://estimate-{uuid.uuid4().hex}", fp, storage=storage)
    try:
        return root.write_shard(0, [], writer_id="estimate").total_bytes
    finally:
        root.fs.rm(root.path, recursive=True)
