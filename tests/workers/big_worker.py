"""A worker holding a lot of memory and one TCP connection: SIGKILLed, its kernel tears the
memory down before it closes the connection.

    HOROVOD_HOSTNAME=H python -m elastic.launch.shim tests/workers/big_worker.py PORT GB [CHANNEL]

Run by a warm agent (tests/test_dying.py), or directly with an agent's CHANNEL fd: it
connects to 127.0.0.1:PORT, touches GB of memory, hands the connection to its agent as a
lifeline, sends its pid over it and waits to be killed (at most a minute).
"""
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elastic.failures import restart  # noqa: E402

if len(sys.argv) > 3:
    os.environ[restart.AGENT_CHANNEL_ENV] = sys.argv[3]
connection = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
memory = bytearray(int(float(sys.argv[2]) * (1 << 30)))
memory[::4096] = b"\1" * len(memory[::4096])     # every page resident
restart.hand_lifelines_to_agent([connection])
connection.sendall(f"{os.getpid()}\n".encode())
time.sleep(60)
