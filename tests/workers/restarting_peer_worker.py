"""A rank restarted in place while the world re-forms, with a lifeline peer in another
process (the test's) and a rendezvous store (a real Horovod KV store in the test).
Unplaced (``--unplaced``: its Horovod shutdown never returns, as in
stuck_shutdown_worker.py), it must say goodbye on its lifelines and leave the store
alone; placed in a rendezvous (it prints ``placed``; the test then kills its lifeline
end), it must mark that rendezvous as it leaves.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/restarting_peer_worker.py \
        --run-dir DIR --exchange FOLDER --rendezvous 127.0.0.1:PORT [--unplaced]

Run by a warm agent (tests/test_agent.py). The replacement (REGATTA_HANDOFF set) prints
the commit it was handed and exits 0.
"""
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from handed_commit import Committed, allgather_through, exit_if_replacement

exit_if_replacement()

import horovod.torch as hvd  # noqa: E402 (a replacement exits without it)

from elastic.failures.liveness import Heartbeat  # noqa: E402
from elastic.failures.recovery import FastRecovery  # noqa: E402
from elastic.runtime.events import EventLog  # noqa: E402


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


host = os.environ["HOROVOD_HOSTNAME"]
events = EventLog(arg("--run-dir"), host, 0, run_id="restarting")
recovery = FastRecovery(events, Heartbeat())
recovery.before_init()
hvd.init()      # one rank, for real: what the watch reads of Horovod's state
address, port = arg("--rendezvous").split(":")
os.environ.update(HOROVOD_GLOO_RENDEZVOUS_ADDR=address, HOROVOD_GLOO_RENDEZVOUS_PORT=port)
recovery.adopt(Committed())
recovery.initialised()
recovery.enter(SimpleNamespace(rank=0, size=2, host=host),
               allgather_through(Path(arg("--exchange")), 0, 2))
recovery.before_init()          # the world re-forms: the driver has not placed this slot yet
if "--unplaced" not in sys.argv:
    hvd.shutdown()
    os.environ["HOROVOD_SIZE"] = "2"    # the driver placed it: Horovod sets this (in C)
    print("placed", flush=True)
time.sleep(60)
print("never restarted", flush=True)
