"""A multi-node Ray cluster on one machine for the cluster-fault tests (issue #37 items 1-2).

A head and worker nodes are separate raylets, each a ``ray start --block`` process in its own
session with its own ports, CPUs and resources: the head has no CPU (only the job driver runs there,
as ``ray job submit`` puts it), each worker node has CPUs and one GPU (declared, not real: the stages'
``gpus_per_worker`` / ``num_gpus`` then place one prefill or generate actor per worker node, and the
actor, finding no CUDA device, runs on the CPU). The head's temp dir is private (``/tmp/mn<pid>``), so
Ray's "current cluster" file of the default temp dir is never written and another process's
``ray.init()`` never joins this cluster. Stages run through the head's job server
(:func:`pipeline.cluster.submit`), exactly as a user submits them.

:meth:`LocalCluster.kill_node` SIGKILLs a node's whole process tree (its ``ray start``, raylet,
agents and every worker it spawned), what a lost machine looks like to the head; :meth:`add_node`
adds one back, as an autoscaler would.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from pipeline.cluster import free_port, submit

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


def _kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc`` and all its descendants, wait for them; returns how many there were."""
    try:
        procs = [psutil.Process(proc.pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
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

    Use as a context manager; the exit stops every node it started (by process tree, never
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
            while subprocess.run([RAY_BIN, "job", "list", "--address", self.address], env=self.env,
                                 capture_output=True).returncode != 0:
                if time.time() > deadline or self.head.proc.poll() is not None:
                    raise RuntimeError(f"the Ray head did not start within {timeout_s:.0f} s: "
                                       + self.head.log.read_text()[-2000:])
                time.sleep(1)
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

    def add_node(self) -> Node:
        """Start a worker node (``cpus`` CPUs, one GPU) and wait until the head lists it alive."""
        known = {n["node_id"] for n in self.nodes()}
        node = self._start([f"--address=127.0.0.1:{self.gcs_port}", f"--num-cpus={self.cpus}", "--num-gpus=1",
                            "--min-worker-port=0", "--max-worker-port=0", "--object-store-memory=200000000",
                            *_ports(*_NODE_PORTS)])
        self.workers.append(node)
        deadline = time.time() + self.timeout_s
        while True:
            new = [n for n in self.nodes() if n["node_id"] not in known and n["state"] == "ALIVE"
                   and not n["is_head_node"] and n["node_id"] not in {w.node_id for w in self.workers}]
            if new:
                node.node_id = new[0]["node_id"]
                return node
            if time.time() > deadline or node.proc.poll() is not None:
                raise RuntimeError(f"a worker node did not join within {self.timeout_s:.0f} s: "
                                   + node.log.read_text()[-2000:])
            time.sleep(0.5)

    def kill_node(self, node: Node) -> int:
        """SIGKILL every process of ``node`` (its ``ray start``, raylet, agents, workers); returns how
        many. The node is dropped from :attr:`workers`; the head marks it dead after its heartbeat timeout."""
        n = _kill_tree(node.proc)
        self.workers.remove(node)
        return n

    def node_of_actor(self, class_name: str, pid: int | None = None) -> tuple[Node, int]:
        """The worker node and pid of a live actor whose class name contains ``class_name`` (and whose
        process is ``pid``, when given).

        Raises:
            LookupError: no such actor is alive (yet)."""
        from ray.util.state import list_actors

        for a in list_actors(address=self.address, filters=[("state", "=", "ALIVE")], limit=10_000,
                             raise_on_missing_output=False):
            if class_name in a.class_name and pid in (None, a.pid):
                for n in self.workers:
                    if n.node_id == a.node_id:
                        return n, a.pid
        raise LookupError(f"no live actor {class_name!r} on a worker node")

    def submit(self, entrypoint: list[str], timeout_s: float = 400):
        """``ray job submit`` of ``entrypoint`` (:func:`pipeline.cluster.submit`): the CompletedProcess."""
        return submit(RAY_BIN, self.address, self.env, entrypoint, timeout_s)

    def submit_async(self, entrypoint: list[str], output: Path) -> subprocess.Popen:
        """``ray job submit`` (waiting for the job's end) in the background, its output (the job's
        logs) in the file ``output``: the Popen."""
        with output.open("wb") as out:
            return subprocess.Popen([RAY_BIN, "job", "submit", "--address", self.address, "--", *entrypoint],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def close(self) -> None:
        """SIGKILL every node's process tree (nothing of the cluster is worth a graceful stop) and
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
