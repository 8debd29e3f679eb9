"""A worker that takes SIGTERM as a scheduler's notice: it says so and exits 0.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/sigterm_worker.py

Run by a warm agent (tests/test_agent.py). It is the agent's child, not the shim's, so it
hears a signal sent to the shim (what horovodrun signals) only if the shim forwards it.
"""
import os
import signal
import sys
import time


told = []


def on_term(_signum, _frame):
    # Only a note here: the signal can land while the line below is still being printed,
    # and printing again from the handler would re-enter that same buffered write.
    told.append(True)


signal.signal(signal.SIGTERM, on_term)
print("worker ready", os.getpid(), flush=True)
deadline = time.monotonic() + 60
while not told and time.monotonic() < deadline:
    time.sleep(0.02)
if told:
    print("worker", os.getpid(), "got SIGTERM", flush=True)
    sys.exit(0)
sys.exit(3)   # never told
