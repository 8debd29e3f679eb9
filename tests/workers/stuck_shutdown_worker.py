"""A survivor whose Horovod shutdown does not return: Gloo holds Horovod's background loop
in a wait for a dead peer (until its 30 s timeout) and ``hvd.shutdown``, a reset's first
call, joins that loop. Its recovery's watch must restart it in place, commit handed over.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/stuck_shutdown_worker.py --run-dir DIR

Run by a warm agent (tests/test_agent.py). Horovod is initialised for real (one rank) and
then not shut down, which is what the watch sees of a shutdown that never returns. The
replacement (REGATTA_HANDOFF set) prints the commit it was handed and exits 0.

``--ingest URL`` sends its events to a dashboard there too; ``--init-fails`` has the main
thread report a failed ``hvd.init`` while the watch is leaving (sending its last rows).
"""
import os
import sys
import time

from handed_commit import Committed, exit_if_replacement

exit_if_replacement()

import horovod.torch as hvd  # noqa: E402 (a replacement exits without it)

from elastic.failures.liveness import Heartbeat  # noqa: E402
from elastic.failures.recovery import FastRecovery  # noqa: E402
from elastic.runtime.events import EventLog  # noqa: E402
from monitor.sink import HttpSink  # noqa: E402

hvd.init()
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
sink = HttpSink(sys.argv[sys.argv.index("--ingest") + 1]) if "--ingest" in sys.argv else None
events = EventLog(run_dir, os.environ["HOROVOD_HOSTNAME"], 0, sink=sink, run_id="stuck")
recovery = FastRecovery(events, Heartbeat())
recovery.adopt(Committed())
recovery.entered = True        # it trained: it holds the job's state
print("re-forming from", time.time(), flush=True)
recovery.before_init()         # a peer died: restore, then the reset's hvd.shutdown() ...
if "--init-fails" in sys.argv:
    while "restart_in_place" not in events.path.read_text():
        time.sleep(0.001)
    recovery.init_failed()
time.sleep(60)                 # ... which does not return
print("never restarted", flush=True)
