"""Commit interval: fixed, or chosen from measured cost and failure rate (Young/Daly)."""
import math

import pytest

from elastic.runtime.commit_policy import CommitPolicy, young_daly_steps


def test_young_daly_optimum_in_steps():
    # sqrt(2 * 0.5 s * 3600 s) = 60 s of training = 600 steps of 0.1 s
    assert young_daly_steps(0.5, 3600, 0.1) == 600
    # fewer failures (longer MTBF) -> longer interval, by the square root
    assert young_daly_steps(0.5, 4 * 3600, 0.1) == 1200


def test_interval_never_costs_more_than_one_percent():
    # Young/Daly alone would say sqrt(2*1*10)/0.01 = 447 steps, but a 1 s commit every
    # 447 steps of 10 ms is 22 % overhead: the floor is 100 x cost / step time.
    steps = young_daly_steps(1.0, 10, 0.01, max_overhead=0.01)
    assert steps == 10_000 or steps >= 100 * 1.0 / 0.01
    assert 1.0 / (steps * 0.01) <= 0.01 + 1e-9


def test_fixed_policy_is_a_plain_interval():
    policy = CommitPolicy(fixed=10)
    policy.entered(70)            # restored to the commit at step 70
    committed = []
    for step in range(71, 100):
        if policy.due(step):
            committed.append(step)
            assert policy.observe_commit(step, 0.5) is None   # fixed: never re-chosen
    assert committed == [80, 90] and policy.interval == 10


def test_auto_policy_adapts_to_cost_and_rollbacks():
    policy = CommitPolicy(fixed=None, prior_mtbf_s=3600)
    for _ in range(20):
        policy.observe_step(0.01)
    chosen = policy.observe_commit(10, 0.002)
    assert chosen == round(math.sqrt(2 * 0.002 * policy.mtbr_s()) / 0.01)
    for _ in range(2):
        policy.observe_failure()
        policy.observe_recovery("restored_commit")
    # three times the rollback rate: the interval shrinks by about sqrt(3)
    again = policy.observe_commit(20, 0.002)
    assert again is not None and abs(chosen / again - math.sqrt(3)) < 0.05


def test_failures_recovered_live_do_not_shorten_the_interval():
    """Only a rollback loses the steps since the commit; a live recovery loses the
    interrupted step alone, whatever the interval (the module docstring's cost model)."""
    policy = CommitPolicy(fixed=None, prior_mtbf_s=3600)
    for _ in range(20):
        policy.observe_step(0.01)
    chosen = policy.observe_commit(10, 0.002)
    for recovery in ("recovered_live", "adopted", "recovered_live"):
        policy.observe_failure()
        policy.observe_recovery(recovery)
    assert policy.observe_commit(20, 0.002) is None and policy.interval == chosen
    assert (policy.failures, policy.rollbacks) == (3, 0)
    assert policy.mtbf_s() == pytest.approx(policy.mtbr_s() / 4, rel=1e-3)
    # A failure that went back to the checkpoint, and the pipeline's (no recovery named),
    # do count: two rollbacks in, the interval is 1/sqrt(3) of what it was.
    policy.observe_failure()
    policy.observe_recovery("restored_checkpoint")
    policy.observe_failure()
    policy.observe_recovery(None)
    again = policy.observe_commit(30, 0.002)
    assert policy.rollbacks == 2 and abs(chosen / again - math.sqrt(3)) < 0.05
