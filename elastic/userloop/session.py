"""The runtime of a process whose training loop is the user's own (regatta.horovod).

``init()`` makes it once per process: the config from ``REGATTA_ARGS`` (the script's own
command line stays its own; ``regatta local`` puts its flags there), the worker runtime
(runtime/worker.py: the run's row, events, lifelines, host samples, commit policy) and
Horovod started as Regatta starts it. ``run(func)`` is ``hvd.elastic.run``: the runtime's
elastic loop (a sync on every entry, fast failure detection, restores, resets) around
the user's function, whose end is the run's end. The process's exit closes the runtime,
after whatever the script does last (an evaluation of its own, say).
"""
from __future__ import annotations

import atexit
import functools
import sys
import time
from dataclasses import asdict
from pathlib import Path

from elastic import command_line
from elastic.runtime import worker
from elastic.runtime.env import Env
from elastic.runtime.runs import run_row

from .engine import UserLoopEngine

_session: "Session | None" = None


def current() -> "Session":
    if _session is None:
        raise RuntimeError("call hvd.init() first (import regatta.horovod as hvd)")
    return _session


def init(comm=None, process_sets=None) -> None:
    """Horovod's ``hvd.init``: start Horovod and Regatta's runtime around it (once)."""
    global _session
    if comm is not None or process_sets is not None:
        raise ValueError("hvd.init(comm=..., process_sets=...): the elastic world is the only one "
                         "Regatta trains over; call hvd.init() with no arguments")
    if _session is None:
        _session = Session(Env.read())
        _session.start()


class Session:
    def __init__(self, env: Env):
        program = Path(sys.argv[0]).name or "train"
        configs = command_line.parse(program, argv=list(env.args),
                                     defaults={"train": {"progress": False}})
        self.cfg = configs["train"]
        self.engine = UserLoopEngine()
        self.runtime = worker.Runtime(env, self.cfg, Path(program).stem,
                                      {name: asdict(c) for name, c in configs.items()})
        self.engine.runtime = self.runtime
        self.state = None
        self.ended = False   # the run's final status is written

    def start(self) -> None:
        worker.make_current(self.runtime)     # regatta.log and regatta.context work in the loop
        atexit.register(self.close)
        previous = sys.excepthook

        def failed(kind, err, trace):   # an error that ends the script ends the run as failed
            self.fail(err)
            previous(kind, err, trace)
        sys.excepthook = failed
        try:
            self.runtime.init(self.engine)
        except BaseException as err:
            self.fail(err)
            raise

    def adopt(self, state) -> None:
        """A TorchState was made: resume it from disk where asked; a worker replacing one
        in place takes up its predecessor's hand-off."""
        runtime = self.runtime
        self.state = runtime.state = state
        if self.cfg.resume and runtime.world.is_root:
            runtime.resumed(state, state.load_checkpoint())
        if runtime.recovery:
            runtime.recovery.adopt(state)

    def run(self, func, state, args, kwargs):
        def loop(state):
            self.runtime.enter(state)
            state.entered()
            return func(state, *args, **kwargs)
        try:
            result = self.runtime.run(state, loop)
            self.runtime.checkpoint(state)
            self.runtime.finish(state)
        except worker.Stopped:    # told to stop: committed, checkpointed, marked stopped
            self.ended = True
            raise
        except BaseException as err:
            self.fail(err)
            raise
        self.ended = True
        return result

    def fail(self, err: BaseException) -> None:
        if not self.ended:
            self.ended = True
            self.runtime.failed(err)

    def close(self) -> None:
        """At exit: a run that never went through ``run`` ended when its process did."""
        if not self.ended and self.runtime.world.is_root:
            runtime = self.runtime
            runtime.sink.emit(run_row(runtime.run_id, runtime.job, "finished", finished_at=time.time()))
        self.ended = True
        self.runtime.close()
        worker.make_current(None)


def run(func):
    """Horovod's ``hvd.elastic.run``: ``func(state, ...)`` is re-entered after every
    membership change, the state synced first."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return current().run(func, state, args, kwargs)
    return wrapper
