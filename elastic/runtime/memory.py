"""Keep the memory a training step frees inside the process, so that the next step does
not fault the same pages in again.

glibc's malloc, the allocator torch gets on Linux, gives every block of 128 KB or more its
own ``mmap`` and unmaps it when freed (it raises that threshold as it sees such blocks
freed, up to 32 MB), and gives the top of its heap back to the kernel once enough of it is
free (twice the threshold). A step frees and allocates the same activations and gradients
every time, so the kernel zero-fills the same pages every step: bench_allocator.py
measures 1,600 page faults a step for bench_pipeline's stage (8 Linear layers, 512 wide,
32 rows) and 19,000 for the throughput bench's 26M-parameter MLP, whose steps then take
1.4 times as long as with the memory kept (charlm, whose tensors are small: the same).

:func:`keep_freed_memory` raises glibc's mmap threshold to its ceiling and stops trimming
(``mallopt``), as jemalloc and tcmalloc behave by default: the memory of a step's peak
stays with the process. The runtime calls it at start (``REGATTA_KEEP_FREED_MEMORY=0``
turns it off); glibc's own tunables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``), where the user set them, win.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1              # mallopt(3) parameters
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20       # glibc's ceiling on 64-bit: larger values are refused
NEVER_TRIM = 2 ** 31 - 1            # mallopt takes an int
USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "GLIBC_TUNABLES")


def user_tuned(environ) -> bool:
    """Whether the environment sets glibc's malloc tunables itself."""
    return any(environ.get(name) for name in USER_TUNABLES)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process; returns whether it applied
    (not on another C library)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (ValueError, OSError):   # not glibc
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
