"""The cache stage submitted with `ray job submit` to a local Ray head (127.0.0.1)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.run import DEFAULT_CONFIG

pytestmark = pytest.mark.integration


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp = Path("/tmp") / f"rh{os.getpid()}"
    dash = _port()
    # --block keeps every process of this head in one process group that the test alone stops
    # (`ray stop` would stop every Ray instance on the machine, the test session's own included)
    head = subprocess.Popen([ray_bin, "start", "--head", "--block", f"--port={_port()}", "--num-cpus=2",
                             f"--temp-dir={temp}", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dash}", "--disable-usage-stats",
                             # own agent ports: another Ray instance on this machine holds the defaults
                             f"--dashboard-agent-listen-port={_port()}", f"--dashboard-agent-grpc-port={_port()}",
                             f"--metrics-export-port={_port()}", f"--runtime-env-agent-port={_port()}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 120
        while subprocess.run([ray_bin, "job", "list", "--address", address], env=env,
                             capture_output=True).returncode != 0:
            if time.time() > deadline or head.poll() is not None:
                pytest.fail("the local Ray head did not start")
            time.sleep(1)
        yield ray_bin, address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def test_cache_stage_via_ray_job_submit(ray_head, tiny_target_dir, shared_cases, tmp_path):
    ray_bin, address, env = ray_head
    run_dir = tmp_path / "run"
    entry = [sys.executable, "-m", "pipeline.run", "+stage=cache", str(DEFAULT_CONFIG),
             f"target.path={tiny_target_dir}", f"run_dir={run_dir}", "generate.enabled=false",
             f"data.train_files=[{shared_cases}/chats/sharegpt.jsonl]", "data.min_loss_tokens=1",
             "cache.rows_per_shard=3"]
    for _ in range(20):  # the head's job agent may come up a few seconds after its dashboard
        r = subprocess.run([ray_bin, "job", "submit", "--address", address, "--", *entry], env=env,
                           capture_output=True, text=True, timeout=400)
        if "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(3)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    summary = json.loads((run_dir / "cache" / "summary.json").read_text())
    assert summary["shards"] == 2 and summary["samples"] == 4  # s1 s2 s3 s6
    assert summary["skipped_rows"] == {"no_user_turn": 1, "unknown_role": 1}
