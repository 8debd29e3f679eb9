"""A helper process that must not outlive the process that started it."""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1      # prctl(2)


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process the instant ``parent`` dies (Linux), and exit
    now if it already has. A child that lingers keeps what it inherited open: a dead
    rank's sockets and output pipes, which the launcher and the peers wait on."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:     # it died before the line above
        os._exit(1)
