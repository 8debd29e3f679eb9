"""A worker that replaces another while the world re-forms, on a host planned to die
"syncing" in the first recovery after step 50: it must die there if the worker it replaces
carried step 50 or later into the re-forming (a replacement is the same host, in the same
recovery), and live on otherwise.

    REGATTA_HANDOFF=PATH HOROVOD_HOSTNAME=H HOROVOD_GLOO_RENDEZVOUS_ADDR=127.0.0.1 \
        HOROVOD_GLOO_RENDEZVOUS_PORT=P python tests/workers/doomed_replacement.py --run-dir DIR

Run by tests/test_agent.py, which gives it a predecessor's hand-off description and its
place in a real Horovod key-value store. It prints "survived" if the fault spared it.
"""
import os
import sys

from elastic.failures.faults import FaultPlan
from elastic.failures.liveness import Heartbeat
from elastic.failures.recovery import FastRecovery
from elastic.runtime.events import EventLog

host = os.environ["HOROVOD_HOSTNAME"]
plan = FaultPlan(kill_syncing=[{"host": host, "step": 50}])
events = EventLog(sys.argv[sys.argv.index("--run-dir") + 1], host, 0, run_id="doomed")
recovery = FastRecovery(events, Heartbeat(), dies_recovering=lambda step: plan.dies_recovering(host, step))
recovery.before_init()    # takes its place from the store, and its predecessor's step
recovery.initialised()    # where a host planned to die syncing dies
print("survived", flush=True)
