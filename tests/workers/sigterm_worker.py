"""A worker that takes SIGTERM as a scheduler's notice: it says so and exits 0.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/sigterm_worker.py

Run by a warm agent (tests/test_agent.py). It is the agent's child, not the shim's, so it
hears a signal sent to the shim (what horovodrun signals) only if the shim forwards it.
"""
import os
import signal
import sys
import time


def on_term(_signum, _frame):
    print("worker", os.getpid(), "got SIGTERM", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
print("worker ready", os.getpid(), flush=True)
time.sleep(60)
sys.exit(3)   # never told
