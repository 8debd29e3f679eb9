"""A worker that holds a lifeline to the test and hands it to its agent, as a training
worker does on entering its loop, then waits to be killed.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/lifeline_holder.py \
        --exchange FOLDER

Run under the shim (tests/test_agent.py). It prints ``up`` once its lifeline is built.
"""
import sys
import time
from pathlib import Path

from handed_commit import allgather_through

from elastic.failures import restart
from elastic.failures.lifeline import Lifeline
from elastic.failures.liveness import Heartbeat

folder = Path(sys.argv[sys.argv.index("--exchange") + 1])
lifeline = Lifeline(0, 2, "holder", "127.0.0.1", allgather_through(folder, 0, 2), Heartbeat(),
                    lambda *death: None)
restart.hand_lifelines_to_agent(list(lifeline.peers))
print("up", flush=True)
time.sleep(60)
