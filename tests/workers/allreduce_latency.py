"""Each rank times small allreduces queued at random instants within Horovod's cycle;
rank 0 prints the median in ms as ``LATENCY <ms>``.

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
tensor, latencies = torch.ones(1024), []
for i in range(12):
    hvd.allreduce(tensor, name="align")   # both ranks leave together, then each waits alike
    time.sleep(random.Random(i).uniform(0, 0.1))
    began = time.perf_counter()
    hvd.allreduce(tensor, name="timed")
    latencies.append(time.perf_counter() - began)
if hvd.rank() == 0:
    print(f"LATENCY {statistics.median(latencies) * 1000:.2f}", flush=True)
