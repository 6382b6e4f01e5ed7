"""The demo beside, and on, a user's Ray cluster (issue #37).

A Ray head is started as a user's plain ``ray start --head`` is (discoverable in Ray's default temp dir,
kept under a private ``RAY_TMPDIR`` so that no other Ray user of the machine is touched). Then:

1. ``make demo``'s command (``+stage=all conf/tiny.yaml``, no ``ray.address``, ``RAY_ADDRESS`` unset)
   runs beside it: it must pass on a private instance and leave the head as it found it (nodes, jobs,
   actors counted before and after);
2. the same demo is submitted to that head with ``ray job submit``, ``run_dir`` on a local S3 server
   (moto);

and the figures of the two runs are compared side by side (times excluded).

    python bench/demo_cluster.py [--local runs/tiny]      (make demo-cluster)

``--local DIR``: compare with that earlier local run instead of running step 1.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, s3_server

STAGES = ("generate", "cache", "train", "calibrate", "export", "evaluate")


def figures(run_dir: str) -> dict[str, object]:
    """The run's results that must not depend on where it ran (times excluded)."""
    from storage import join, read_json

    s = {k: read_json(join(run_dir, k, "summary.json")) for k in STAGES}
    out: dict[str, object] = {f"generate {k}": s["generate"][k] for k in ("rows_kept", "new_tokens", "finish_reasons")}
    out.update({f"cache {k}": s["cache"][k] for k in ("samples", "tokens", "supervised_tokens", "shards", "bytes")})
    for name, d in sorted(s["train"]["drafters"].items()):
        out[f"train {name} final loss"] = round(d["last"]["loss"], 6)
    for name, d in sorted(s["calibrate"]["drafters"].items()):
        out[f"calibrate {name} STS temperatures"] = [round(t, 4) for t in d.get("temperatures", [])]
    for name, d in sorted(s["export"]["drafters"].items()):
        out[f"export {name} bytes"] = d["bytes"]
    for T, r in s["evaluate"]["results"].items():
        for name, d in sorted(r["drafters"].items()):
            out[f"evaluate {T} {name} tau"] = round(d["overall"]["tau"], 4)
    return out


def demo_beside(env: dict[str, str], gcs: str, run_dir: Path) -> float:
    """``make demo``'s command with a user's head up and no address: returns its wall seconds.

    Raises:
        SystemExit: the demo failed, or the head's nodes, jobs or actors changed during it."""
    from pipeline.cluster import head_counts
    from pipeline.run import DEFAULT_CONFIG

    before = head_counts(gcs)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pipeline.run", "+stage=all", str(DEFAULT_CONFIG), f"run_dir={run_dir}"],
                       env=env, cwd=REPO)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"the demo beside the user's head failed (exit {r.returncode})")
    after = head_counts(gcs)
    if after != before:
        sys.exit(f"the demo without ray.address touched the user's head: {before} -> {after}")
    print(f"\nthe demo beside a user's `ray start --head`: passed in {seconds:.0f} s; "
          f"the head untouched ({after})\n")
    return seconds


def main() -> None:
    from pipeline.cluster import local_head, submit
    from pipeline.run import DEFAULT_CONFIG

    ap = argparse.ArgumentParser()
    ap.add_argument("--local", default=None, help="run_dir of an earlier local `make demo` (skips step 1)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ru", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(root), PYTHONPATH=str(REPO))
    local = args.local or str(REPO / "runs" / "tiny-beside-head")
    try:
        with s3_server() as bucket:
            run_dir = f"{bucket}/tiny"
            env.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})  # the jobs reach the S3 server
            with local_head(num_cpus=2, env=env, discoverable=True) as (ray_bin, address, env):
                if args.local is None:
                    shutil.rmtree(local, ignore_errors=True)
                    demo_beside(env, (root / "ray" / "ray_current_cluster").read_text().strip(), Path(local))
                t0 = time.perf_counter()
                r = submit(ray_bin, address, env, [sys.executable, "-m", "pipeline.run", "+stage=all",
                                                   str(DEFAULT_CONFIG), f"run_dir={run_dir}"], timeout_s=3600)
                seconds = time.perf_counter() - t0
            print(r.stdout[-4000:])
            if r.returncode != 0:
                sys.exit(f"ray job failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
            remote, here = figures(run_dir), figures(local)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n`ray job submit` of +stage=all with run_dir={run_dir}: {seconds:.0f} s\n")
    print(f"| figure | local ({local}) | ray job + S3 | same |\n|---|---|---|---|")
    for k, v in remote.items():
        print(f"| {k} | {here.get(k)} | {v} | {'yes' if here.get(k) == v else 'NO'} |")
    same = sum(here.get(k) == v for k, v in remote.items())
    print(f"\n{same} of {len(remote)} figures identical")


if __name__ == "__main__":
    main()
