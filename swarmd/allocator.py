"""Keep freed tensor memory in the process instead of handing it back to the kernel every step.

A stage's step allocates and frees the same large buffers over and over: activations kept for
backwards, their gradients, the step's flat gradient. glibc's malloc serves buffers above its
mmap threshold (128 KiB, raised as large blocks are freed, up to 32 MiB) with fresh ``mmap``s and
returns them on ``free``, and trims a heap's free top above its trim threshold: so every step
the kernel zero-fills the same pages again, page fault by page fault. Measured on a daemon of
``small`` (``scripts/bench_pipeline.py``, a per-job ``RUSAGE_THREAD`` trace): the last stage's
largest call took 5,017 page faults and 30 ms of system time of its 137 ms, once per step.

:func:`keep_freed_memory` raises both thresholds with ``mallopt(3)``, once, at start-up
(``swarmd`` and ``swarmd train`` call it before their first tensor): buffers up to 32 MiB come
from the heap and freed memory stays for the next step. The cost is that a process keeps its peak
heap (which a stage reaches again at every step anyway). Only glibc has ``mallopt``; elsewhere
(musl, macOS) this does nothing and says so in a debug line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest allowed (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD_BYTES = 1 << 30  # freed heap tops below this stay mapped


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring). True if they were set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: the allocator keeps its defaults")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and done
    if not done:
        log.debug("mallopt refused the thresholds: the allocator keeps its defaults")
    return done
