"""The overlapped, bucketed gradient reduction (elastic/dataparallel/reduce.py) over real
Horovod ranks equals one process on the combined batch: uneven shares, 2 ranks (mpirun,
Horovod's MPI operations), 3 ranks (horovodrun, Gloo) and 3 ranks whose buckets a
torch.distributed Gloo group sums (``train.gradient_sums = "gloo"``), accumulation, a
parameter the last microstep leaves unused, a rank without samples, a rebuilt reducer; and
float16 on the wire stays within its stated error."""
import copy
import gc
import weakref

import pytest
import torch

from conftest import BIN, PYTHON, ROOT, mpirun, run
from elastic.config import ConfigError, TrainConfig
from elastic.dataparallel.buckets import plan_buckets
from elastic.dataparallel.reduce import BucketReducer
from elastic.runtime.collectives import Alone
from elastic.runtime.control import Pending
from workers.bucket_worker import CASES, reference

WORKER = str(ROOT / "tests" / "workers" / "bucket_worker.py")
EXACT = [case for case, spec in CASES.items() if spec.get("compression", "none") == "none"]


WORLDS = ["2", "3", "3-gloo"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What rank 0 got, per world: 2 ranks under mpirun, 3 under horovodrun with Gloo, and 3
    whose buckets a torch.distributed Gloo group sums (``train.gradient_sums = "gloo"``)."""
    tmp = tmp_path_factory.mktemp("buckets")
    mpirun(2, PYTHON, WORKER, str(tmp / "two.pt"))
    horovodrun = [str(BIN / "horovodrun"), "--gloo", "-np", "3", "-H", "localhost:3", PYTHON, WORKER]
    run([*horovodrun, str(tmp / "three.pt")], timeout=180)
    run([*horovodrun, str(tmp / "gloo.pt"), "gloo"], timeout=180)
    got = {"2": torch.load(tmp / "two.pt"), "3": torch.load(tmp / "three.pt"),
           "3-gloo": torch.load(tmp / "gloo.pt")}
    assert [(w["size"], w.get("sums", "horovod")) for w in got.values()] == \
        [(2, "horovod"), (3, "horovod"), (3, "gloo")]
    return got


@pytest.fixture(scope="module")
def references():
    return {case: reference(case) for case in CASES}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", EXACT)
def test_bucketed_reduction_equals_one_process(ranks, references, world, case):
    got = ranks[world]
    for step, (mine, ref) in enumerate(zip(got["cases"][case], references[case], strict=True)):
        assert mine["buckets"] >= 3
        assert mine["count"] == ref["count"], step
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-6), step
        assert mine["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(mine["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=f"{case} step {step} {name}")


@pytest.mark.parametrize("world", WORLDS)
def test_fp16_on_the_wire_error_within_bound(ranks, references, world):
    """Each rank's contribution and each partial sum round to float16 once (relative
    2^-11 each), so the whole gradient's relative L2 error stays below size * 2^-11. The
    error must also be there: the gradients really travelled as float16, in half the bytes."""
    size = ranks[world]["size"]
    bound = size * 2.0 ** -11
    for step, (mine, ref, exact) in enumerate(zip(ranks[world]["cases"]["fp16"], references["fp16"],
                                                  ranks[world]["cases"]["plain"], strict=True)):
        error = sum(float((mine["grads"][n] - g).pow(2).sum()) for n, g in ref["grads"].items()) ** 0.5
        norm = sum(float(g.pow(2).sum()) for g in ref["grads"].values()) ** 0.5
        print(f"{world} step {step}: relative L2 error {error / norm:.2e} (bound {bound:.2e})")
        assert 0 < error / norm < bound
        assert mine["count"] == ref["count"] and mine["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert mine["nbytes"] < 0.55 * exact["nbytes"]


def test_buckets_follow_backward_order_and_size():
    params = [torch.zeros(n) for n in (10, 300, 20, 5, 700)]
    assert plan_buckets(params, 1000) == [[4], [3, 2, 1], [0]]       # 2800 B, then 1300 B
    assert plan_buckets(params, 4000) == [[4, 3, 2, 1], [0]]
    assert plan_buckets(params, 0) == [[4], [3], [2], [1], [0]]
    # near edge_bytes: the first bucket (sent early in backward), and the last (sent after it)
    assert plan_buckets(params, 4000, edge_bytes=1000) == [[4], [3, 2], [1, 0]]
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)]
    assert plan_buckets(mixed, 1 << 20) == [[2], [1], [0]]             # one dtype per bucket


def test_one_process_divides_by_the_count_and_zero_fills():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    reducer = BucketReducer(list(model.parameters()), 0, 1, Alone())
    reducer.before_backward(last=True)
    model[1](torch.ones(4, 2)).sum().backward()      # model[0] gets no gradient
    reduced = reducer.finish(Pending().control(6.0, 4, 0.5))
    assert (reduced.agreed.loss, reduced.agreed.count) == (1.5, 4)
    torch.testing.assert_close(model[1].weight.grad, torch.ones(1, 2))   # 4 ones / 4
    assert torch.equal(model[0].weight.grad, torch.zeros(2, 3))


class Recording(Alone):
    """Sums over a world of one, noting what each collective was given."""

    def __init__(self):
        self.calls = []

    def allreduce_sum_async(self, tensors, name):
        self.calls.append([t.untyped_storage().data_ptr() for t in tensors])
        return super().allreduce_sum_async(tensors, name)


def test_each_bucket_is_one_tensor_and_the_gradients_are_views_of_it():
    # Horovod copies a grouped allreduce's tensors into its fusion buffer and back; one
    # flat tensor per bucket, with .grad viewing it, it sums in place.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    twin = copy.deepcopy(model)
    collectives = Recording()
    reducer = BucketReducer(list(model.parameters()), 0, 2, collectives, bucket_bytes=100, expected_count=4)
    assert [len(bucket.params) for bucket in reducer.buckets] == [4, 2]
    for step in range(3):   # zero_grad drops the views: each step copies the new gradients in
        x = torch.randn(4, 8)
        model.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        reducer.before_backward(last=True)
        model(x).sum().backward()
        reduced = reducer.finish(Pending().control(0.0, 4, 0.0))
        (twin(x).sum() / 4).backward()
        assert reduced.agreed.count == 4
        launched = collectives.calls[-len(reducer.buckets):]
        assert all(len(tensors) == 1 for tensors in launched), launched
        for bucket, tensors in zip(reducer.buckets, launched):
            assert tensors == [bucket.flat.untyped_storage().data_ptr()]
            for param in bucket.params:
                assert param.grad.untyped_storage().data_ptr() == tensors[0]
        for mine, reference_ in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(mine.grad, reference_.grad)
    assert len(collectives.calls) == 3 * len(reducer.buckets)


def test_a_death_seen_during_backward_stops_it_at_the_next_gradient():
    """A step whose world lost a peer cannot be summed: backward stops with the error a
    failed collective raises (the step is redone in the new world) instead of computing
    the rest, seconds at 100M parameters here. Layers closer to the input get no gradient."""
    from horovod.common.exceptions import HorovodInternalError
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    seen, dead_after = [], 2
    collectives = Recording()
    reducer = BucketReducer(list(model.parameters()), 0, 2, collectives, bucket_bytes=0,
                            broken=lambda: len(seen) >= dead_after)
    for param in model.parameters():   # registered after the reducer's: runs once its hook let it
        param.register_post_accumulate_grad_hook(lambda p: seen.append(p))
    reducer.before_backward(last=True)
    with pytest.raises(HorovodInternalError, match="abandoned"):
        model(torch.randn(3, 8)).sum().backward()
    assert len(seen) == dead_after      # the last layer's weight and bias, then it stopped
    # the gradient whose hook saw the death was accumulated before its hook ran
    assert [p.grad is not None for p in model.parameters()] == [False] * 5 + [True] * 3
    assert len(collectives.calls) == dead_after   # the last layer's buckets went, none after
    # the next world's reducer, with a healthy world, sums a whole backward
    reducer.close()
    healthy = BucketReducer(list(model.parameters()), 0, 2, Recording(), bucket_bytes=0)
    model.zero_grad(set_to_none=True)
    healthy.before_backward(last=True)
    model(torch.randn(3, 8)).sum().backward()
    healthy.finish(Pending().control(0.0, 3, 0.0))
    assert all(p.grad is not None for p in model.parameters())


class NeverDone:
    def done(self):
        return False

    def wait(self):
        raise AssertionError("close must not wait on a collective still in flight")


class Stuck(Recording):
    """The first sum never completes (a collective still in flight when its world ends:
    the step was abandoned before waiting on it)."""

    def allreduce_sum_async(self, tensors, name):
        request = super().allreduce_sum_async(tensors, name)
        return NeverDone() if len(self.calls) == 1 else request


def test_the_next_worlds_reducer_sums_in_the_last_ones_buffers():
    """A new world's reducer takes the closed one's bucket buffers (fresh memory costs its
    page faults: 800 MB of buckets at 200M parameters), except one a collective may still
    write into; its sums are the new step's, nothing of the old values left in them."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    twin = copy.deepcopy(model)

    def step(reducer, net, x):
        net.zero_grad(set_to_none=True)
        reducer.before_backward(last=True)
        net(x).sum().backward()
        reducer.finish(Pending().control(0.0, 4, 0.0))

    from horovod.common.exceptions import HorovodInternalError
    stuck = Stuck()
    old = BucketReducer(list(model.parameters()), 0, 3, stuck, bucket_bytes=100, expected_count=4,
                        broken=lambda: len(stuck.calls) >= 1)   # a death once the first is sent
    with pytest.raises(HorovodInternalError):
        step(old, model, torch.randn(4, 8))
    old.close()
    released = old.released()
    # the first sum sent (the last layers' bucket) is still in flight; the carrier, never sent, is free
    assert len(old.buckets) == 2 and [b.data_ptr() for b in released] == [old.buckets[1].flat.data_ptr()]
    in_flight = old.buckets[0].flat.untyped_storage().data_ptr()
    new = BucketReducer(list(model.parameters()), 1, 2, Recording(), bucket_bytes=100,
                        expected_count=4, spare=released)
    fresh = BucketReducer(list(twin.parameters()), 1, 2, Recording(), bucket_bytes=100, expected_count=4)
    storages = [b.flat.untyped_storage().data_ptr() for b in new.buckets]
    assert in_flight not in storages
    reused = [s for s in storages if s == released[0].untyped_storage().data_ptr()]
    assert len(reused) == 1      # the carrier's, one element shorter in a world of 2
    x = torch.randn(4, 8)
    step(new, model, x)
    step(fresh, twin, x)
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_closed_reducer_leaves_no_hook_behind():
    """The engine makes a reducer per world; the old one's hooks must not keep it (and
    its buffers) alive, nor run on the next backward."""
    model = torch.nn.Linear(3, 2)
    reducer = BucketReducer(list(model.parameters()), 0, 2, Alone(), bucket_bytes=0)
    ref = weakref.ref(reducer)
    reducer.close()
    del reducer
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("values, message", [
    ({"bucket_mb": -1}, "train.bucket_mb must be >= 0, got -1"),
    ({"compression": "bf16"}, "train.compression must be 'none' or 'fp16'"),
    ({"gradient_sums": "nccl"}, "train.gradient_sums must be one of auto, horovod, gloo, got 'nccl'"),
])
def test_bad_reduction_settings_are_named(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**values)
