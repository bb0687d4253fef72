"""swarmd.allocator: the daemon's malloc settings (glibc's mallopt), set once at start-up."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from swarmd.allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_a_stage_sized_buffer_then_comes_from_the_heap() -> None:
    # in a child: the thresholds are process-wide, and this test must not change the test run's allocator
    code = """
import ctypes, resource, sys
from swarmd.allocator import keep_freed_memory
assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 16 * 2**20
faults = []
for _ in range(5):  # allocate, touch every page, free: as a stage's activations each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
sys.exit(0 if max(faults[1:]) < size // 4096 // 10 else 1)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # without the thresholds glibc maps the 16 MiB afresh until its own threshold has caught up: 4,097 and
    # 4,072 faults in the first two rounds here (a stage's many sizes and threads keep it from catching up)
    assert done.returncode == 0, done.stdout + done.stderr


def test_it_reports_what_it_did() -> None:
    assert keep_freed_memory() is (platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallopt"))
