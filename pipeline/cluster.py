"""Ray start-up shared by every stage: join a cluster when there is one, else start a local one."""
from __future__ import annotations

import os

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
    else:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False)
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the stages draw their own bars (samples, tokens, bytes)
    ctx.print_on_execution_start = False
