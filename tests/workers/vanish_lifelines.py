"""Inside private namespaces (tests/test_netns.py runs it through netns.private): four
light ranks, each on its own simulated host. Rank 1 is SIGSTOPped for STOP seconds; a
second later host 2's link goes down (it vanishes). Prints one JSON line: who learned
what, when, relative to the fault.

    unshare ... python tests/workers/vanish_lifelines.py [STOP_SECONDS]
"""
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.bench_lifelines import LightCluster   # noqa: E402
from elastic.launch.netns import Network   # noqa: E402


def main() -> None:
    stop_s = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    os.environ["REGATTA_PRIVATE_NETWORK"] = "1"
    with tempfile.TemporaryDirectory() as folder, Network(folder) as net:
        hosts = [net.add_host(f"host{i}") for i in range(4)]
        cluster = LightCluster(4, address=net.hub_address, places=hosts, stall_after=3.0)
        try:
            cluster.start()
            stopped_at = cluster.kill(1, signal.SIGSTOP)
            time.sleep(1.0)
            vanished_at = time.time()
            net.link("host2", up=False)
            cluster.wait_for(lambda: False, timeout=max(0.0, stopped_at + stop_s - time.time()))
            cluster.kill(1, signal.SIGCONT)
            cluster.wait_for(lambda: bool(cluster.find("S", f2="stall_cleared")), timeout=5)
            print(json.dumps({
                "deaths": [[int(f[1]), int(f[2]), f[3], float(f[4]) - vanished_at]
                           for f in cluster.find("D")],
                "stalls": [[int(f[1]), f[2], int(f[3]), float(f[4]) - stopped_at]
                           for f in cluster.find("S")],
                "stop_s": stop_s}))
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
