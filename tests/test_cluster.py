"""A local Ray instance whose driver was killed (SIGKILL) is stopped by the next run."""
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from pipeline.cluster import reap_orphaned_instances

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(records, driver, processes):
    records.mkdir(parents=True, exist_ok=True)
    ident = lambda p: [p.pid, psutil.Process(p.pid).create_time()]  # noqa: E731
    (records / f"{driver.pid}.json").write_text(json.dumps({"driver": ident(driver),
                                                            "processes": [ident(p) for p in processes]}))


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


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


@pytest.mark.integration
def test_ray_agents_left_by_a_killed_driver_are_gone_after_the_next_run(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "PYTHONPATH": REPO}
    driver = subprocess.Popen(
        [sys.executable, "-c", "import time; from pipeline.cluster import init_ray; from pipeline.config import "
         "RayConfig; init_ray(RayConfig(num_cpus=1)); print('ready', flush=True); time.sleep(600)"],
        env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert driver.stdout.readline().strip() == "ready"
    records = tmp_path / ".cache" / "dspark" / "ray-local"
    rec = json.loads((records / f"{driver.pid}.json").read_text())
    procs = []
    for pid, _ in rec["processes"]:  # a short-lived worker may have exited since it was recorded
        try:
            procs.append((psutil.Process(pid), " ".join(psutil.Process(pid).cmdline())))
        except psutil.Error:
            continue
    assert any("raylet" in cmd for _, cmd in procs)
    procs = [p for p, _ in procs]
    driver.kill()
    driver.wait()
    time.sleep(3)
    survivors = [p for p in procs if _running(p)]
    assert reap_orphaned_instances(records) >= len(survivors)
    assert not [p for p in survivors if _running(p)]
    assert not list(records.iterdir())
