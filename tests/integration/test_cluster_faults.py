"""Node and worker loss mid-stage on a 3-raylet local cluster (issue #37 items 1, 2, 4).

One cluster for the module (:class:`multinode.LocalCluster`: a CPU-less head with the job server, two
worker nodes of 2 CPUs and one declared GPU each); every stage runs through ``ray job submit``. A
disturbed run loses a worker node (every process SIGKILLed) or one actor process mid-stage, a node is
added back as an autoscaler would, and the output must equal the undisturbed run's: the cache's
shard objects byte for byte, train's per-step losses and final weights; the summaries count what the
fault cost.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from chatgen import write_chats
from multinode import LocalCluster
from pipeline.run import DEFAULT_CONFIG
from training.checkpoint import COMMIT_RECORD

pytestmark = [pytest.mark.integration, pytest.mark.cluster_faults]

# cache.shard_delay_s: the tiny target prefills a shard in ~20 ms, so an actor would have no shard in flight
# when the fault lands; held 1 s each, the actor that just committed is always prefilling its next shard
CACHE = ["generate.enabled=false", "data.min_loss_tokens=1", "cache.rows_per_shard=5", "cache.num_workers=2",
         "cache.gpus_per_worker=1", "cache.cpus_per_worker=1", "cache.shard_delay_s=1.0"]
TRAIN = ["train.num_anchors=8", "train.drafters.dspark.markov_rank=8", "train.drafters.dspark.num_layers=1",
         "~train.drafters.dflash", "~train.drafters.eagle3", "train.num_workers=1", "train.concurrent_drafters=1", "train.heldout_shards=1",
         "train.validation_shards=0", "train.micro_batch_samples=4", "train.global_batch_samples=4",
         "train.zero_stage=0", "train.optimizer=adamw", "train.max_steps=8", "train.checkpoint_every_steps=2",
         "train.step_delay_s=1.0", "train.max_failures=2"]


# generate: one actor per (declared) GPU, so one per worker node; 5 rows a shard, each held 1 s before its write
GENERATE = ["generate.enabled=true", "generate.rows_per_shard=5", "generate.batch_size=5", "generate.max_new_tokens=16",
            "generate.shard_delay_s=1.0"]


def stage_entry(stage: str, target: str, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """The ``python -m pipeline.run`` command line of ``stage`` on ``data`` (tiny overrides)."""
    common = [o for o in CACHE if o != "generate.enabled=false"] + GENERATE if stage == "generate" else CACHE
    keys = {o.split("=", 1)[0] for o in extra}  # an extra override replaces the base one
    return [sys.executable, "-m", "pipeline.run", f"+stage={stage}", str(DEFAULT_CONFIG), f"target.path={target}",
            f"run_dir={run_dir}", f"data.train_files=[{data}]",
            *(o for o in [*common, *TRAIN] if o.split("=", 1)[0] not in keys), *extra]


def shard_bytes(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every shard object of a run's cache (relative path -> hex digest)."""
    root = run_dir / "cache" / "shards"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def commit_checksums(run_dir: Path) -> dict[str, dict]:
    """Each commit record's array checksums (shard file name -> checksums)."""
    return {p.name: json.loads(p.read_text())["checksums"] for p in sorted((run_dir / "cache" / "commits").glob("*.json"))}


def wait_for(pred, timeout_s: float, what: str) -> None:
    """Poll ``pred()`` every 0.2 s until it is true.

    Raises:
        TimeoutError: not true within ``timeout_s`` seconds (``what`` names it)."""
    deadline = time.time() + timeout_s
    while not pred():
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.2)


def run_disturbed(cluster: LocalCluster, entry: list[str], ready, fault, log: Path, timeout_s: float = 600,
                  env_vars: dict[str, str] | None = None):
    """Submit ``entry`` (job output to ``log``, ``env_vars`` in its runtime env), wait for ``ready()``
    (mid-stage), call ``fault()``, wait for the job's end; returns its wall seconds (submit to end).

    Raises:
        AssertionError: the stage ended before the fault, or failed."""
    t0 = time.time()
    job = cluster.submit_async(entry, log, env_vars)
    try:
        wait_for(lambda: ready() or job.poll() is not None, timeout_s, "the mid-stage point")
        assert job.poll() is None, "the stage ended before the fault: " + log.read_text()[-3000:]
        fault()
        job.wait(timeout=timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
            cluster.stop_jobs()
    assert job.returncode == 0, log.read_text()[-4000:]
    return time.time() - t0


CLEAN_SECONDS: dict[str, float] = {}  # stage -> wall seconds of its undisturbed run on the cluster


def submit_clean(cluster: LocalCluster, stage: str, entry: list[str]) -> None:
    """Submit an undisturbed run of ``stage`` and keep its wall seconds (submit to end) in :data:`CLEAN_SECONDS`.

    Raises:
        AssertionError: the job failed (its output attached)."""
    t0 = time.time()
    r = cluster.submit(entry)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    CLEAN_SECONDS[stage] = time.time() - t0


def record(scenario: str, stage: str | None, seconds: float, faults: dict) -> None:
    """Append what a fault scenario cost (disturbed wall seconds, the undisturbed run's when comparable,
    the summary's fault counts) as a JSON line to ``$DSPARK_FAULT_TIMES`` when it is set
    (``bench/bench_cluster_faults.py`` prints the table from it)."""
    out = os.environ.get("DSPARK_FAULT_TIMES")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"scenario": scenario, "clean_s": CLEAN_SECONDS.get(stage) if stage else None,
                                "disturbed_s": round(seconds, 1), "faults": faults}) + "\n")


def busy_writer(cluster: LocalCluster, run_dir: Path, stage: str = "cache"):
    """The worker node and pid of the actor that committed the stage's newest shard (its commit
    record's ``writer_id``, ``writer`` for generate, is ``host:pid``): an actor past its start-up,
    working on its next shard (``cache.shard_delay_s``, ``generate.shard_delay_s``)."""
    newest = max((run_dir / stage / "commits").glob("*.json"), key=lambda p: p.stat().st_mtime)
    key = "writer" if stage == "generate" else "writer_id"
    for _ in range(50):  # a local commit record is created, then written: it may be read empty once
        try:
            pid = int(json.loads(newest.read_text())[key].rsplit(":", 1)[1])
            break
        except json.JSONDecodeError:
            time.sleep(0.01)
    else:
        raise AssertionError(f"{newest} is not a commit record")
    return cluster.node_of_actor("MapWorker", pid=pid)


def kill_and_replace(cluster: LocalCluster, node) -> None:
    """Lose ``node`` (every process SIGKILLed) and add a fresh one back, as an autoscaler would."""
    cluster.kill_node(node)
    cluster.add_node()


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(workers=2, cpus=2) as c:
        yield c


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "chats.jsonl"
    write_chats(path, 60)  # 12 shards of 5 rows
    return path


@pytest.fixture(scope="module")
def clean_cache(cluster, tiny_target_dir, chats, tmp_path_factory) -> Path:
    """The undisturbed cache run's run_dir."""
    run_dir = tmp_path_factory.mktemp("clean")
    submit_clean(cluster, "cache", stage_entry("cache", tiny_target_dir, chats, run_dir))
    return run_dir


def _committed(run_dir: Path, stage: str = "cache") -> int:
    return len(list((run_dir / stage / "commits").glob("*.json")))


def test_cache_survives_a_lost_worker_node(cluster, tiny_target_dir, chats, clean_cache, tmp_path):
    run_dir = tmp_path / "run"
    seconds = run_disturbed(cluster, stage_entry("cache", tiny_target_dir, chats, run_dir), lambda: _committed(run_dir) >= 2,
                            lambda: kill_and_replace(cluster, busy_writer(cluster, run_dir)[0]),  # one prefill actor per worker node
                            tmp_path / "job.log")
    assert shard_bytes(run_dir) == shard_bytes(clean_cache) and len(commit_checksums(run_dir)) == 12
    assert commit_checksums(run_dir) == commit_checksums(clean_cache)
    faults = json.loads((run_dir / "cache" / "summary.json").read_text())["faults"]
    record("cache: worker node lost", "cache", seconds, faults)
    # the lost node's actor had one or two shards in flight (cache: two calls per actor at once)
    assert faults["actors_lost"] == 1 and len(faults["redone_shards"]) in (1, 2) and faults["retry_delay_seconds"] > 0
    clean = json.loads((clean_cache / "cache" / "summary.json").read_text())["faults"]
    assert clean == {"actors_started": 2, "actors_lost": 0, "redone_shards": [], "retry_delay_seconds": 0}


def test_cache_survives_a_killed_actor_process(cluster, tiny_target_dir, chats, clean_cache, tmp_path):
    """SIGKILL one prefill actor's process; its node stays up and the actor is restarted on it."""
    run_dir = tmp_path / "run"
    nodes = [n.node_id for n in cluster.workers]

    def kill_actor():
        os.kill(busy_writer(cluster, run_dir)[1], signal.SIGKILL)

    seconds = run_disturbed(cluster, stage_entry("cache", tiny_target_dir, chats, run_dir),
                            lambda: _committed(run_dir) >= 2, kill_actor, tmp_path / "job.log")
    assert [n.node_id for n in cluster.workers] == nodes
    assert shard_bytes(run_dir) == shard_bytes(clean_cache)
    faults = json.loads((run_dir / "cache" / "summary.json").read_text())["faults"]
    record("cache: prefill actor SIGKILLed", "cache", seconds, faults)
    assert faults["actors_lost"] == 1 and len(faults["redone_shards"]) in (1, 2)  # one actor: 2 calls at once


def _generated(run_dir: Path) -> dict[str, str]:
    """SHA-256 of each generate shard object and error file (relative path -> hex digest)."""
    root = run_dir / "generate"
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for sub in ("shards", "errors") for p in sorted((root / sub).glob("*")) if p.is_file()}


def test_generate_survives_a_lost_worker_node(cluster, tiny_target_dir, chats, tmp_path):
    """The generate actors (one per worker node) regenerate 12 shards of 5 rows; the node of the actor
    that just committed a shard is lost mid-shard and a node added back: the shard files equal the
    undisturbed run's byte for byte (each row's sampling seeded by its row, whichever actor runs it)."""
    clean = tmp_path / "clean"
    submit_clean(cluster, "generate", stage_entry("generate", tiny_target_dir, chats, clean))
    run_dir = tmp_path / "run"
    seconds = run_disturbed(cluster, stage_entry("generate", tiny_target_dir, chats, run_dir),
                            lambda: _committed(run_dir, "generate") >= 2,
                            lambda: kill_and_replace(cluster, busy_writer(cluster, run_dir, "generate")[0]),
                            tmp_path / "job.log")
    assert _generated(run_dir) == _generated(clean) and _committed(run_dir, "generate") == 12
    faults = json.loads((run_dir / "generate" / "summary.json").read_text())["faults"]
    record("generate: worker node lost", "generate", seconds, faults)
    assert faults["actors_lost"] == 1 and len(faults["redone_shards"]) in (1, 2) and faults["retry_delay_seconds"] > 0
    clean_faults = json.loads((clean / "generate" / "summary.json").read_text())["faults"]
    assert clean_faults == {"actors_started": 2, "actors_lost": 0, "redone_shards": [], "retry_delay_seconds": 0}


def _train_run(clean_cache: Path, run_dir: Path) -> Path:
    run_dir.mkdir()
    shutil.copytree(clean_cache / "cache", run_dir / "cache")
    return run_dir


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "train" / "dspark" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def _final_weights(run_dir: Path) -> bytes:
    ckpts = sorted((run_dir / "train" / "dspark" / "checkpoints").glob("step-*"))
    return (ckpts[-1] / "drafter.safetensors").read_bytes()


@pytest.fixture(scope="module")
def clean_train(cluster, tiny_target_dir, chats, clean_cache, tmp_path_factory) -> Path:
    """The undisturbed train run's run_dir (on the undisturbed cache)."""
    clean = _train_run(clean_cache, tmp_path_factory.mktemp("train") / "clean")
    submit_clean(cluster, "train", stage_entry("train", tiny_target_dir, chats, clean))
    return clean


def _train_faults(run_dir: Path) -> dict:
    return json.loads((run_dir / "train" / "summary.json").read_text())["drafters"]["dspark"]["faults"]


def test_streaming_train_resumes_after_a_lost_worker_node(cluster, tiny_target_dir, chats, clean_cache, clean_train,
                                                          tmp_path):
    """Train fed by the streaming prefill actors (``hybrid``: one per worker node, committing the cache
    while epoch 0 streams) loses the trainer's node, with a stream actor on it, after the first
    checkpoint: the group resumes from it, the stream restarts from the resume position, and the
    per-step losses and final weights equal the cache-mode run's (the same samples in the same
    order); the cache it writes equals the cache stage's byte for byte.

    Merged here (issue #51): the cache-mode run that lost its trainer's node (the same Ray Train group
    restart and checkpoint resume; the cache-mode restart after a node's loss is the preemption test's
    below) and the ``online`` run (its 8 steps lie in epoch 0, 55 training samples, 4 a step, where
    hybrid feeds the trainer from the same stream actors; ``online`` resuming after a SIGKILL:
    tests/integration/test_features_train.py)."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "train" / "dspark" / "checkpoints"

    def lose_trainer_node():
        kill_and_replace(cluster, cluster.node_of_actor("RayTrainWorker")[0])

    seconds = run_disturbed(cluster, stage_entry("train", tiny_target_dir, chats, run_dir, "train.features=hybrid"),
                            lambda: len(list(ckpts.glob(f"step-*/{COMMIT_RECORD}"))) >= 1, lose_trainer_node,
                            tmp_path / "job.log")
    assert _losses(run_dir) == _losses(clean_train) and [s for s, _ in _losses(run_dir)] == list(range(1, 9))
    assert _final_weights(run_dir) == _final_weights(clean_train)
    assert json.loads((run_dir / "train" / "dspark" / "result.json").read_text())["steps"] == 8
    faults = _train_faults(run_dir)
    record("train (hybrid features): trainer's node lost", "train", seconds, faults)
    assert faults["worker_group_restarts"] == 1 and faults["resumed_from_steps"][0] in (2, 4, 6)
    assert faults["preemption_checkpoints"] == []
    assert 0 <= faults["redone_steps"] <= 2 and faults["restart_seconds"] > 0
    assert shard_bytes(run_dir) == shard_bytes(clean_cache)


def test_a_preempted_train_node_resumes_with_identical_losses_and_weights(cluster, tiny_target_dir, chats,
                                                                            clean_cache, clean_train, tmp_path):
    """Spot preemption: after the first checkpoint the trainer's node is drained for preemption with a
    15 s deadline (what a cloud autoscaler does on a reclaim notice; AWS gives 120 s, GCP 30 s), a
    replacement node is added, and at the deadline the node is shut down: SIGTERM to every process,
    SIGKILL 5 s later. The trainer writes a checkpoint at the first step after the notice reaches it
    (``preemption_notice``; when Ray's watcher delivers it in time, see below), the group is restarted
    after the deadline (or when the node's shutdown kills it) and resumes from the newest checkpoint,
    that one or a periodic one written since: identical losses and weights, at most the step in flight
    redone. Steps are held 4 s here (1 s in the undisturbed run: the pause changes no number), so that
    the deadline falls before the last step."""
    run_dir = _train_run(clean_cache, tmp_path / "run")
    ckpts = run_dir / "train" / "dspark" / "checkpoints"
    deadline_s = 15

    def preempt():
        node, _ = cluster.node_of_actor("RayTrainWorker")
        noticed_at = time.time()
        cluster.drain_for_preemption(node, deadline_s)
        cluster.add_node()  # the autoscaler's replacement, starting while the notice runs
        time.sleep(max(0.0, noticed_at + deadline_s - time.time()))
        cluster.terminate_node(node, grace_s=5)

    seconds = run_disturbed(cluster, stage_entry("train", tiny_target_dir, chats, run_dir, "train.step_delay_s=4.0"),
                            lambda: len(list(ckpts.glob(f"step-*/{COMMIT_RECORD}"))) >= 1, preempt,
                            tmp_path / "job.log", env_vars={"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2"})
    assert _losses(run_dir) == _losses(clean_train) and _final_weights(run_dir) == _final_weights(clean_train)
    summary = _train_faults(run_dir)
    # Ray Train's watcher (polling the GCS every 0.2 s here) logs "preemption detected" in the job's output
    # when it passes the notice to the workers. Here it did within a step, and the trainer checkpointed at
    # the next step; on the busy 2-core machine it once had not by the SIGKILL (no such line at all), and
    # the run resumed as from a lost node: that case, too, has to equal the undisturbed run
    delivered = "preemption detected" in (tmp_path / "job.log").read_text()
    record("train: trainer's node preempted (15 s notice, SIGTERM, SIGKILL 5 s later)", None, seconds,
           {**summary, "notice_delivered": delivered})
    assert summary["worker_group_restarts"] == 1, summary
    (resumed,) = summary["resumed_from_steps"]
    reasons = {int(p.parent.name.split("-")[1]): json.loads(p.read_text())["reason"]
               for p in ckpts.glob(f"step-*/{COMMIT_RECORD}")}
    noticed = [step for step, why in reasons.items() if why == "preemption"]
    assert len(noticed) <= 1
    if noticed:  # at the first step after the notice: after the step-2 checkpoint that triggered the drain
        assert delivered and 3 <= noticed[0] <= resumed
    # the restart resumes from the newest checkpoint: the notice's, or a periodic one the group reached
    # before the deadline; the steps trained after it and before the fault are the only ones redone
    assert summary["preemption_checkpoints"] == ([resumed] if reasons[resumed] == "preemption" else [])
    assert 0 <= summary["redone_steps"] <= 1 and summary["restart_seconds"] > 0


EVALUATE = ["~evaluate.prompt_sets", "evaluate.num_prompts=4", "evaluate.max_new_tokens=24", "evaluate.block_samples=8",
            "evaluate.block_anchors=8", "evaluate.thresholds=[0.5]", "evaluate.concurrency=[1,4]", "evaluate.gpus=1",
            "evaluate.cpus=1", "calibrate.refit_prompts=0", "calibrate.gate_prompts=0"]


TIMED = ("_ms_per_round", "tokens_per_s", "speedup_vs_target")  # measured speeds in the decoding-loop results


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not k.endswith(TIMED)}
    return [_untimed(v) for v in value] if isinstance(value, list) else value


def _tables(run_dir: Path) -> str:
    """The evaluate summary's numbers that do not depend on the machine's speed: block-level and
    decoding-loop tau and acceptance, thresholds, as JSON text (so NaN equals NaN); the speeds, the
    scheduler and the SPS curve are timed, so they are left out."""
    s = json.loads((run_dir / "evaluate" / "summary.json").read_text())
    return json.dumps(_untimed({k: s[k] for k in ("blocks", "results", "thresholds", "prompts")}), sort_keys=True)


def test_evaluate_survives_a_lost_worker_node(cluster, tiny_target_dir, chats, clean_train, tmp_path):
    """The evaluate task (one declared GPU, so on a worker node) loses its node mid-run; Ray reruns the
    task on the other node (``TASK_RETRIES``) and the tables equal the undisturbed run's. Calibrate's task
    takes the same path (``pipeline.stages.calibrate.run_task``); at this size it lasts about 5 s, less
    than a fault here takes to land, so it has no disturbed run of its own."""
    clean = tmp_path / "clean"
    shutil.copytree(clean_train, clean)
    submit_clean(cluster, "calibrate", stage_entry("calibrate", tiny_target_dir, chats, clean, *EVALUATE))
    run_dir = tmp_path / "run"
    shutil.copytree(clean, run_dir)
    submit_clean(cluster, "evaluate", stage_entry("evaluate", tiny_target_dir, chats, clean, *EVALUATE))
    attempts = run_dir / "evaluate" / "attempts"

    def started() -> bool:
        return any(attempts.rglob("*.json"))

    def lose_its_node():
        time.sleep(3)  # past the target's load, into the evaluation
        kill_and_replace(cluster, cluster.node_of_actor("dspark-evaluate")[0])

    seconds = run_disturbed(cluster, stage_entry("evaluate", tiny_target_dir, chats, run_dir, *EVALUATE), started,
                            lose_its_node, tmp_path / "job.log")
    assert _tables(run_dir) == _tables(clean)
    faults = json.loads((run_dir / "evaluate" / "summary.json").read_text())["faults"]
    record("evaluate: the task's node lost", "evaluate", seconds, faults)
    assert faults["task_attempts"] == 2 and faults["nodes"] == 2 and faults["retry_seconds"] > 3
    assert json.loads((clean / "evaluate" / "summary.json").read_text())["faults"]["task_attempts"] == 1
