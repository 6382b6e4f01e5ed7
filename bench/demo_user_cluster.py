"""`make demo` with a user's `ray start --head` running on the machine (issue #37 item 5).

The head is started as a user starts it (no `--temp-dir`: it records its address in `ray_current_cluster`
of Ray's default temp dir, where a plain `ray.init()` would find and join it). The demo
(`python -m pipeline.run +stage=all conf/tiny.yaml`, what `make demo` runs) is then run without an
address, and must finish on a private instance of its own, leaving the head's nodes, jobs and actors as
they were. With `--local RUN_DIR` (a lone `make demo` run) its figures are compared side by side.

    python bench/demo_user_cluster.py [--run-dir runs/tiny-user-cluster] [--local runs/tiny] [--machine-default]

By default Ray's default temp dir is moved under a private RAY_TMPDIR for the head and the demo alike
(the same discovery, away from other Ray users of the machine); `--machine-default` uses the machine's
own (/tmp/ray), exactly as a user would, and then also moves every other Ray user's `ray.init()` there.
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

from common import REPO
from demo_cluster import figures


def head_counts(gcs: str) -> dict[str, int]:
    """Alive nodes, jobs and actors of the cluster whose GCS is at ``gcs`` (read without joining it)."""
    from ray._private.internal_api import get_state_from_address

    state = get_state_from_address(gcs)
    return {"alive nodes": sum(n["Alive"] for n in state.node_table()), "jobs": len(state.job_table()),
            "actors": len(state.actor_table(None))}


def main() -> None:
    from pipeline.cluster import local_head
    from pipeline.run import DEFAULT_CONFIG

    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "tiny-user-cluster"))
    ap.add_argument("--local", default=None, help="run_dir of a lone `make demo` to compare figures with")
    ap.add_argument("--machine-default", action="store_true", help="the head in the machine's /tmp/ray")
    args = ap.parse_args()
    root = None if args.machine_default else Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if root is not None:
        env["RAY_TMPDIR"] = str(root)
    temp = Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp") / "ray"
    shutil.rmtree(args.run_dir, ignore_errors=True)
    try:
        with local_head(num_cpus=2, env=env, discoverable=True) as (_, _, env):
            gcs = (temp / "ray_current_cluster").read_text().strip()
            before = head_counts(gcs)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "pipeline.run", "+stage=all", str(DEFAULT_CONFIG),
                                f"run_dir={args.run_dir}"], env=env, cwd=REPO, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            after = head_counts(gcs)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    print((r.stdout + r.stderr)[-3000:])
    joined = "Connecting to existing Ray cluster" in r.stdout + r.stderr
    print(f"\n`make demo` (+stage=all conf/tiny.yaml) beside a user's `ray start --head` at {gcs} "
          f"(Ray temp dir {temp}): exit {r.returncode}, {seconds:.0f} s, joined the user's cluster: {joined}\n")
    print("| user's head | before the demo | after | same |\n|---|---|---|---|")
    for k, v in before.items():
        print(f"| {k} | {v} | {after[k]} | {'yes' if after[k] == v else 'NO'} |")
    if args.local and r.returncode == 0:
        mine, lone = figures(args.run_dir), figures(args.local)
        print(f"\n| figure | lone demo ({args.local}) | beside the user's head | same |\n|---|---|---|---|")
        for k, v in mine.items():
            print(f"| {k} | {lone.get(k)} | {v} | {'yes' if lone.get(k) == v else 'NO'} |")
        print(f"\n{sum(lone.get(k) == v for k, v in mine.items())} of {len(mine)} figures identical")
    if r.returncode != 0 or joined or before != after:
        sys.exit(1)


if __name__ == "__main__":
    main()
