"""A local Ray instance whose driver was killed (SIGKILL) is stopped by the next run."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from pipeline.cluster import ray_address, reap_orphaned_instances
from pipeline.config import RayConfig

from paths import REPO


def _record(records, driver, processes):
    records.mkdir(parents=True, exist_ok=True)
    ident = lambda p: [p.pid, psutil.Process(p.pid).create_time()]  # noqa: E731
    (records / f"{driver.pid}.json").write_text(json.dumps({"driver": ident(driver),
                                                            "processes": [ident(p) for p in processes]}))


def test_orphans_of_a_dead_driver_are_stopped_and_a_live_runs_are_not(tmp_path):
    records = tmp_path / "ray-local"
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    orphan = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); time.sleep(600)"])  # ignores SIGTERM, like the agents
    _record(records, dead, [orphan])
    live_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    _record(records, psutil.Process(), [live_child])  # this process is a live driver
    dead.kill()
    dead.wait()
    try:
        assert reap_orphaned_instances(records, grace_s=1.0) == 1
        orphan.wait(timeout=10)  # reaped: SIGTERM was ignored, so it took the SIGKILL after the grace time
        assert not psutil.pid_exists(orphan.pid) or psutil.Process(orphan.pid).status() == psutil.STATUS_ZOMBIE
        assert live_child.poll() is None  # a live run's Ray is never touched
        assert sorted(p.name for p in records.iterdir()) == [f"{os.getpid()}.json"]
        assert reap_orphaned_instances(records) == 0
    finally:
        for p in (orphan, live_child):
            p.kill()


def _ray_start_recorded(monkeypatch, root, gcs):
    """What a user's `ray start --head` leaves for discovery: its GCS address in `ray_current_cluster` of
    Ray's default temp dir (``$RAY_TMPDIR/ray``), which a plain ``ray.init()`` reads and joins."""
    monkeypatch.setenv("RAY_TMPDIR", str(root))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if gcs is not None:
        (root / "ray").mkdir(parents=True)
        (root / "ray" / "ray_current_cluster").write_text(gcs)


def test_a_run_joins_a_cluster_only_when_asked(monkeypatch, tmp_path):
    _ray_start_recorded(monkeypatch, tmp_path, "127.0.0.1:6379")
    assert ray_address(RayConfig()) is None  # a user's `ray start` is on the machine: not joined
    assert ray_address(RayConfig(address="auto")) == "127.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert ray_address(RayConfig()) == "127.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # ray job submit's driver
    assert ray_address(RayConfig()) == "10.0.0.2:6379"
    assert ray_address(RayConfig(address="10.0.0.3:6379")) == "10.0.0.3:6379"  # the config's wins
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert ray_address(RayConfig()) is None


def test_auto_without_a_ray_start_cluster_is_refused(monkeypatch, tmp_path):
    _ray_start_recorded(monkeypatch, tmp_path, None)
    with pytest.raises(ConnectionError, match=r"ray.address=auto .* no `ray start` cluster .*ray_current_cluster"):
        ray_address(RayConfig(address="auto"))


def test_init_ray_starts_a_private_instance_beside_a_users_cluster(monkeypatch, tmp_path):
    """With a `ray start` cluster recorded and no address, Ray is asked for a new local instance
    (address="local") with the run's CPUs and object store, never for a discovered one."""
    import ray
    from ray._private import internal_api

    import pipeline.cluster as cluster

    _ray_start_recorded(monkeypatch, tmp_path, "127.0.0.1:6379")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(internal_api, "get_state_from_address", lambda address: None)
    monkeypatch.setattr(cluster, "OBJECT_STORE_WATCH", SimpleNamespace(restart=lambda state: None))
    monkeypatch.setattr(cluster, "reap_orphaned_instances", lambda: 0)
    monkeypatch.setattr(cluster, "record_local_instance", lambda: None)
    cluster.init_ray(RayConfig(num_cpus=3, object_store_memory=2**28))
    assert len(calls) == 1
    assert {k: calls[0].get(k) for k in ("address", "num_cpus", "object_store_memory")} == {
        "address": "local", "num_cpus": 3, "object_store_memory": 2**28}
    cluster.init_ray(RayConfig(address="auto", num_cpus=3))  # asked: joins, without local-only settings
    assert calls[1] == {"address": "127.0.0.1:6379"}


def test_object_store_window_reports_peak_and_the_bytes_spilled_within_it(monkeypatch):
    import pipeline.cluster as cluster

    samples = iter([dict(used=10, capacity=100, spilled=500, restored=7, fallback=0),  # before the window's work
                    dict(used=90, capacity=100, spilled=560, restored=7, fallback=4),
                    dict(used=20, capacity=100, spilled=600, restored=9, fallback=0)])
    monkeypatch.setattr(cluster, "object_store_stats", lambda state: next(samples))
    watch = cluster.ObjectStoreWatch(interval_s=3600)  # samples only at restart, once in between, at the end
    assert watch.figures()["object_store_peak_bytes"] is None  # no window yet
    watch.restart(state="gcs")
    watch._sample()
    assert watch.figures() == {"object_store_capacity_bytes": 100, "object_store_peak_bytes": 90,
                               "object_store_spilled_bytes": 100, "object_store_restored_bytes": 2,
                               "object_store_fallback_peak_bytes": 4}


def test_object_store_watch_stops_before_rays_exit_hook_and_only_the_cache_stage_starts_it(monkeypatch):
    """A node-table call in flight when Ray's exit hook closes the GCS connection aborts the driver
    (RAY_CHECK, SIGABRT: CI lost a rehearsal's generate stage to it after "done"). The watch's thread
    is stopped by an exit hook that runs before every hook registered earlier (Ray's among them), and
    a stage that reports no object-store figures starts no thread at all."""
    script = (
        "import atexit, threading, time\n"
        "from pipeline import cluster\n"
        "cluster.object_store_stats = lambda state: dict(used=1, capacity=2, spilled=0, restored=0, fallback=0)\n"
        "alive = lambda: any(t.name == 'object-store-watch' for t in threading.enumerate())\n"
        "atexit.register(lambda: print('at ray.shutdown: watch alive', alive(), flush=True))  # like ray's hook\n"
        "cluster.OBJECT_STORE_WATCH.interval_s = 0.01\n"
        "cluster.OBJECT_STORE_WATCH.restart(state='gcs')\n"
        "time.sleep(0.05)\n"
        "print('before exit: watch alive', alive(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["before exit: watch alive True", "at ray.shutdown: watch alive False"]

    import ray

    import pipeline.cluster as cluster

    restarts = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr("ray._private.internal_api.get_state_from_address", lambda address: address)
    monkeypatch.setattr(cluster, "OBJECT_STORE_WATCH", SimpleNamespace(restart=restarts.append))
    cluster.init_ray(RayConfig())  # generate, train, calibrate, evaluate
    assert restarts == []
    cluster.init_ray(RayConfig(), watch_object_store=True)  # cache
    assert restarts == ["127.0.0.1:1"]


def test_a_private_instance_whose_start_timed_out_is_stopped_and_started_again(monkeypatch):
    """Ray's 30 s raylet registration runs out on a busy machine (several runs starting at once): the
    processes of the failed try are stopped and the start is tried again."""
    import ray

    from pipeline.cluster import START_TIMEOUT, start_private_instance

    leaked, calls = [], []

    def init(**kw):
        calls.append(kw)
        if len(calls) == 1:  # the failed try left its GCS behind
            leaked.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise Exception(f"The current node {START_TIMEOUT}. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    start_private_instance(num_cpus=2)
    assert calls == [{"address": "local", "num_cpus": 2}] * 2
    assert not psutil.pid_exists(leaked[0].pid)  # killed and reaped by the retry
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("bad object_store_memory")))
    with pytest.raises(ValueError, match="bad object_store_memory"):  # any other failure is raised at once
        start_private_instance(num_cpus=2)
