"""What a fault cost, counted (issue #37 item 4): the arithmetic of the cache / generate actor pools'
ledger and of the train stage's worker-group attempts, without a cluster (tests/integration/test_cluster_faults.py
runs them on one)."""
from pipeline.stages.sharded import FaultLedger
from pipeline.stages.train import fault_summary


def test_ledger_counts_restarted_actors_and_redone_shards():
    ledger = FaultLedger()
    for _ in range(3):  # two pool actors, one restarted after its node was lost
        ledger.actor_started()
    for shard, at, actor in [(0, 10.0, "a"), (1, 10.5, "b"), (2, 11.0, "b"), (1, 14.0, "a"), (3, 15.0, "a"),
                             (2, 16.5, "b")]:  # b lost both its calls; a retried one, b (restarted) the other
        ledger.shard_started(shard, at, actor)
    assert ledger.summary() == {"actors_started": 3, "actors_lost": 1, "redone_shards": [1, 2],
                                "retry_delay_seconds": 9.0}  # (14 - 10.5) + (16.5 - 11)


def test_ledger_of_an_undisturbed_pool_counts_nothing():
    ledger = FaultLedger()
    ledger.actor_started()
    ledger.shard_started(0, 1.0, "a")
    assert ledger.summary() == {"actors_started": 1, "actors_lost": 0, "redone_shards": [], "retry_delay_seconds": 0}


def test_train_fault_summary_counts_redone_steps_from_the_resumed_checkpoint():
    attempts = [{"started_at": 100.0, "resumed_step": 0, "logged_step": 0, "logged_at": None},
                {"started_at": 160.0, "resumed_step": 4, "logged_step": 5, "logged_at": 150.0},
                {"started_at": 230.0, "resumed_step": 7, "resumed_reason": "preemption", "logged_step": 9,
                 "logged_at": 200.5}]
    assert fault_summary(attempts) == {"worker_group_restarts": 2, "resumed_from_steps": [4, 7],
                                       "preemption_checkpoints": [7], "redone_steps": 3, "restart_seconds": 39.5}
    assert fault_summary(attempts[:1]) == {"worker_group_restarts": 0, "resumed_from_steps": [],
                                           "preemption_checkpoints": [], "redone_steps": 0, "restart_seconds": 0}
