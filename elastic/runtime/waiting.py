"""How a rank waits for a collective or a message without stealing the CPU from the work
it waits for.

OpenMPI busy-spins in ``Wait``, and Horovod's ``synchronize`` spins yielding; with several
ranks per core (CI, laptops) a spinning pipeline stage takes the core from the stage it is
waiting for, and a rank spinning for its gradient sum takes it from Horovod's own threads,
which compute that sum (bench_allreduce.py). ``poll`` tests back to back for a while (most
waits inside a busy pipeline end there: a message is noticed within microseconds), then
sleeps between tests, at most ``cap_s``, with the thread's timer slack lowered
(``fine_timer_slack``) so that a short sleep is short. A pipeline transport spins for
``SPIN_ALONE_S`` when this machine has a core for each of its ranks (as MPI itself does),
else for ``SPIN_S``; the data-parallel engine's wait for its buckets does not spin.
"""
from __future__ import annotations

import ctypes
import time

POLL_CAP_S = 5e-5
SPIN_S = 5e-5                   # more ranks than cores here: the core may be another's
SPIN_ALONE_S = 2e-3             # a core per rank: waiting costs nobody anything
PR_SET_TIMERSLACK = 29          # prctl(2): the thread's sleep rounding, default 50 us


def fine_timer_slack(nanoseconds: int = 1000) -> None:
    """Let this thread's short sleeps end on time (Linux; elsewhere nothing changes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, nanoseconds, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def poll(done, cap_s: float = POLL_CAP_S, spin_s: float = SPIN_S) -> None:
    """Return once ``done()`` is true: test back to back for ``spin_s``, then sleep
    between tests with a delay growing to ``cap_s``."""
    if done():
        return
    spin_until = time.perf_counter() + spin_s
    while time.perf_counter() < spin_until:
        if done():
            return
    delay = 5e-6
    while not done():
        time.sleep(delay)
        delay = min(cap_s, delay * 2)
