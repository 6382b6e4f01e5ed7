"""``python -m ops <command> ...`` (console script ``ops``): inspect, verify and repair target caches;
plan a run; publish an export.

Commands work on any fsspec URL or path (``s3://bucket/run/cache``, ``/data/run/cache``) and are
read-only except ``gc --yes``. Each prints a human view, or JSON with ``--json``. Exit codes:
0 ok, 1 problems found, 2 usage error (bad arguments or URL, not a cache, no credentials),
130 interrupted. Credentials come from the backend's environment (for S3: AWS_* variables or
AWS_PROFILE) and are never printed.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cache_schema import CacheError, CacheNotFoundError
from ops import compare, estimate, listing, plan, publish, repair, sample, verify
from ops.common import UsageError
from ops.report import to_json
from ops.verify import VerifyInterrupted
from pipeline.errors import PipelineError
from storage import configure_storage

try:
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    CREDENTIAL_ERRORS: tuple[type[BaseException], ...] = (NoCredentialsError, PartialCredentialsError)
except ImportError:  # no S3 backend installed
    CREDENTIAL_ERRORS = ()

Handler = Callable[[argparse.Namespace], tuple[dict[str, Any], int]]


def _source_row(text: str) -> tuple[int, int]:
    try:
        source, row = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SOURCE:ROW (two integers, e.g. 0:17), got {text!r}") from None
    return source, row


def _positions(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token positions, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``ops`` argument parser (one subcommand per tool)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    parser = argparse.ArgumentParser(
        prog="ops", description="Inspect, verify and repair target caches on any path or fsspec URL "
                                "(read-only except gc --yes).",
        epilog="exit codes: 0 ok, 1 problems found, 2 usage error, 130 interrupted")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, *, url: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        if url:
            p.add_argument("url", help="cache root: a path or fsspec URL such as s3://bucket/run/cache")
        return p

    command("ls", "shards with their state, samples, tokens, bytes, writer and commit time")
    p = command("stat", "fingerprint, schema version, totals, skipped rows; coverage of an input dataset")
    p.add_argument("--data", nargs="+", metavar="FILE",
                   help="the run's input files in data.train_files order: report shards not yet cached")
    p.add_argument("--rows-per-shard", type=int, help="the run's cache.rows_per_shard (default: inferred)")
    p = command("verify", "check every committed shard (resumable; JSON report with --json)")
    p.add_argument("--workers", type=int, default=4, help="shards verified at once (default 4)")
    p.add_argument("--cursor", help="local progress file (default ~/.cache/dspark/verify/<url hash>.jsonl)")
    p.add_argument("--restart", action="store_true",
                   help="ignore saved progress and re-read every shard (a finished verify's cursor is kept: "
                        "the next verify reads only shards committed or rewritten since and re-lists the "
                        "others against the cursor's listing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = command("sample", "one sample: text with the supervised span marked, norms, target top tokens")
    p.add_argument("index", nargs="?", type=int, help="global sample index")
    p.add_argument("--row", type=_source_row, metavar="SOURCE:ROW", help="find the sample by input file and row")
    p.add_argument("--target", metavar="DIR", help="local target folder: decode text, show its top tokens")
    p.add_argument("--positions", type=_positions, help="token positions for top tokens, e.g. 5,12")
    p.add_argument("--top-k", type=int, default=5, help="top tokens per position (default 5)")
    command("du", "bytes by array and by shard, and per token")
    p = command("gc", "list objects of uncommitted shards left by crashed writers; delete with --yes")
    p.add_argument("--yes", action="store_true", help="delete them")
    p.add_argument("--min-age", type=float, default=repair.DEFAULT_MIN_AGE_S, metavar="SECONDS",
                   help="keep shards written more recently (a writer may be running; default 3600)")
    p = command("estimate", "bytes and objects of a cache before running the cache stage", url=False)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml|KEY=VALUE",
                   help="the run's config file, then config overrides, as for pipeline.run")
    p.add_argument("--config", metavar="YAML", help="the run's config file (alias of the positional CONFIG.yaml)")
    p.add_argument("--workers", type=int, default=1, help="render processes (default 1)")
    p = command("plan", "roofline projection of generate, cache and train on a cluster, from the model shapes "
                        "(no weights needed)", url=False)
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml|KEY=VALUE",
                   help="the run's config file, then config overrides, as for pipeline.run")
    p.add_argument("--config", metavar="YAML", help="the run's config file (alias of the positional CONFIG.yaml)")
    p.add_argument("--cluster", action="append", choices=sorted(plan.CLUSTERS), metavar="NAME",
                   help=f"cluster preset, repeatable: {', '.join(sorted(plan.CLUSTERS))} (default: all)")
    p.add_argument("--tokens", type=float, default=1e9, metavar="N",
                   help="corpus tokens for the hours column (default 1e9)")
    p.add_argument("--target-config", metavar="FILE",
                   help="the target's config.json (default: target.path/config.json when target.path is a "
                        "local folder)")
    p.add_argument("--supervised-fraction", type=float, default=1.0, metavar="F",
                   help="share of positions whose next token is supervised, in [0, 1] (default 1.0, an upper "
                        "bound)")
    p.add_argument("--s3-prefixes", type=int, metavar="N",
                   help="S3 prefixes the cache's requests spread over (default 1, a bucket S3 has not partitioned)")
    p = command("diff", "compare two caches by sample id, content hash and shard checksums", url=False)
    p.add_argument("url_a", help="first cache root")
    p.add_argument("url_b", help="second cache root")
    p = command("publish", "upload an export directory with its model card to the Hugging Face Hub", url=False)
    p.add_argument("export", help="the export directory: <run_dir>/export/<drafter> (path or fsspec URL)")
    p.add_argument("repo_id", help="the Hub repository, OWNER/NAME")
    p.add_argument("--dry-run", action="store_true", help="list and check what would be uploaded; no network")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", help="branch to upload to (default: main)")
    return parser


def config_args(a: argparse.Namespace) -> tuple[str, list[str]]:
    """``(config file, overrides)`` of a tool that takes a run's config as ``pipeline.run`` does:
    ``CONFIG.yaml key=value ...`` (positional YAML, then overrides), or ``--config CONFIG.yaml key=value ...``.

    Raises:
        UsageError: no config file, or two of them.
    """
    from pipeline.run import is_yaml_arg

    yamls = [w for w in a.args if is_yaml_arg(w)] + ([a.config] if a.config else [])
    if len(yamls) != 1:
        raise UsageError(f"give the run's config file once: ops {a.command} CONFIG.yaml [key=value ...] "
                         f"(got {len(yamls)}: {yamls})")
    return yamls[0], [w for w in a.args if not is_yaml_arg(w)]


def _estimate(a: argparse.Namespace) -> tuple[dict[str, Any], int]:
    config, overrides = config_args(a)
    return estimate.estimate(config, overrides, workers=a.workers)


def _plan(a: argparse.Namespace) -> tuple[dict[str, Any], int]:
    config, overrides = config_args(a)
    return plan.plan_from_config(config, overrides, clusters=a.cluster or (), tokens=a.tokens,
                                 target_config=a.target_config, supervised_fraction=a.supervised_fraction,
                                 s3_prefixes=a.s3_prefixes)


def _sample(a: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if (a.index is None) == (a.row is None):
        raise UsageError("give a sample INDEX or --row SOURCE:ROW (one of them)")
    return sample.sample(a.url, a.index, a.row, a.target, a.positions, a.top_k)


HANDLERS: dict[str, tuple[Handler, Callable[[dict[str, Any]], str]]] = {
    "ls": (lambda a: listing.ls(a.url), listing.render_ls),
    "stat": (lambda a: listing.stat(a.url, a.data, a.rows_per_shard), listing.render_stat),
    "verify": (lambda a: verify.verify(a.url, workers=a.workers, cursor=a.cursor, restart=a.restart,
                                       progress=not a.no_progress), verify.render_verify),
    "sample": (_sample, sample.render_sample),
    "du": (lambda a: listing.du(a.url), listing.render_du),
    "gc": (lambda a: repair.gc(a.url, yes=a.yes, min_age_s=a.min_age), repair.render_gc),
    "estimate": (_estimate, estimate.render_estimate),
    "plan": (_plan, plan.render_plan),
    "diff": (lambda a: compare.diff(a.url_a, a.url_b), compare.render_diff),
    "publish": (lambda a: publish.publish(a.export, a.repo_id, dry_run=a.dry_run, private=a.private,
                                          revision=a.revision), publish.render_publish),
}


def _urls(a: argparse.Namespace) -> str:
    return " / ".join(getattr(a, k) for k in ("url", "url_a", "url_b", "export") if getattr(a, k, None)) or "storage"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ops command; returns the exit code (argparse exits with 2 on bad arguments)."""
    args = build_parser().parse_args(argv)
    configure_storage()  # the default retry policy (storage.RetryPolicy); FSSPEC_S3_* variables override it
    handler, render = HANDLERS[args.command]
    try:
        payload, code = handler(args)
    except (UsageError, CacheNotFoundError, PipelineError) as exc:
        return _fail(str(exc), 2)
    except CREDENTIAL_ERRORS:
        return _fail(f"no credentials for {_urls(args)}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                     "or AWS_PROFILE (or the backend's own credentials)", 2)
    except PermissionError:
        return _fail(f"access denied to {_urls(args)}: check that your credentials (for S3: "
                     "AWS_ACCESS_KEY_ID or AWS_PROFILE) may read it", 2)
    except (VerifyInterrupted, KeyboardInterrupt) as exc:
        return _fail(str(exc) or "interrupted", 130)
    except CacheError as exc:
        return _fail(str(exc), 1)
    print(to_json(payload) if args.json else render(payload))
    return code


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
