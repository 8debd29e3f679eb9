"""Horovod's ``DistributedOptimizer`` for a user's own loop, on Regatta's bucketed reducer.

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

As Horovod's, the result *is* the user's optimizer: an instance of a subclass of its
class over the same parameter groups, whose ``step()`` first averages the gradients over
the world (``synchronize``; ``skip_synchronize`` for a loop that clips in between). The
averaging is the data-parallel engine's (dataparallel/reduce.py): buckets of
``train.bucket_mb`` start their sums during backward as soon as they are full, and the
step's agreement (host updates, rank 0's commit vote, every rank's work time) rides in
the last one, so a step needs no collective beyond its gradients'. The state it belongs
to (state.py) learns of each reduction and each applied update: that is how a failure
knows whether this rank's live state is still at its last step boundary.

What Horovod's optimizer offers and this one cannot keep is refused when it is built,
with the reason (Adasum, a pre-divide factor, several backward passes per step, a
process set other than the global one).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from elastic.dataparallel.reduce import BucketReducer
from elastic.runtime.control import Control


class RefusedOption(ValueError):
    """A Horovod option regatta.horovod cannot honour; the message says why."""


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,   # noqa: N802 - Horovod's name
                         backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False, process_set=None):
    """Horovod's signature. ``num_groups``/``groups`` are fusion hints that Regatta's
    buckets replace (``train.bucket_mb``), and ``sparse_as_dense`` is what the buckets do
    to every gradient: they change nothing."""
    import horovod.torch as hvd
    from .session import current
    session = current()
    average = _averages(hvd, op)
    if backward_passes_per_step != 1:
        raise RefusedOption("backward_passes_per_step > 1: accumulate in your loop and call "
                            "optimizer.step() once per global batch instead")
    if gradient_predivide_factor != 1.0:
        raise RefusedOption("gradient_predivide_factor: Regatta's reducer divides by the global "
                            "count once, after the sum")
    if process_set is not None and process_set is not hvd.global_process_set:
        raise RefusedOption("process_set: the elastic world is the only one Regatta trains over")
    _check_names(optimizer, named_parameters)
    kind = type(type(optimizer).__name__, (Reducing, type(optimizer)), {})
    wrapped = kind(optimizer.param_groups, session=session, average=average,
                   compression=_compression(hvd, compression))
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped


def _averages(hvd, op) -> bool:
    if op is None or op is hvd.Average:
        return True
    if op is hvd.Sum:
        return False
    if op is hvd.Adasum:
        raise RefusedOption("op=hvd.Adasum: Regatta's reducer sums; use op=hvd.Average")
    raise RefusedOption(f"op={op!r}: gradients can be averaged (hvd.Average) or summed (hvd.Sum)")


def _compression(hvd, compression) -> str:
    if compression is None or compression is hvd.Compression.none:
        return "none"
    if compression is hvd.Compression.fp16:
        return "fp16"
    raise RefusedOption(f"compression={compression!r}: Regatta's reducer knows hvd.Compression.none "
                        f"and hvd.Compression.fp16")


def _check_names(optimizer, named_parameters) -> None:
    """Horovod's check: every parameter the optimizer holds has one name."""
    if named_parameters is None:
        return
    named = list(named_parameters)
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("named_parameters holds a name twice")
    known = {id(p) for _, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in known]
    if unnamed:
        raise ValueError(f"named_parameters lacks {len(unnamed)} of the optimizer's parameters")


class Reducing:
    """Mixed in front of the user's optimizer class (see ``DistributedOptimizer``)."""

    def __init__(self, params, *, session, average: bool, compression: str):
        super().__init__(params)
        self._session, self._average, self._compression = session, average, compression
        self._reducer: tuple | None = None    # (world, BucketReducer)
        self._skip = False
        self._state = None                    # the TorchState holding this optimizer
        session.engine.optimizers.append(self)
        self.enter_world(session.runtime.world, session.runtime.collectives)

    # -- the world ----------------------------------------------------------------------
    def enter_world(self, world, collectives) -> None:
        if self._reducer is not None and self._reducer[0] == world:
            return
        self.leave_world()
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        reducer = BucketReducer(params, world.rank, world.size, collectives,
                                bucket_bytes=int(self._session.cfg.bucket_mb * 2 ** 20),
                                compression=self._compression,
                                expected_count=world.size if self._average else 1,
                                broken=self._session.runtime.world_broken)
        reducer.before_backward(last=True)
        self._reducer = (world, reducer)

    def leave_world(self) -> None:
        if self._reducer is not None:
            self._reducer[1].close()
            self._reducer = None

    def attach(self, state) -> None:
        self._state = state

    # -- Horovod's optimizer API --------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._reducer is not None:
            self._reducer[1].before_backward(last=True)

    def synchronize(self) -> None:
        """Average (or sum) the gradients of this step over the world, now."""
        world, reducer = self._reducer
        state, runtime = self._state, self._session.runtime
        started = time.perf_counter()
        pending = runtime.pending(state) if state is not None else None
        share = 1 if self._average or world.rank == 0 else 0
        work = state.work_seconds(started) if state is not None else 0.0
        control = (pending.control(0.0, share, work) if pending is not None else
                   _no_pending(share, work))
        with runtime.heartbeat.collective(state if state is not None else runtime):
            reduced = reducer.finish(control)
        reducer.before_backward(last=True)   # armed for the next backward
        if state is not None:
            state.reduced(reduced, time.perf_counter() - started)

    @contextmanager
    def skip_synchronize(self):
        """``step()`` without reducing again (after an explicit ``synchronize``)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if closure is not None:
            raise RefusedOption("step(closure): the closure would run backward again after the "
                                "gradients were averaged; call it before step()")
        if not self._skip:
            self.synchronize()
        result = super().step()
        if self._state is not None:
            self._state.applied()
        return result


def _no_pending(share: int, work: float) -> Control:
    """An optimizer no state holds: nothing to vote on, no host updates to carry."""
    return Control(loss_sum=0.0, count=share, host_update=0, commit_vote=0, work_s=work)

