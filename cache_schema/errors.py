"""Exceptions raised by the cache contract library.

Every class derives from :class:`CacheError`, so a caller can catch the whole family at once.
Messages always say what to do next (the fix), not only what went wrong.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CacheError(Exception):
    """Base class of every error raised by ``cache_schema``."""


class InvalidFingerprintError(CacheError, ValueError):
    """A :class:`~cache_schema.fingerprint.Fingerprint` has an invalid field value or JSON form."""


class FingerprintMismatchError(CacheError):
    """The fingerprint stored at a cache root differs from the expected one.

    Attributes:
        differences: list of ``(field, stored value, expected value)`` tuples; nested dict fields
            are named with dots, e.g. ``target.hidden_size``.
    """

    def __init__(self, root_url: str, differences: list[tuple[str, object, object]]):
        self.differences = differences
        lines = "\n".join(f"  {name}: stored={stored!r} expected={expected!r}"
                          for name, stored, expected in differences)
        super().__init__(
            f"cache at {root_url} was written with a different fingerprint; differing fields:\n{lines}\n"
            "Use another cache root for this configuration, or fix the configuration to match "
            "the cache.")


class SchemaVersionError(CacheError):
    """A cache root or a fingerprint uses a schema version this library does not read or write."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """No cache (no fingerprint object) exists at the given root."""


class InvalidSampleError(CacheError, ValueError):
    """A :class:`~cache_schema.layout.CacheSample` has a wrong dtype, shape, value or provenance."""


class NonFiniteSampleError(InvalidSampleError):
    """A sample's features or final hidden state hold NaN or infinity (on write or on read)."""


class InvalidStorageConfigError(CacheError, ValueError):
    """A :class:`~cache_schema.layout.StorageConfig` has unusable sizes."""


class InvalidRecordError(CacheError, ValueError):
    """A commit-record input from the caller (``writer_id``, ``extra``) is unusable."""


class ShardAlreadyCommittedError(CacheError, FileExistsError):
    """A shard that already has a commit record was written again; committed shards are immutable."""


class ShardNotCommittedError(CacheError, KeyError):
    """A shard index was requested that has no commit record."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CorruptRecordError(CacheError):
    """A commit record or the fingerprint object cannot be parsed."""


class MissingObjectError(CacheError, FileNotFoundError):
    """A data object named in a shard's commit record is absent from storage."""


class TruncatedObjectError(CacheError):
    """A data object's stored size differs from the size in the shard's commit record."""


class ChecksumMismatchError(CacheError):
    """An array's content checksum differs from the one in the shard's commit record."""


class StorageUnavailableError(CacheError):
    """An object-storage call still failed after the retry policy's attempts (503 SlowDown, 500,
    connection resets, timeouts), or a written shard's objects could not all be confirmed. Nothing
    was committed by the failed call; rerunning the same command continues where it stopped."""


def _not_transient() -> tuple[type[BaseException], ...]:
    """Storage errors that retrying cannot fix and that callers handle by type: absent or existing
    objects, refused or missing credentials, the library's own errors."""
    found: list[type[BaseException]] = [FileNotFoundError, FileExistsError, PermissionError, CacheError]
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        found += [NoCredentialsError, PartialCredentialsError]
    except ImportError:  # no S3 backend installed
        pass
    return tuple(found)


def transient_storage_errors() -> tuple[type[BaseException], ...]:
    """Exception types a storage backend raises once its retries are spent: OSError (s3fs
    translates S3 error codes into it), botocore's and aiohttp's errors, timeouts; the
    :func:`_not_transient` ones are excepted by :func:`storage_call`."""
    found: list[type[BaseException]] = [OSError, TimeoutError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        found += [BotoCoreError, ClientError]
    except ImportError:  # no S3 backend installed
        pass
    try:
        from aiohttp import ClientError as AiohttpClientError

        found.append(AiohttpClientError)
    except ImportError:
        pass
    return tuple(found)


@contextmanager
def storage_call(url: str, what: str) -> Iterator[None]:
    """Turn a storage failure left after retries into one :class:`StorageUnavailableError` line
    naming ``url``, what was being done and the last error. Missing objects, existing objects,
    refused or missing credentials and the library's own errors pass unchanged."""
    try:
        yield
    except _not_transient():
        raise
    except transient_storage_errors() as exc:
        last = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
        raise StorageUnavailableError(
            f"{what} {url} failed after the storage retry policy's attempts; last error: {last}. "
            "Nothing of it was committed: check the store (throttling, outage), raise storage.max_attempts "
            "if needed, and rerun the same command to continue") from exc
