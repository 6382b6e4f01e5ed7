"""A preemption notice seen by one rank only is acted on by every rank (training.loop.preemption_notice).

Ray Train passes the notice to each worker on its own; the checkpoint written on it is a collective, so
the answer must be the same on every rank. Two gloo processes stand in for the worker group; Ray Train's
``get_preemption_info`` is replaced (the one part that needs a drained node of a live cluster, which
tests/integration/test_cluster_faults.py drives end to end with one rank).
"""
import multiprocessing
import os
import sys
import types

import pytest

from pipeline.cluster import free_port
from paths import REPO


def _rank(rank: int, port: int, sees: list[bool], out) -> None:
    sys.path.insert(0, str(REPO))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="1")
    import ray.train
    import torch
    import torch.distributed as dist

    from training.loop import preemption_notice

    dist.init_process_group("gloo", rank=rank, world_size=len(sees))
    ray.train.get_preemption_info = lambda: "notice" if sees[rank] else None
    job = types.SimpleNamespace(preemption_check_every_steps=2)
    out.put((rank, preemption_notice(job, 4, torch.device("cpu")), preemption_notice(job, 5, torch.device("cpu"))))
    dist.destroy_process_group()


@pytest.mark.parametrize("sees", [[True, False], [False, True], [False, False]])
def test_every_rank_answers_what_any_rank_saw(sees):
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, sees, out)) for r in range(len(sees))]
    for p in procs:
        p.start()
    answers = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # step 4 is looked at (every 2 steps): any rank's notice counts for all; step 5 is not looked at
    assert answers == [(r, any(sees), False) for r in range(len(sees))]
