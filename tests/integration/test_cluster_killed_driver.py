"""A local Ray instance whose driver was killed (SIGKILL) is stopped by the next run."""
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from pipeline.cluster import reap_orphaned_instances

from paths import REPO


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.integration
def test_ray_agents_left_by_a_killed_driver_are_gone_after_the_next_run(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
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
