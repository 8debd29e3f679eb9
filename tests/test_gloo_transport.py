"""The pipeline's Gloo group forms between a rank that saw one fail to form and a fresh
process (a replacement or an added host), in real processes on loopback; and it connects
over horovodrun's ``--network-interface``:

    python tests/test_gloo_transport.py ROLE FAILED_PORT PORT
    python tests/test_gloo_transport.py interface NAME PORT
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def survivor(failed_port: int, port: int) -> None:
    """Rank 0 of a group whose peer never comes (it died), then of the next one."""
    try:
        GlooTransport(0, 2, f"tcp://127.0.0.1:{failed_port}", [[0], [1]], 0, timeout_s=1)
    except RuntimeError as err:
        print("first group failed:", type(err).__name__, flush=True)
    meet(0, port)


def meet(rank: int, port: int) -> None:
    transport = GlooTransport(rank, 2, f"tcp://127.0.0.1:{port}", [[0], [1]], rank, timeout_s=30)
    began = time.monotonic()
    transport.barrier()
    print(f"rank {rank} formed, barrier in {time.monotonic() - began:.3f} s", flush=True)
    transport.close()


def test_a_rank_whose_group_failed_to_form_meets_a_fresh_process(tmp_path):
    from conftest import PYTHON, kill_tree
    from elastic.runtime.torch_group import free_port
    failed, port = free_port("127.0.0.1"), free_port("127.0.0.1")
    script = str(Path(__file__))
    procs = [subprocess.Popen([PYTHON, script, role, str(failed), str(port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("survivor", "fresh")]
    try:
        began = time.monotonic()
        outs = [p.communicate(timeout=60)[0] for p in procs]
        took = time.monotonic() - began
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "first group failed" in outs[0] and "rank 0 formed" in outs[0], outs
    assert "rank 1 formed" in outs[1], outs
    # the first group's 1 s timeout, then seconds; the bug waited out the second's 30 s
    assert took < 20, outs


def on_interface(name: str, port: int) -> None:
    """One rank's pipeline transport as the engine makes it under horovodrun, whose
    ``--network-interface`` arrives as HOROVOD_GLOO_IFACE."""
    from elastic.pipeline.engine import make_transport
    from elastic.runtime.env import Env
    from elastic.runtime.world import World
    env = Env.read({"HOROVOD_RANK": "0", "HOROVOD_GLOO_IFACE": name,
                    "REGATTA_PIPE_INIT": f"tcp://127.0.0.1:{port}"})
    try:
        make_transport("auto", World.single(), [[0]], 0, None, env).close()
        print("formed", flush=True)
    except RuntimeError as err:
        print("failed:", err, flush=True)


def test_the_pipelines_group_connects_over_horovods_network_interface():
    """Gloo would take the address the host name resolves to: on a machine with several
    networks, not the one horovodrun was told to use. An interface that does not exist
    shows the name reached Gloo; ``lo`` forms."""
    import os
    from conftest import PYTHON
    from elastic.runtime.torch_group import free_port
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    outs = {}
    for name in ("rg-none0", "lo"):
        done = subprocess.run([PYTHON, str(Path(__file__)), "interface", name,
                               str(free_port("127.0.0.1"))], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outs[name] = done.stdout
    assert "failed:" in outs["rg-none0"] and "Unable to find address for: rg-none0" in outs["rg-none0"]
    assert outs["lo"].strip() == "formed", outs["lo"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from elastic.pipeline.gloo_transport import GlooTransport
    if sys.argv[1] == "interface":
        on_interface(sys.argv[2], int(sys.argv[3]))
        sys.exit()
    role, failed_port, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if role == "survivor":
        survivor(failed_port, port)
    else:
        time.sleep(2)    # joins once the survivor's first group has failed
        meet(1, port)
