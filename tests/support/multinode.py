"""A multi-node Ray cluster on one machine for the cluster-fault tests (issue #37 items 1-2).

A head and worker nodes are separate raylets, each a ``ray start --block`` process in its own
session with its own ports, CPUs and resources: the head has no CPU (only the job driver runs there,
as ``ray job submit`` puts it), each worker node has CPUs and one GPU (declared, not real: the stages'
``gpus_per_worker`` / ``num_gpus`` then place one prefill or generate actor per worker node, and the
actor, finding no CUDA device, runs on the CPU). The head's temp dir is private (``/tmp/mn<pid>``), so
Ray's "current cluster" file of the default temp dir is never written and another process's
``ray.init()`` never joins this cluster. Stages run through the head's job server
(:func:`pipeline.cluster.submit`), exactly as a user submits them.

:meth:`LocalCluster.kill_node` SIGKILLs every process of a node (its session: its ``ray start``, raylet,
agents and every worker it spawned), what a lost machine looks like to the head; :meth:`add_node`
adds one back, as an autoscaler would.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline.cluster import START_TIMEOUT, free_port, job_api_answers, submit

RAY_BIN = str(Path(sys.executable).parent / "ray")


@dataclass
class Node:
    """One raylet: its ``ray start --block`` process, that process's output file and its Ray node id (hex)."""

    proc: subprocess.Popen
    log: Path
    node_id: str = ""


def _ports(*flags: str) -> list[str]:
    return [f"--{f}={free_port()}" for f in flags]


_NODE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "runtime-env-agent-port")


def _session(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every live process of ``proc``'s session (``proc`` is a session leader, ``start_new_session``): its
    ``ray start``, raylet, agents and workers, also those orphaned when ``ray start`` itself exited."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def _kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL every process of ``proc``'s session (:func:`_session`), wait for them; returns how many."""
    procs = _session(proc)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    proc.wait(timeout=10)
    return len(procs)


class LocalCluster:
    """A head (job server, no CPU) and ``workers`` worker nodes of ``cpus`` CPUs and one GPU each.

    Use as a context manager; the exit stops every node it started (by session, never
    ``ray stop``, which would stop every Ray instance of the machine).

    Raises:
        RuntimeError: the head's job API or a node did not come up within ``timeout_s`` seconds.
    """

    def __init__(self, workers: int = 2, cpus: int = 2, timeout_s: float = 240):
        self.cpus, self.timeout_s = cpus, timeout_s
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
        self.temp = Path("/tmp") / f"mn{os.getpid()}"
        self.logs: list[Path] = []
        self.gcs_port, dash = free_port(), free_port()
        self.address = f"http://127.0.0.1:{dash}"
        self.head = self._start(["--head", f"--port={self.gcs_port}", "--num-cpus=0", f"--temp-dir={self.temp}",
                                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--object-store-memory=100000000",
                                 *_ports(*_NODE_PORTS[2:])])
        self.workers: list[Node] = []
        try:
            deadline = time.time() + timeout_s
            while not job_api_answers(self.address):
                if time.time() > deadline or self.head.proc.poll() is not None:
                    raise RuntimeError(f"the Ray head did not start within {timeout_s:.0f} s: "
                                       + self.head.log.read_text()[-2000:])
                time.sleep(0.5)
            for _ in range(workers):
                self.add_node()
        except BaseException:
            self.close()
            raise

    def _start(self, args: list[str]) -> Node:
        """A ``ray start --block`` process in its own session, its output in ``/tmp/mn<pid>-<n>.log``."""
        log = Path(f"{self.temp}-{len(self.logs)}.log")
        self.logs.append(log)
        with log.open("wb") as out:
            proc = subprocess.Popen([RAY_BIN, "start", "--block", "--node-ip-address=127.0.0.1",
                                     "--disable-usage-stats", *args], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return Node(proc, log)

    def nodes(self) -> list[dict]:
        """The cluster's node table (``ray.util.state.list_nodes``: ``node_id``, ``state``, ``resources_total``)."""
        from ray.util.state import list_nodes

        return [n.__dict__ for n in list_nodes(address=self.address, limit=10_000, raise_on_missing_output=False)]

    def add_node(self, attempts: int = 3) -> Node:
        """Start a worker node (``cpus`` CPUs, one GPU) and wait until the head lists it alive. A ``ray
        start`` that gives up because its raylet did not register within Ray's 30 s (a busy machine, a
        GCS still handling a lost node: :data:`pipeline.cluster.START_TIMEOUT`) is cleaned up and tried
        again, up to ``attempts`` times.

        Raises:
            RuntimeError: the node did not join (its ``ray start`` output attached)."""
        known = {n["node_id"] for n in self.nodes()}
        for attempt in range(1, attempts + 1):
            node = self._start([f"--address=127.0.0.1:{self.gcs_port}", f"--num-cpus={self.cpus}", "--num-gpus=1",
                                "--min-worker-port=0", "--max-worker-port=0", "--object-store-memory=200000000",
                                *_ports(*_NODE_PORTS)])
            deadline = time.time() + self.timeout_s
            while True:
                new = [n for n in self.nodes() if n["node_id"] not in known and n["state"] == "ALIVE"
                       and not n["is_head_node"] and n["node_id"] not in {w.node_id for w in self.workers}]
                if new:
                    node.node_id = new[0]["node_id"]
                    self.workers.append(node)
                    return node
                if node.proc.poll() is not None or time.time() > deadline:
                    break
                time.sleep(0.5)
            _kill_tree(node.proc)
            if START_TIMEOUT not in node.log.read_text() or attempt == attempts:
                raise RuntimeError(f"a worker node did not join (try {attempt}, {self.timeout_s:.0f} s each): "
                                   + node.log.read_text()[-2000:])
        raise AssertionError("unreachable")

    def kill_node(self, node: Node) -> int:
        """SIGKILL every process of ``node`` (its ``ray start``, raylet, agents, workers); returns how
        many. The node is dropped from :attr:`workers`; the head marks it dead after its heartbeat timeout."""
        n = _kill_tree(node.proc)
        self.workers.remove(node)
        return n

    def terminate_node(self, node: Node, grace_s: float) -> int:
        """Stop ``node`` as a preempted machine's shutdown does: SIGTERM to every process of it, then, after
        ``grace_s`` seconds, SIGKILL to those still alive; returns how many were signalled. The node
        is dropped from :attr:`workers`."""
        procs = _session(node.proc)
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        _kill_tree(node.proc)
        self.workers.remove(node)
        return len(procs)

    def drain_for_preemption(self, node: Node, deadline_s: int) -> None:
        """Tell the head that ``node`` will be taken away in ``deadline_s`` seconds, as a cloud
        autoscaler does on a spot reclaim notice (the GCS drain request ``ray drain-node`` sends, reason
        ``DRAIN_NODE_REASON_PREEMPTION``): Ray Train's preemption watcher then reports it to the workers.

        Raises:
            RuntimeError: the head refused the drain."""
        import ray._raylet
        from ray.core.generated import autoscaler_pb2

        client = ray._raylet.GcsClient(address=f"127.0.0.1:{self.gcs_port}")
        accepted, why = client.drain_node(node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                          "spot reclaim (test)", int(time.time() * 1000) + deadline_s * 1000)
        if not accepted:
            raise RuntimeError(f"the drain of node {node.node_id} was refused: {why}")

    def node_of_actor(self, class_name: str, pid: int | None = None) -> tuple[Node, int]:
        """The worker node and pid of a live actor whose class name contains ``class_name`` (and whose
        process is ``pid``, when given), found from the process table: each node's processes are its
        ``ray start``'s session, and an actor's process is titled ``ray::<class name>`` (``.<method>``
        added while a call runs). Instant, where the state API can take seconds on a busy machine
        (a fault meant to land mid-shard or mid-step would land too late).

        Raises:
            LookupError: no such actor is alive (yet)."""
        for n in self.workers:
            for p in _session(n.proc):
                try:
                    title = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                if title.startswith("ray::") and class_name in title and pid in (None, p.pid):
                    return n, p.pid
        raise LookupError(f"no live actor {class_name!r} on a worker node")

    def submit(self, entrypoint: list[str], timeout_s: float = 400):
        """``ray job submit`` of ``entrypoint`` (:func:`pipeline.cluster.submit`): the CompletedProcess."""
        return submit(RAY_BIN, self.address, self.env, entrypoint, timeout_s)

    def submit_async(self, entrypoint: list[str], output: Path, env_vars: dict[str, str] | None = None) -> subprocess.Popen:
        """``ray job submit`` (waiting for the job's end) in the background, its output (the job's
        logs) in the file ``output``, ``env_vars`` set for the job's every process (its runtime env):
        the Popen."""
        extra = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
        with output.open("wb") as out:
            return subprocess.Popen([RAY_BIN, "job", "submit", "--address", self.address, *extra, "--", *entrypoint],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def stop_jobs(self) -> int:
        """Stop every job still running (a test that gave up on one must not leave it holding the
        nodes for the next); returns how many were asked to stop."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(self.address)
        running = [j.submission_id for j in client.list_jobs() if j.status in (JobStatus.PENDING, JobStatus.RUNNING)]
        for job in running:
            client.stop_job(job)
        return len(running)

    def close(self) -> None:
        """SIGKILL every process of every node (nothing of the cluster is worth a graceful stop) and
        remove the head's temp dir and the nodes' output files."""
        for node in [*self.workers, self.head]:
            _kill_tree(node.proc)
        shutil.rmtree(self.temp, ignore_errors=True)
        for log in self.logs:
            log.unlink(missing_ok=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
