"""Ray start-up shared by every stage: join a cluster when there is one, else start a local one."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline.config import RayConfig


def init_ray(cfg: RayConfig) -> None:
    """Connect to ``cfg.address`` or ``$RAY_ADDRESS`` (set by ``ray job submit``), else start a
    local instance. Idempotent. Credentials are never shipped: a local instance's workers inherit
    this process's environment, and cluster nodes use their own (AWS_* variables, IAM roles)."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # no dashboard, so no state API: quiet the Ray Train thread that polls it (see below)
        reap_orphaned_instances()
        # A workstation is not preempted: Ray Train's preemption watcher (an actor per trainer
        # polling for node drains) only takes CPU from the workers (docs/training-recipe.md).
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False,
                 runtime_env={"worker_process_setup_hook": "pipeline.cluster.quiet_ray_workers"})
        record_local_instance()
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the stages draw their own bars (samples, tokens, bytes)
    ctx.print_on_execution_start = False


LOCAL_RECORDS = Path.home() / ".cache" / "dspark" / "ray-local"
"""One JSON file per live local Ray instance this product started: its driver and Ray's processes."""


def _identity(proc) -> list[float]:
    return [proc.pid, proc.create_time()]  # (pid, start time): a pid reused by another process never matches


def record_local_instance(records: Path = LOCAL_RECORDS) -> Path:
    """Record the local Ray instance this driver just started (its GCS, raylet, agents and workers:
    every descendant process now), removed again at a clean exit. A driver killed with SIGKILL
    leaves its record behind, and :func:`reap_orphaned_instances` stops what outlived it."""
    import atexit

    import psutil

    me = psutil.Process()
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{me.pid}.json"
    path.write_text(json.dumps({"driver": _identity(me), "processes": [_identity(p) for p in me.children(recursive=True)]}))
    atexit.register(path.unlink, missing_ok=True)
    return path


def reap_orphaned_instances(records: Path = LOCAL_RECORDS, grace_s: float = 5.0) -> int:
    """Stop the Ray processes of local instances whose driver is gone (killed before Ray could shut
    down: ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` outlive it, ignoring SIGTERM), and
    drop their records. Only processes recorded by :func:`record_local_instance` and still running with
    the same start time are touched: never another user's or another live run's Ray.

    Returns:
        The number of processes stopped (SIGTERM, then SIGKILL after ``grace_s`` seconds).
    """
    import psutil

    stopped: list = []
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _alive(*rec["driver"]):
            continue  # a live run's instance
        for pid, started in rec["processes"]:
            proc = _alive(pid, started)
            if proc is not None:
                proc.terminate()
                stopped.append(proc)
        path.unlink(missing_ok=True)
    _, left = psutil.wait_procs(stopped, timeout=grace_s)
    for proc in left:
        proc.kill()
    psutil.wait_procs(left, timeout=grace_s)  # SIGKILL is delivered asynchronously: gone on return
    return len(stopped)


def _alive(pid: int, started: float):
    """The running process ``pid`` if it started at ``started``, else None."""
    import psutil

    try:
        proc = psutil.Process(int(pid))
        return proc if abs(proc.create_time() - started) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def quiet_ray_workers() -> None:
    """Ray's ``worker_process_setup_hook`` of a local instance: Ray Train's placement-group cleaner
    asks the state API whether the controller is alive every second and, without a dashboard,
    logs a warning each time (100+ lines a run); only its errors are kept."""
    import logging

    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_head(num_cpus: int, env: dict[str, str] | None = None, timeout_s: float = 120):
    """Start a Ray head on 127.0.0.1 (``ray start --head --block``) for ``ray job submit``; yield
    ``(ray_bin, dashboard_address, env)`` and stop the head's process group on exit.

    Every port is chosen free (another Ray instance on the machine may hold the defaults), and only
    this head is stopped (``ray stop`` would stop every Ray instance of the machine). ``env`` (default
    this process's) is the head's environment, which submitted jobs inherit (e.g. AWS_* variables).

    Raises:
        RuntimeError: the head's job API did not answer within ``timeout_s`` seconds.
    """
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**(os.environ if env is None else env), "RAY_AUTH_MODE": "disabled"}
    temp = Path("/tmp") / f"rh{os.getpid()}"
    dash = free_port()
    ports = {flag: free_port() for flag in ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                             "metrics-export-port", "runtime-env-agent-port")}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--temp-dir={temp}",
                             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                             "--disable-usage-stats", *(f"--{k}={v}" for k, v in ports.items())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + timeout_s
        while subprocess.run([ray_bin, "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            if time.time() > deadline or head.poll() is not None:
                raise RuntimeError(f"the local Ray head did not start within {timeout_s:.0f} s")
            time.sleep(1)
        yield ray_bin, address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def submit(ray_bin: str, address: str, env: dict[str, str], entrypoint: list[str], timeout_s: float):
    """``ray job submit --address ADDRESS -- ENTRYPOINT``, retried while the head's job agent is still
    starting (it may answer a few seconds after the dashboard). Returns the CompletedProcess; raises
    subprocess.TimeoutExpired after ``timeout_s`` seconds of one attempt."""
    for _ in range(20):
        r = subprocess.run([ray_bin, "job", "submit", "--address", address, "--", *entrypoint], env=env,
                           capture_output=True, text=True, timeout=timeout_s)
        if "No available agent" not in r.stdout + r.stderr:
            return r
        time.sleep(3)
    return r
