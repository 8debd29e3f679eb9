"""Small allreduces queued at random instants within Horovod's cycle, three ways; rank 1
prints the medians in ms and its CPU time while idle:

* ``TOGETHER``: both ranks queue at the same instant;
* ``LATE``: rank 0 queues 30 ms before rank 1, whose wait is timed (rank 0 must not have
  gone back to sleep for a cycle with its tensor pending);
* ``IDLE_CPU``: the process's CPU seconds over 2 s with nothing queued (the loop must still
  sleep between idle rounds).

    HOROVOD_CYCLE_TIME=100 HOROVOD_WAKE_ON_ENQUEUE=0|1 \
        horovodrun -np 2 -H localhost:2 --gloo python tests/workers/allreduce_latency.py

Run by tests/test_horovod_wake.py.
"""
import random
import statistics
import time

import horovod.torch as hvd
import torch

hvd.init()
tensor = torch.ones(1024)


def median_ms(stagger_s: float) -> float:
    latencies = []
    for i in range(12):
        hvd.allreduce(tensor, name="align")   # both ranks leave together, then wait alike
        time.sleep(random.Random(i).uniform(0, 0.1) + stagger_s * hvd.rank())
        began = time.perf_counter()
        hvd.allreduce(tensor, name="timed")
        latencies.append(time.perf_counter() - began)
    return statistics.median(latencies) * 1000


together, late = median_ms(0.0), median_ms(0.03)
hvd.allreduce(tensor, name="align")
cpu = time.process_time()
time.sleep(2)
idle_cpu = time.process_time() - cpu
if hvd.rank() == 1:
    print(f"TOGETHER {together:.2f} LATE {late:.2f} IDLE_CPU {idle_cpu:.3f}", flush=True)
