"""Regatta's second patch to Horovod (tools/horovod-fixed-parameters-on-reinit.patch):
``hvd.init`` run again in the same process, as every elastic reset runs it, with both the
fusion threshold and the cycle fixed by the environment (as Regatta starts Horovod). As
released, the second init wrote Horovod's default fusion threshold into the autotuner's
empty vector and the process died of a segmentation fault (exit 139)."""
import re
import subprocess

from conftest import BIN, PYTHON, ROOT, kill_tree

# Three worlds in one process, each summing its ranks' numbers once.
SCRIPT = """
import horovod.torch as hvd, torch
for world in range(3):
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1 + world)]), op=hvd.Sum, name=f"w{world}")
    print(f"WORLD {world} RANK {hvd.rank()} SUM {total.item():g}", flush=True)
    hvd.shutdown()
"""


def test_hvd_init_again_with_fusion_and_cycle_fixed_by_the_environment():
    proc = subprocess.Popen([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                             "--network-interface", "lo", PYTHON, "-c", SCRIPT], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={"PATH": f"{BIN}:/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo",
                                 "HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "20"})
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc.pid)
    sums = {(int(w), int(r)): float(s) for w, r, s in re.findall(r"WORLD (\d) RANK (\d) SUM ([0-9.]+)", out)}
    assert proc.returncode == 0, out[-3000:]
    # ranks 0 and 1 add 1 + world and 2 + world
    assert sums == {(w, r): 3.0 + 2 * w for w in range(3) for r in range(2)}, out[-3000:]
