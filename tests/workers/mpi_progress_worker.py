"""Two ranks: rank 0 sends 4 MB to rank 1, then computes for COMPUTE_S without calling
MPI; rank 1 waits for the message and prints when it arrived. Run once with the transport's
progress thread and once without (``on``/``off``), under an MPI without single-copy:

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


def main(mode: str) -> None:
    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    transport = MpiTransport(dp_color=rank, dp_key=0, progress_thread=(mode == "on"))
    tensor = torch.full((1 << 20,), float(rank + 1))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for attempt in range(3):
        transport.barrier()
        started = time.perf_counter()
        if rank == 0:
            handle = transport.isend(tensor, 1, attempt)
            while time.perf_counter() - started < COMPUTE_S:   # a forward: no MPI call
                a = torch.tanh(a @ b)
            handle.wait()
        else:
            transport.irecv(tensor, 0, attempt).wait()
            assert torch.equal(tensor, torch.ones_like(tensor)), "the message arrived wrong"
            print(f"ARRIVED {mode} {time.perf_counter() - started:.4f}", flush=True)
    transport.close()


if __name__ == "__main__":
    main(sys.argv[1])
