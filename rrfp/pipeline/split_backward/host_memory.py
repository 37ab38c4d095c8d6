"""Keeping freed host memory in the process, so that a split backward on CPU does not fault its
pages in again every microbatch.

B holds what W needs until W runs (the input and the output gradient of every queued linear, and
under activation checkpointing the recomputed regions' tensors); W then frees it at once. glibc's
malloc serves large blocks with mmap and gives the top of its heap back to the system once more
than its trim threshold is free (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), so the next B faults those
pages in again: thousands of minor faults per B on an HF Llama stage, kernel time inside the
task's CPU time, which the unsplit backward (freeing as it goes) does not pay. Fixing both
thresholds keeps memory in the heap once touched, as torch's caching allocator keeps device
memory on a GPU. Process-wide; a no-op where libc has no ``mallopt`` (macOS, musl).
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_kept: bool | None = None  # None: not tried yet


def keep_freed_host_memory() -> bool:
    """Let glibc keep freed memory up to 32 MiB blocks in the heap and never trim it; True if it
    does (once per process)."""
    global _kept
    if _kept is None:
        _kept = _mallopt() if sys.platform.startswith("linux") else False
        if _kept:
            log.info("host memory: freed blocks stay in the process (glibc mallopt)")
    return _kept


def _mallopt() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: its libc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
        and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    )
