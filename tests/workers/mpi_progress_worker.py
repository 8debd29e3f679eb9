"""Two ranks: rank 0 sends 4 MB to rank 1, then computes for COMPUTE_S without calling
MPI; rank 1 waits for the message and prints when it arrived. Then the other way round:
rank 1 posts its receive and computes for COMPUTE_S, rank 0 sends after LATE_S and prints
when its send ended. Run once with the transport's progress thread and once without
(``on``/``off``), under an MPI without single-copy:

    mpirun -np 2 --mca btl_vader_single_copy_mechanism none \
        python tests/workers/mpi_progress_worker.py on
"""
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from elastic.pipeline.transport import MpiTransport  # noqa: E402

COMPUTE_S = 0.5
LATE_S = 0.2


def compute(seconds: float, a, b):
    """A forward: no MPI call for ``seconds``."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        a = torch.tanh(a @ b)


def main(mode: str) -> None:
    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    if mode == "disagree":   # the thread's communicator is made collectively: one answer
        transport = MpiTransport(dp_color=rank, dp_key=0, progress_thread=rank == 0)
        print(f"PROGRESS {rank} {transport.progress_thread}", flush=True)
        transport.close()
        return
    transport = MpiTransport(dp_color=rank, dp_key=0, progress_thread=(mode == "on"))
    tensor = torch.full((1 << 20,), float(rank + 1))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for attempt in range(3):
        transport.barrier()
        started = time.perf_counter()
        if rank == 0:
            handle = transport.isend(tensor, 1, attempt)
            compute(COMPUTE_S, a, b)
            handle.wait()
        else:
            transport.irecv(tensor, 0, attempt).wait()
            assert torch.equal(tensor, torch.ones_like(tensor)), "the message arrived wrong"
            print(f"ARRIVED {mode} {time.perf_counter() - started:.4f}", flush=True)
    for attempt in range(3):
        transport.barrier()
        started = time.perf_counter()
        if rank == 0:
            time.sleep(LATE_S)
            transport.isend(tensor, 1, 10 + attempt).wait()
            print(f"SENT {mode} {time.perf_counter() - started:.4f}", flush=True)
        else:
            handle = transport.irecv(tensor, 0, 10 + attempt)
            compute(COMPUTE_S, a, b)
            handle.wait()
    transport.close()


if __name__ == "__main__":
    main(sys.argv[1])
