"""A worker that Gloo would abort: it leaves a hand-off (or not) and calls abort().

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/abort_worker.py [--handoff [--unplaced]]

Run by a warm agent (tests/test_agent.py). A replacement (REGATTA_HANDOFF set) says which
hand-off it was given, and whether its files are still there to load, then exits 0.
"""
import os
import sys
from pathlib import Path

from elastic.failures import restart

inherited = os.environ.get(restart.HANDOFF_ENV)
if inherited:
    print("replacement of", inherited, "slot", restart.handed_slot(Path(inherited)), flush=True)
    for left in restart.handoff_files(Path(inherited)):
        left.unlink(missing_ok=True)
    sys.exit(0)
if "--handoff" in sys.argv:   # re-forming the world: the description goes out first
    mine = restart.own_handoff_path()
    # --unplaced: aborted before the driver gave it a place, as Horovod aborts the worker
    # of a removed host
    restart.describe_handoff(mine, 1, placed="--unplaced" not in sys.argv)
    print("handoff out at", mine, flush=True)
os.abort()
