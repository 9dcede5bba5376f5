"""Host memory a CPU rank frees stays with it for the next step (`trainer.retain_host_memory`).

glibc's malloc serves a tensor above its mmap threshold (at most 32 MiB, raised as such
blocks are freed) with a fresh mapping, and hands the heap's free top back to the kernel
above its trim threshold. A training step allocates and frees the same large tensors every
step (a data-parallel table's dense gradient, a batch's activations), so each step faults
the same pages in again, each zeroed by the kernel (`docs/launching.md` has the measured
cost). `retain_freed_memory` turns both off:
every block comes from the heap, and freed memory is reused rather than returned, so a
rank's resident memory stays at its peak (what jemalloc and tcmalloc, the allocators often
preloaded for CPU training, do as well). Not on a C library without `mallopt` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30  # hand back free heap only beyond 1 GiB


@functools.cache
def _mallopt():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Keep this process's freed host memory for reuse (see the module's doc); False where
    the C library cannot (nothing changed then)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
