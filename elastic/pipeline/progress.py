"""A thread that keeps MPI messages moving while the stage computes.

MPI moves a message only inside MPI calls. Between two calls of a stage's executor there
is a whole forward or backward (milliseconds), and a message larger than the eager limit
(4 KB for Open MPI's shared-memory transport) needs both ends to take part: without a
single-copy mechanism (CMA, which containers often forbid) the sender copies it through a
shared buffer fragment by fragment, so a send posted before a forward moved only once that
forward ended, and the next stage waited for it. Measured with bench_pipeline, 2 stages at
m = 2 (bubble; ideal 0.333): 0.36 with CMA, 0.51 without, 0.38 without CMA and with this
thread.

While any send or receive of the transport is outstanding (``started``; ``ended`` once
the training thread saw it complete) the thread asks MPI for a message that never comes
(``Iprobe`` on a private communicator), which runs MPI's progress engine, every
``interval_s``; torch releases the GIL while it computes, so the thread runs beside a
forward. It needs ``MPI_THREAD_MULTIPLE`` and a core that no rank's compute threads use
(``wanted``): where they fill the cores it would take time from the stage it waits for.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

from elastic.runtime.waiting import fine_timer_slack

INTERVAL_S = 1e-4
NEVER_TAG = 32001           # no message carries it: an Iprobe that only drives progress


def wanted(comm, forced: bool | None = None) -> bool:
    """Whether a progress thread pays here: ``forced`` if given, else where this machine
    has more cores than its ranks' compute threads. Every rank of ``comm`` gets the same
    answer (the thread's communicator is made collectively): yes only if yes on every
    machine, and never without ``MPI_THREAD_MULTIPLE``."""
    import torch
    from mpi4py import MPI
    if forced is None:
        here = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            forced = here.Get_size() * torch.get_num_threads() < len(os.sched_getaffinity(0))
        finally:
            here.Free()
    mine = int(bool(forced) and MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
    return bool(comm.allreduce(mine, op=MPI.MIN))


class Progress:
    def __init__(self, comm, interval_s: float = INTERVAL_S):
        from mpi4py import MPI
        self._any = MPI.ANY_SOURCE
        self._comm = comm.Dup()          # its own: the probe can never take a real message
        self._interval = interval_s
        self._outstanding = 0            # changed by the training thread only
        self._posted, self._stopping = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="regatta-mpi-progress", daemon=True)
        self._thread.start()
        # A run that ends by an exception never closes its transport; MPI is finalized at
        # exit, and no thread may call it after that.
        atexit.register(self.close)

    def started(self) -> None:
        """A send or receive was posted: keep MPI moving until it has ended."""
        self._outstanding += 1
        self._posted.set()

    def ended(self) -> None:
        self._outstanding -= 1

    def close(self) -> None:
        if self._stopping:
            return
        atexit.unregister(self.close)
        self._stopping = True
        self._posted.set()
        self._thread.join()
        self._comm.Free()

    def _run(self) -> None:
        fine_timer_slack()
        while not self._stopping:
            self._posted.wait()
            self._posted.clear()
            while not self._stopping and self._outstanding > 0:
                self._comm.Iprobe(source=self._any, tag=NEVER_TAG)
                time.sleep(self._interval)
