"""The one filesystem abstraction for data paths: fsspec URLs (``s3://``, ``file://``, plain paths).

The bottom layer of the product: every package may import it, it imports none of them.

Credentials and endpoints come from each backend's standard environment (for S3: AWS_* variables,
including AWS_ENDPOINT_URL); they are never taken from configs, logged or written to summaries.

Retry policy (``storage:`` in the run config, :class:`RetryPolicy`), set once per
process by :func:`configure_storage` as fsspec's default options for ``s3``, so every S3 client made
afterwards (stages, Ray workers, ops tools, zarr stores) gets it:

- request level (botocore "standard" mode): up to ``max_attempts`` tries of each HTTP request, with
  exponential backoff and full jitter, wait = U(0, 1) * min(2^(k-1), 20) s before retry k. Retried:
  throttling (503 SlowDown and the other throttling codes), transient 500/502/503/504 and
  RequestTimeout, connection errors (refused, reset) and read/connect timeouts; never 4xx answers.
  Each client also holds botocore's retry quota (500 tokens, 5 per retry, 10 per timeout, refilled by
  successes), which stops retrying a store that fails most requests.
- call level (s3fs): up to ``body_attempts`` tries of a call whose response body broke off mid-read
  (connection reset, truncated body) or whose request retries ran out on SlowDown; waits
  min(1.7^i * 0.1, 15) s.
- budget: one call makes at most ``max_attempts * body_attempts`` requests; each attempt waits at
  most ``connect_timeout_s`` + ``read_timeout_s``; :func:`retry_budget_s` bounds the backoff sleeps.

When the budget is spent the cache library raises StorageUnavailableError naming the URL and the last
S3 error (``cache_schema.errors.storage_call``); the CLIs print it as one ``error:`` line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import fsspec.config

_USER_S3_OPTIONS = dict(fsspec.config.conf.get("s3", {}))  # FSSPEC_S3* variables and fsspec config files win


@dataclass
class RetryPolicy:
    """The retry policy of every object-storage (S3) client of the run: stages, Ray workers, ops
    tools (the run config's ``storage:`` section). See the module docstring for what is retried and
    the resulting budget."""

    max_attempts: int = 8  # tries of one S3 request, the first included (botocore standard mode)
    body_attempts: int = 3  # s3fs: tries of a call whose response body broke off mid-read
    connect_timeout_s: float = 10.0  # per attempt
    read_timeout_s: float = 60.0  # per attempt: a response silent this long is retried


def local_home() -> Path:
    """The product's local state on this machine (the embedded demo's build, ``ops verify`` cursors):
    ``$DSPARK_HOME`` if set, else ``~/.cache/dspark``."""
    return Path(os.environ.get("DSPARK_HOME") or Path.home() / ".cache" / "dspark")


def s3_options(policy: RetryPolicy) -> dict[str, Any]:
    """s3fs constructor options of a :class:`RetryPolicy` (the botocore part;
    ``body_attempts`` is s3fs's class attribute ``retries``, set by :func:`configure_storage`), and
    ``s3.payload_signing_enabled: False``: request bodies are not SHA-256-hashed into the SigV4
    signature (``UNSIGNED-PAYLOAD``). botocore already does so over HTTPS for uploads that carry a
    checksum; over plain HTTP (a local or in-cluster endpoint) it would hash every byte written, a
    third of the cache writer's CPU on the S3 path (bench/bench_cache_writer.py). The bytes stay
    guarded by botocore's default CRC32 request checksum (``request_checksum_calculation``
    ``when_supported``), which the server verifies on each PUT, by TLS on HTTPS endpoints, and by the
    SHA-256 checksums of every shard's commit record (``ops verify``)."""
    return {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": int(policy.max_attempts)},
                              "connect_timeout": float(policy.connect_timeout_s),
                              "read_timeout": float(policy.read_timeout_s),
                              "s3": {"payload_signing_enabled": False}}}


def configure_storage(policy: RetryPolicy | None = None) -> None:
    """Make ``policy`` (default: the config's defaults) the options of every S3 client this process
    creates from now on. Idempotent; call it at each process's entry (driver, Ray actor, ops)."""
    policy = RetryPolicy() if policy is None else policy
    fsspec.config.conf["s3"] = {**s3_options(policy), **_USER_S3_OPTIONS}
    try:
        import s3fs
    except ImportError:  # no S3 backend installed: nothing else to configure
        return
    s3fs.S3FileSystem.retries = int(policy.body_attempts)


def retry_budget_s(policy: RetryPolicy) -> float:
    """Upper bound in seconds of the backoff sleeps of one call under ``policy`` (timeouts excluded):
    the request-level jitter caps summed over ``max_attempts - 1`` retries, for each of
    ``body_attempts`` tries, plus the call-level waits."""
    request = sum(min(2.0 ** (k - 1), 20.0) for k in range(1, policy.max_attempts))
    call = sum(min(1.7 ** i * 0.1, 15.0) for i in range(policy.body_attempts))
    return policy.body_attempts * request + call


def indexed_name(prefix: str, index: int) -> str:
    """The one naming rule of numbered units: ``prefix`` + the index in six digits (cache shards
    ``s000042``, generate shards ``shard-000042``, checkpoints ``step-000100``).

    Raises:
        ValueError: a negative index.
    """
    if index < 0:
        raise ValueError(f"a unit index is >= 0, got {index}")
    return f"{prefix}{index:06d}"


def read_or_none(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """The object's bytes, read past any listing cache, or None when it does not exist."""
    fs.invalidate_cache(path)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """The one commit primitive: create the object ``path`` holding ``data`` only if it does not exist
    (S3: a conditional PUT with ``If-None-Match: *``; local: ``open(..., "xb")``, the parent folder
    made by the caller). Every commit record of the product (cache shards and fingerprint, generate
    shards, checkpoints) is written by it.

    A retried PUT whose first attempt was stored but not acknowledged (a connection reset after
    the body was sent) finds its own object: when the stored bytes equal ``data`` the call
    succeeds, so a commit is never reported as a collision with itself.

    Raises:
        FileExistsError: the object exists with other bytes (another writer's).
    """
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        if read_or_none(fs, path) != data:
            raise


def join(url: str, *parts: str) -> str:
    """Join path parts onto a URL with ``/`` (never ``os.path``)."""
    out = url.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the backend path for ``url``."""
    return fsspec.core.url_to_fs(url)


def write_json(url: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``url``, creating parent folders."""
    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def read_json(url: str) -> Any:
    """Read a JSON object from ``url``. Raises FileNotFoundError if absent."""
    fs, path = filesystem(url)
    with fs.open(path, "r") as f:
        return json.load(f)


def write_tensors(url: str, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> torch.Tensor, any dtype and shape) as one safetensors file at ``url``
    in one PUT, creating parent folders; ``metadata``: string pairs in its header."""
    from safetensors.torch import save

    fs, path = filesystem(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def read_tensors(url: str) -> dict[str, Any]:
    """The tensors of the safetensors file at ``url`` (name -> torch.Tensor on the CPU). Raises
    FileNotFoundError if absent."""
    from safetensors.torch import load

    fs, path = filesystem(url)
    return load(fs.cat_file(path))
