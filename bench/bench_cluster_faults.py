"""Wall time each fault costs a stage on a 3-raylet local cluster: the scenarios of
``tests/integration/test_cluster_faults.py`` themselves (same cluster, data, overrides and checks), run with pytest
while each test appends what it measured (``record``) to a JSON-lines file, then shown as a table: the
undisturbed and the disturbed job's wall seconds (``ray job submit`` to the job's end, driver start-up
included), their difference, and what the stage's summary counted (redone shards or steps, restarts,
task attempts). Streaming and preemption runs have no undisturbed twin (the undisturbed train run is
in cache mode, 1 s steps): their cost is the summary's restart seconds and redone steps.

    .venv/bin/python bench/bench_cluster_faults.py [-k EXPR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cost(faults: dict) -> str:
    """The summary's counts in a few words."""
    if "redone_shards" in faults:
        return f"{faults['actors_lost']} actor lost, shards {faults['redone_shards']} redone"
    if "task_attempts" in faults:
        return f"{faults['task_attempts']} attempts on {faults['nodes']} nodes, retry after {faults['retry_seconds']} s"
    return (f"{faults['worker_group_restarts']} restart from step {faults['resumed_from_steps']}"
            f"{' (preemption checkpoint)' if faults.get('preemption_checkpoints') else ''}"
            f"{'' if faults.get('notice_delivered', True) else ' (the notice not delivered in time)'}, "
            f"{faults['redone_steps']} steps redone, {faults['restart_seconds']} s to restart")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="pytest -k expression: a subset of the scenarios")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "faults.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/integration/test_cluster_faults.py",
               *(["-k", args.k] if args.k else [])]
        r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "DSPARK_FAULT_TIMES": str(out)})
        rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    print(f"\n{'scenario':74} {'clean s':>8} {'disturbed s':>12} {'lost s':>7}  counted")
    for row in rows:
        clean, dist = row["clean_s"], row["disturbed_s"]
        lost = f"{dist - clean:7.1f}" if clean is not None else f"{'-':>7}"
        clean_s = f"{clean:8.1f}" if clean is not None else f"{'-':>8}"
        print(f"{row['scenario']:74} {clean_s} {dist:12.1f} {lost}  {cost(row['faults'])}")
    print(f"({os.cpu_count()} cores; each worker node 2 CPUs and one declared GPU; pytest exit {r.returncode})")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
