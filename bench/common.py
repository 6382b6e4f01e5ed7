"""Shared set-up for the benchmarks: a config on the embedded tiny target, a local S3 server."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def tiny_config(run_dir: str, *overrides: str):
    """``conf/tiny.yaml`` with the given run_dir and overrides (generate off: cache the stdlib chats)."""
    from pipeline.run import DEFAULT_CONFIG, load_config

    return load_config(DEFAULT_CONFIG, [f"run_dir={run_dir}", "generate.enabled=false", *overrides])


@contextmanager
def s3_server():
    """A moto S3 server on 127.0.0.1 with bucket ``bench``; AWS_* variables point every client at it."""
    from pipeline.cluster import free_port

    port = free_port()
    exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        yield "s3://bench"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
