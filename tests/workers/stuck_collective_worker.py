"""A survivor whose step's collective does not raise after its lifeline reported a death
and its Gloo connections were severed: Horovod's background loop waits in Gloo on a
connection Gloo had already closed (seen in a chaos run: 30 s, Gloo's timeout). Its
recovery's watch must restart it in place, commit handed over.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/stuck_collective_worker.py --run-dir DIR

Run by a warm agent (tests/test_agent.py). Horovod is initialised for real (one rank),
the lifelines built, then the death a lifeline reports is played into the recovery while
the main thread stays in its step. The replacement (REGATTA_HANDOFF set) prints the
commit it was handed and exits 0.
"""
import os
import sys
import time
from types import SimpleNamespace

from handed_commit import Committed, exit_if_replacement

exit_if_replacement()

import horovod.torch as hvd  # noqa: E402 (a replacement exits without it)

from elastic.failures.liveness import Heartbeat  # noqa: E402
from elastic.failures.recovery import FastRecovery  # noqa: E402
from elastic.runtime.events import EventLog  # noqa: E402

run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
events = EventLog(run_dir, os.environ["HOROVOD_HOSTNAME"], 0, run_id="stuck")
heartbeat = Heartbeat()
recovery = FastRecovery(events, heartbeat, committed_step=lambda: Committed.step)
recovery.before_init()
hvd.init()
recovery.adopt(Committed())
recovery.initialised()
recovery.enter(SimpleNamespace(rank=0, size=1, host=os.environ["HOROVOD_HOSTNAME"]),
               lambda obj, name: hvd.allgather_object(obj, name=name))
recovery.gloo = []    # as in the chaos run's case: Gloo had closed what it waits on
with heartbeat.collective(SimpleNamespace(step=Committed.step + 2)):   # two steps on: ...
    print("peer died at", time.time(), flush=True)
    recovery._on_death(1, "peer", "eof", time.time())   # what its lifeline calls
    time.sleep(60)                               # ... whose collective never raises
print("never restarted", flush=True)
