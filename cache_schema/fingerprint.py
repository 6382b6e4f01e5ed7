"""The cache fingerprint: everything a cached sample's bytes depend on, checked on every open.

Computing the values from a live target model and tokenizer is the pipeline's job; this module only
defines the record, its validation, its JSON form, and the comparison that names differing fields.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_schema.errors import InvalidFingerprintError
from cache_schema.layout import FEATURE_DTYPES, HIDDEN_DTYPES, SCHEMA_VERSION

_ABSENT = "<absent>"


def tokenizer_sha256(tokenizer) -> str:
    """The fingerprint's ``tokenizer_hash``: SHA-256 of the tokenizer's serialised state (a fast
    tokenizer's ``backend_tokenizer.to_str()``, the vocabulary, merges, normaliser and added tokens;
    else its ``repr``). The one formula, for the cache stage and ``ops sample``."""
    state = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    return hashlib.sha256(state.encode()).hexdigest()


def chat_template_sha256(tokenizer) -> str:
    """The fingerprint's ``chat_template_hash``: SHA-256 of the chat template's text ("" if none)."""
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 hex digest of a tensor's raw bytes (C order, native little-endian layout).

    Works for every dtype, bf16 and fp8 included, because the bytes are hashed, not the values.
    Shape and dtype are not part of the hash.

    Args:
        t: any tensor, on any device; it is copied to CPU and made contiguous first.
    Returns:
        64 lower-case hex characters.
    """
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """What a target cache was computed from; two caches agree iff their fingerprints are equal.

    Fields:
        schema_version: cache layout version (``cache_schema.layout.SCHEMA_VERSION``).
        target: summary of the target config; must hold ``hidden_size`` (int) and should hold
            ``model_type``, ``num_hidden_layers``, ``vocab_size`` and a hash of the whole config.
            When ``num_hidden_layers`` is present, target layer ids are checked against it.
        embed_hash, lm_head_hash: ``tensor_sha256`` of ``embed_tokens`` / ``lm_head`` weights.
        tokenizer_hash, chat_template_hash: hashes of the tokenizer files and the chat template.
        render_options: JSON-serialisable chat rendering options (system prompt policy, thinking).
        target_layer_ids: ascending, unique ids in ``[-1, num_hidden_layers - 2]`` (``-1`` is the
            embedding output; the final layer is never captured).
        feature_dtype: ``"bf16"`` or ``"fp8_e4m3"`` (fp8 with a per-token float32 scale).
        hidden_dtype: storage dtype of the final hidden state; only ``"bf16"``.
        max_length: longest sample in tokens (> 0).
        min_loss_tokens: fewest supervised tokens a sample may have (>= 0).

    Raises:
        InvalidFingerprintError: on any invalid field, with the fix in the message.
    """

    schema_version: int = SCHEMA_VERSION
    target: dict[str, Any]
    embed_hash: str
    lm_head_hash: str
    tokenizer_hash: str
    chat_template_hash: str
    render_options: dict[str, Any] = field(default_factory=dict)
    target_layer_ids: tuple[int, ...]
    feature_dtype: str = "bf16"
    hidden_dtype: str = "bf16"
    max_length: int
    min_loss_tokens: int

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        if not isinstance(ids, (tuple, list)) or not all(isinstance(i, int) for i in ids) or not ids:
            raise InvalidFingerprintError(
                f"target_layer_ids must be a non-empty sequence of ints, got {ids!r}")
        object.__setattr__(self, "target_layer_ids", tuple(ids))
        if list(ids) != sorted(set(ids)) or ids[0] < -1:
            raise InvalidFingerprintError(
                f"target_layer_ids must be unique, ascending and >= -1, got {list(ids)}: sort them")
        if not isinstance(self.target, dict) or not isinstance(self.target.get("hidden_size"), int):
            raise InvalidFingerprintError(
                "target must be a dict holding an int 'hidden_size' (the target config's hidden size)")
        n_layers = self.target.get("num_hidden_layers")
        if isinstance(n_layers, int) and ids[-1] > n_layers - 2:
            raise InvalidFingerprintError(
                f"target layer id {ids[-1]} is the final layer or beyond (num_hidden_layers={n_layers});"
                f" use ids <= {n_layers - 2}: the final hidden state is cached separately")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise InvalidFingerprintError(
                f"feature_dtype {self.feature_dtype!r} is not one of {FEATURE_DTYPES}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise InvalidFingerprintError(
                f"hidden_dtype {self.hidden_dtype!r} is not one of {HIDDEN_DTYPES}")
        for name, minimum in (("schema_version", 1), ("max_length", 1), ("min_loss_tokens", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise InvalidFingerprintError(f"{name} must be an int >= {minimum}, got {value!r}")
        for name in ("embed_hash", "lm_head_hash", "tokenizer_hash", "chat_template_hash"):
            if not isinstance(getattr(self, name), str):
                raise InvalidFingerprintError(f"{name} must be a str hash, got {getattr(self, name)!r}")
        try:
            json.dumps(self.target), json.dumps(self.render_options)
        except TypeError as exc:
            raise InvalidFingerprintError(
                f"target and render_options must be JSON-serialisable: {exc}") from exc

    @property
    def hidden_size(self) -> int:
        """The target's hidden size H (``target["hidden_size"]``)."""
        return self.target["hidden_size"]

    @property
    def feature_width(self) -> int:
        """Width of one token's concatenated target-layer features, ``len(target_layer_ids) * H``."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys, indented); ``from_json(to_json())`` is equal."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def digest(self) -> str:
        """SHA-256 hex digest of the canonical JSON form; commit records carry it."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        """Build from :meth:`to_dict` output.

        Raises:
            InvalidFingerprintError: on unknown or missing keys, or invalid values.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidFingerprintError(
                f"unknown fingerprint fields {unknown}: the cache was written by another schema version")
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidFingerprintError(f"incomplete fingerprint: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        """Parse :meth:`to_json` output.

        Raises:
            InvalidFingerprintError: when the text is not a JSON object or fails :meth:`from_dict`.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidFingerprintError(f"fingerprint is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidFingerprintError("fingerprint JSON must be an object")
        return cls.from_dict(data)

    def diff(self, other: Fingerprint) -> list[tuple[str, Any, Any]]:
        """Fields that differ, as ``(field, mine, theirs)``; empty when equal.

        Dict fields are compared key by key and reported as ``field.key``; a key present on one
        side only shows ``"<absent>"`` on the other.
        """
        mine, theirs = self.to_dict(), other.to_dict()
        out: list[tuple[str, Any, Any]] = []
        for name in mine:
            a, b = mine[name], theirs[name]
            if isinstance(a, dict) and isinstance(b, dict):
                for key in sorted(set(a) | set(b), key=str):
                    va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
                    if va != vb:
                        out.append((f"{name}.{key}", va, vb))
            elif a != b:
                out.append((name, a, b))
        return out
