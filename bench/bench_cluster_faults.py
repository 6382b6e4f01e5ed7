"""Wall time a lost worker node or a killed actor costs each stage on a 3-raylet local cluster.

The scenarios of ``tests/test_cluster_faults.py`` (same cluster, data and overrides): each stage is
submitted with ``ray job submit`` undisturbed, then disturbed (a worker node's processes SIGKILLed
mid-stage and a fresh node added back, or one prefill actor process SIGKILLed), and the table shows
both job wall times (submit to end, driver start-up included), their difference and ratio, and what
the stage's summary counted. Needs a built tiny target: one is made in a temporary folder.

    .venv/bin/python bench/bench_cluster_faults.py [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from chatgen import write_chats  # noqa: E402
from multinode import LocalCluster  # noqa: E402
from test_cluster_faults import (_committed, _final_weights, _losses, _train_run, busy_writer,  # noqa: E402
                                 kill_and_replace, run_disturbed, shard_bytes, stage_entry)


def tiny_target(folder: Path) -> str:
    """The tests' tiny random Qwen3 (tests/conftest.py) with its tokenizer, saved to ``folder``."""
    import conftest

    model = conftest.tiny_qwen3.__wrapped__()
    tok = conftest.tiny_tokenizer.__wrapped__()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def timed_submit(cluster: LocalCluster, entry: list[str]) -> float:
    t0 = time.time()
    r = cluster.submit(entry)
    if r.returncode != 0:
        raise RuntimeError(r.stdout[-3000:])
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario (the median is shown)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(workers=2, cpus=2) as cluster:
        tmp = Path(tmp)
        (tmp / "target").mkdir()
        target = tiny_target(tmp / "target")
        chats = tmp / "chats.jsonl"
        write_chats(chats, 60)
        times: dict[str, list[float]] = {}
        counted: dict[str, dict] = {}
        for k in range(args.repeat):
            clean = tmp / f"clean{k}"
            times.setdefault("cache clean", []).append(timed_submit(cluster, stage_entry("cache", target, chats, clean)))
            for fault in ("node", "actor"):
                run = tmp / f"cache-{fault}{k}"

                def act(fault=fault, run=run):
                    node, pid = busy_writer(cluster, run)
                    if fault == "node":
                        kill_and_replace(cluster, node)
                    else:
                        os.kill(pid, signal.SIGKILL)

                s = run_disturbed(cluster, stage_entry("cache", target, chats, run),
                                  lambda run=run: _committed(run) >= 2, act, tmp / f"cache-{fault}{k}.log")
                assert shard_bytes(run) == shard_bytes(clean), f"cache after a lost {fault}: shards differ"
                times.setdefault(f"cache {fault}", []).append(s)
                counted[f"cache {fault}"] = json.loads((run / "cache" / "summary.json").read_text())["faults"]
            tclean = _train_run(clean, tmp / f"train-clean{k}")
            times.setdefault("train clean", []).append(timed_submit(cluster, stage_entry("train", target, chats, tclean)))
            trun = _train_run(clean, tmp / f"train-node{k}")
            ckpts = trun / "train" / "dspark" / "checkpoints"
            s = run_disturbed(cluster, stage_entry("train", target, chats, trun),
                              lambda: len(list(ckpts.glob("step-*/COMMITTED.json"))) >= 1,
                              lambda: kill_and_replace(cluster, cluster.node_of_actor("RayTrainWorker")[0]),
                              tmp / f"train-node{k}.log")
            assert _losses(trun) == _losses(tclean) and _final_weights(trun) == _final_weights(tclean), \
                "train after a lost node: losses or weights differ"
            times.setdefault("train node", []).append(s)
            counted["train node"] = json.loads((trun / "train" / "summary.json").read_text())["drafters"]["dspark"]["faults"]
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in ("cache node", "cache actor", "train node"):
        stage = name.split()[0]
        base = med[f"{stage} clean"]
        rows.append((name, base, med[name], med[name] - base, med[name] / base, counted[name]))
    print(f"{'scenario':12} {'clean s':>8} {'disturbed s':>12} {'lost s':>7} {'ratio':>6}  counted (last run)")
    for name, base, dist, lost, ratio, c in rows:
        print(f"{name:12} {base:8.1f} {dist:12.1f} {lost:7.1f} {ratio:6.2f}x  {json.dumps(c)}")
    print(f"(runs per scenario: {args.repeat}, median shown; {os.cpu_count()} cores, shared machine)")


if __name__ == "__main__":
    main()
