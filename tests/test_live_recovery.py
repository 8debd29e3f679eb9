"""Which live state a re-formed data-parallel world goes on from (dataparallel/live.py),
and the step's side effect it undoes. Real-process recoveries from live state:
test_inflight_kill.py (a kill with buckets in flight), test_elastic.py, test_user_script.py;
the commit fallback: test_state.py."""
import pytest
import torch

from elastic.config import ConfigError, TrainConfig
from elastic.dataparallel.live import BufferStash, choose, summary


def at(step, consumed=None, digest=None, total=1000, epoch=0):
    return summary(step, epoch, step * 8 if consumed is None else consumed, total, digest)


def test_survivors_at_one_step_go_on_and_nothing_moves():
    plan = choose([at(75), at(75), at(75)])
    assert (plan.kind, plan.step, plan.sources, plan.needs) == ("recovered_live", 75, (0, 1, 2), ())


def test_a_newcomer_receives_a_stripe_from_every_survivor():
    plan = choose([at(75), None, at(75)])
    assert (plan.kind, plan.sources, plan.needs, plan.behind) == ("recovered_live", (0, 2), (1,), ())


def test_ranks_a_step_behind_take_the_advanced_state():
    """A death inside the step's last collective: ranks 0 and 2 applied step 76, 1 did not."""
    plan = choose([at(76), at(75), at(76), None])
    assert (plan.kind, plan.step, plan.sources, plan.behind, plan.needs) == (
        "adopted", 76, (0, 2), (1,), (1, 3))


def test_at_one_step_the_version_most_ranks_hold_wins():
    """Same step, another digest (a replica that diverged): it is overwritten, not trusted."""
    plan = choose([at(40, digest="b"), at(40, digest="a"), at(40, digest="a")])
    assert (plan.kind, plan.sources, plan.disagreeing, plan.needs) == ("adopted", (1, 2), (0,), (0,))
    # a tie goes to the version the lowest rank holds
    plan = choose([at(40, consumed=7), at(40, consumed=9)])
    assert (plan.sources, plan.disagreeing) == ((0,), (1,))


def test_no_live_rank_leaves_it_to_the_commit():
    assert choose([None, None]) is None and choose([]) is None


def test_a_failed_steps_buffer_writes_are_undone_and_an_applied_steps_kept():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    stash = BufferStash(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stash.keep()
    model.train()(torch.randn(8, 4))          # the forward moves the running statistics
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    stash.put_back()                          # the step failed in its reduction
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    stash.keep()
    model(torch.randn(8, 4))
    stash.applied()                           # the step finished: its statistics stay
    moved = model[1].running_mean.clone()
    stash.put_back()                          # a failure later (in the sync): nothing to undo
    assert torch.equal(model[1].running_mean, moved) and int(model[1].num_batches_tracked) == 1


def test_recover_from_names_its_choices():
    assert TrainConfig(recover_from="commit").recover_from == "commit"
    with pytest.raises(ConfigError, match="train.recover_from must be one of live, commit, got 'disk'"):
        TrainConfig(recover_from="disk")
