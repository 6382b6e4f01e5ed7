"""The demo as a cluster user runs it: `+stage=all conf/tiny.yaml` submitted with `ray job submit` to a
local Ray head, `run_dir` on a local S3 server (moto); its figures are then compared, side by side,
with those of a local `make demo` run.

    python bench/demo_cluster.py [--local runs/tiny]      (make demo-cluster)
"""
from __future__ import annotations

import argparse
import sys
import time

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


def main() -> None:
    from pipeline.cluster import local_head, submit
    from pipeline.run import DEFAULT_CONFIG

    ap = argparse.ArgumentParser()
    ap.add_argument("--local", default=str(REPO / "runs" / "tiny"), help="run_dir of a local `make demo`")
    args = ap.parse_args()
    with s3_server() as bucket:
        run_dir = f"{bucket}/tiny"
        with local_head(num_cpus=2) as (ray_bin, address, env):
            t0 = time.perf_counter()
            r = submit(ray_bin, address, env, [sys.executable, "-m", "pipeline.run", "+stage=all",
                                               str(DEFAULT_CONFIG), f"run_dir={run_dir}"], timeout_s=3600)
            seconds = time.perf_counter() - t0
        print(r.stdout[-4000:])
        if r.returncode != 0:
            sys.exit(f"ray job failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        remote, local = figures(run_dir), figures(args.local)
    print(f"\n`ray job submit` of +stage=all with run_dir={run_dir}: {seconds:.0f} s\n")
    print(f"| figure | local ({args.local}) | ray job + S3 | same |\n|---|---|---|---|")
    for k, v in remote.items():
        print(f"| {k} | {local.get(k)} | {v} | {'yes' if local.get(k) == v else 'NO'} |")
    same = sum(local.get(k) == v for k, v in remote.items())
    print(f"\n{same} of {len(remote)} figures identical")


if __name__ == "__main__":
    main()
