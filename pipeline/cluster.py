"""Ray start-up shared by every stage: join a cluster only when asked, else start a private instance.

The rule (issue #37 item 5): a run joins a Ray cluster only when it is given one, by ``ray.address``
(an address, or ``auto`` for the cluster of this machine's latest ``ray start``) or by ``$RAY_ADDRESS``
(which ``ray job submit`` sets for its driver). Otherwise it starts a private instance
(``ray.init(address="local")``) whatever else runs on the machine: a user's ``ray start`` cluster or
another run's private instance is never joined by accident, and ``ray.num_cpus`` /
``ray.object_store_memory`` always apply.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from pipeline.config import RayConfig

log = logging.getLogger("pipeline.cluster")


def ray_address(cfg: RayConfig) -> Optional[str]:
    """The Ray cluster a run joins: ``cfg.address``, else ``$RAY_ADDRESS``; None (unset or empty):
    start a private instance. ``auto`` is resolved to the cluster of this machine's latest
    ``ray start`` (the GCS address it wrote to ``ray_current_cluster`` in Ray's default temp dir,
    ``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``: Ray's own discovery,
    ``ray._private.services.find_bootstrap_address``), never to any other instance found running
    (Ray's legacy fallback for ``auto``, which could pick another run's private instance).

    Raises:
        ConnectionError: ``auto`` was asked for and no ``ray start`` cluster is recorded on this machine.
    """
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_bootstrap_address

    address = cfg.address or os.environ.get("RAY_ADDRESS") or None
    if address != "auto":
        return address
    found = find_bootstrap_address(None)
    if not found:
        raise ConnectionError(
            f"ray.address=auto (or RAY_ADDRESS=auto) but no `ray start` cluster is recorded on this machine "
            f"({get_ray_address_file(None)} is absent): start one with `ray start --head`, give its address "
            "(ray.address=HOST:6379), or leave ray.address unset for a private instance")
    return found


def init_ray(cfg: RayConfig, *, watch_object_store: bool = False) -> None:
    """Join the cluster :func:`ray_address` names, else start a private local instance with
    ``cfg.num_cpus`` CPUs and a ``cfg.object_store_memory``-byte object store. Idempotent for the
    connection; with ``watch_object_store`` (the cache stage) the call restarts the object-store
    window that :func:`object_store_figures` reports. Credentials are never shipped: a local instance's workers
    inherit this process's environment, and cluster nodes use their own (AWS_* variables, IAM roles).

    Raises:
        ConnectionError: see :func:`ray_address`.
    """
    import ray

    if not ray.is_initialized():
        address = ray_address(cfg)
        if address:
            local_only = {k: getattr(cfg, k) for k in ("num_cpus", "object_store_memory") if getattr(cfg, k) is not None}
            if local_only:
                log.warning("ray: joining the cluster at %s; %s apply to a private instance only and are ignored "
                            "(the cluster's `ray start` flags set them)", address,
                            ", ".join(f"ray.{k}={v}" for k, v in local_only.items()))
            ray.init(address=address)
        else:  # no dashboard, so no state API: quiet the Ray Train thread that polls it (see below)
            reap_orphaned_instances()
            # A workstation is not preempted: Ray Train's preemption watcher (an actor per trainer
            # polling for node drains) only takes CPU from the workers (docs/training-recipe.md).
            os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
            start_private_instance(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
                                   include_dashboard=False,
                                   runtime_env={"worker_process_setup_hook": "pipeline.cluster.quiet_ray_workers"})
            record_local_instance()
    if watch_object_store:
        from ray._private.internal_api import get_state_from_address

        OBJECT_STORE_WATCH.restart(get_state_from_address(ray.get_runtime_context().gcs_address))
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the stages draw their own bars (samples, tokens, bytes)
    ctx.print_on_execution_start = False


START_TIMEOUT = "timed out during startup"
"""Ray's error when a new node's raylet did not register with its GCS within 30 s (a constant of
``ray._private.node.Node``): a machine busy with other runs, several instances starting at once."""


def start_private_instance(attempts: int = 3, **init_kwargs) -> None:
    """``ray.init(address="local", **init_kwargs)``, tried up to ``attempts`` times while Ray's start
    times out (:data:`START_TIMEOUT`); the processes a failed try left (its GCS, raylet, agents: this
    process's children started since) are stopped before the next.

    Raises:
        Exception: Ray's own error, from the last try or from any other failure.
    """
    import psutil
    import ray

    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            ray.init(address="local", **init_kwargs)
            return
        except Exception as e:
            if START_TIMEOUT not in str(e) or attempt == attempts:
                raise
            left = [p for p in me.children(recursive=True) if p.pid not in before]
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(left, timeout=10)
            log.warning("ray: a private instance %s (try %d of %d), likely a busy machine; trying again",
                        START_TIMEOUT, attempt, attempts)


def object_store_stats(state) -> dict[str, int]:
    """The object store's figures now, summed over the cluster's nodes (bytes; spilled and restored
    since each raylet started). Source: the raylet's ``FormatGlobalMemoryInfo`` reply
    (``ray._private.internal_api.get_memory_info_reply``, one gRPC call that the asked raylet fans
    out to every node), the same call behind ``ray memory --stats-only`` and Ray Data's "Spilled to
    disk" line. ``state``: a ``GlobalState`` of the cluster (``get_state_from_address``); an alive
    raylet is looked up on each call, so a lost node does not break it."""
    from ray._private.internal_api import get_memory_info_reply

    s = get_memory_info_reply(state, timeout_seconds=30.0).store_stats
    return {"used": s.object_store_bytes_used, "capacity": s.object_store_bytes_avail,
            "spilled": s.spilled_bytes_total, "restored": s.restored_bytes_total,
            "fallback": s.object_store_bytes_fallback}


class ObjectStoreWatch:
    """Samples :func:`object_store_stats` every ``interval_s`` seconds in a daemon thread, from
    :meth:`restart` until :meth:`figures`. The peak is the largest sampled use (a lower bound of the
    true peak, which may fall between two samples); spilled and restored bytes are the differences
    between the window's last and first samples (exact). On a shared cluster they include other jobs'.

    The thread must stop before Ray shuts down: a node-table call in flight when the GCS connection
    closes fails a ``RAY_CHECK`` in Ray's C++ client and aborts the whole process (SIGABRT, which no
    ``except`` catches). :meth:`restart` therefore registers :meth:`_halt` with ``atexit`` (after
    Ray's own hook, so it runs first), and :meth:`figures` halts it too."""

    KEYS = tuple(f"object_store_{k}_bytes" for k in ("capacity", "peak", "spilled", "restored", "fallback_peak"))

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._lock = threading.Lock()       # the samples
        self._control = threading.RLock()  # the window: restart, figures and halt from any thread
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._first: Optional[dict[str, int]] = None
        self._last: Optional[dict[str, int]] = None
        self._peak = self._fallback_peak = 0
        self._state = None
        self._halt_at_exit = False

    def restart(self, state) -> None:
        """Start a new window (stopping the running one) on the cluster of ``state`` (a ``GlobalState``)."""
        with self._control:
            self._halt()
            if not self._halt_at_exit:  # registered after ``import ray`` registered ray.shutdown: runs before it
                atexit.register(self._halt)
                self._halt_at_exit = True
            self._state = state
            with self._lock:
                self._first, self._last, self._peak, self._fallback_peak = None, None, 0, 0
            self._try_sample()
            self._stop = threading.Event()  # the new thread's own: a later window never revives an old thread
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="object-store-watch", daemon=True)
            self._thread.start()

    def figures(self) -> dict[str, Optional[int]]:
        """End the window (its last sample taken now; no Ray call after this until the next
        :meth:`restart`): ``object_store_capacity_bytes``, ``object_store_peak_bytes``,
        ``object_store_spilled_bytes``, ``object_store_restored_bytes`` and
        ``object_store_fallback_peak_bytes`` (objects put in the disk fallback because the store was
        full); all None when no window was started (Ray never initialised by this process) or no
        sample succeeded."""
        with self._control:
            if self._state is not None:
                self._halt()
                self._try_sample()
                self._state = None
        with self._lock:
            first, last = self._first, self._last
            if last is None:
                return dict.fromkeys(self.KEYS)
            vals = (last["capacity"], self._peak, last["spilled"] - first["spilled"],
                    last["restored"] - first["restored"], self._fallback_peak)
        return dict(zip(self.KEYS, vals))

    def _sample(self) -> None:
        stats = object_store_stats(self._state)
        with self._lock:
            self._first = self._first or stats
            self._last = stats
            self._peak = max(self._peak, stats["used"])
            self._fallback_peak = max(self._fallback_peak, stats["fallback"])

    def _try_sample(self) -> None:
        try:
            self._sample()
        except Exception as e:  # the raylet busy or a node lost: the window keeps its samples
            log.debug("object-store watch: %s", e)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            self._try_sample()

    def _halt(self) -> None:
        with self._control:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
                self._thread = None


OBJECT_STORE_WATCH = ObjectStoreWatch()
"""The object-store window of this driver, restarted by :func:`init_ray` with ``watch_object_store``."""


def object_store_figures() -> dict[str, Optional[int]]:
    """The object store's figures since this process's latest :func:`init_ray` call that watched it (see
    :meth:`ObjectStoreWatch.figures`); the cache stage adds them to its summary."""
    return OBJECT_STORE_WATCH.figures()


LOCAL_RECORDS = Path.home() / ".cache" / "dspark" / "ray-local"
"""One JSON file per live local Ray instance this product started: its driver and Ray's processes."""


def _identity(proc) -> list[float]:
    return [proc.pid, proc.create_time()]  # (pid, start time): a pid reused by another process never matches


def record_local_instance(records: Path = LOCAL_RECORDS) -> Path:
    """Record the local Ray instance this driver just started (its GCS, raylet, agents and workers:
    every descendant process now), removed again at a clean exit. A driver killed with SIGKILL
    leaves its record behind, and :func:`reap_orphaned_instances` stops what outlived it."""

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


@contextlib.contextmanager
def local_head(num_cpus: int, env: dict[str, str] | None = None, timeout_s: float = 120, discoverable: bool = False):
    """Start a Ray head on 127.0.0.1 (``ray start --head --block``) for ``ray job submit``; yield
    ``(ray_bin, dashboard_address, env)`` and stop the head's process group on exit.

    Every port is chosen free (another Ray instance on the machine may hold the defaults), and only
    this head is stopped (``ray stop`` would stop every Ray instance of the machine). ``env`` (default
    this process's) is the head's environment, which submitted jobs inherit (e.g. AWS_* variables).

    ``discoverable``: start it as a user's plain ``ray start --head`` is, in Ray's default temp dir
    (``$RAY_TMPDIR/ray`` of ``env``, else ``$TMPDIR/ray``, else ``/tmp/ray``), where it records its
    address (``ray_current_cluster``) for ``ray.init()`` and ``ray.address=auto`` to find; set
    ``RAY_TMPDIR`` in ``env`` to keep it away from the machine's other Ray users. Otherwise the head
    lives in a temp dir of its own that no other process discovers.

    Raises:
        RuntimeError: the head's job API did not answer within ``timeout_s`` seconds.
    """
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**(os.environ if env is None else env), "RAY_AUTH_MODE": "disabled"}
    temp = Path("/tmp") / f"rh{os.getpid()}"
    where = [] if discoverable else [f"--temp-dir={temp}"]
    dash = free_port()
    ports = {flag: free_port() for flag in ("port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                             "metrics-export-port", "runtime-env-agent-port")}
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--num-cpus={num_cpus}", *where,
                             "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                             "--disable-usage-stats", *(f"--{k}={v}" for k, v in ports.items())],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    # `ray start` records a discoverable head's address (HOST:PORT, HOST the node's own IP) after its job API answers
    record = Path(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp") / "ray" / "ray_current_cluster"

    def recorded() -> bool:
        return not discoverable or (record.is_file() and record.read_text().strip().endswith(f":{ports['port']}"))

    try:
        deadline = time.time() + timeout_s
        while not recorded() or not job_api_answers(address):
            if time.time() > deadline or head.poll() is not None:
                raise RuntimeError(f"the local Ray head did not start within {timeout_s:.0f} s")
            time.sleep(0.5)
        yield ray_bin, address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def job_api_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the job API of the Ray dashboard at ``address`` (``http://HOST:PORT``) answers: the
    ``GET /api/jobs/`` that ``ray job list`` sends, without starting a Python process per poll (each
    costs seconds of CPU while the head itself starts). ``timeout_s``: seconds one request may take.
    Returns False, never raises, while nothing answers (connection refused, timeout, HTTP error)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address}/api/jobs/", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def head_counts(gcs_address: str) -> dict[str, int]:
    """Alive nodes, jobs and actors that the GCS at ``gcs_address`` (HOST:PORT) knows of, read without
    joining its cluster: what shows that a run left a user's cluster alone.

    Raises:
        Ray's connection error: no GCS answers at ``gcs_address``."""
    from ray._private.internal_api import get_state_from_address

    state = get_state_from_address(gcs_address)
    return {"alive_nodes": sum(n["Alive"] for n in state.node_table()), "jobs": len(state.job_table()),
            "actors": len(state.actor_table(None))}


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
