"""Freed host memory kept for reuse, so that a CPU task does not fault its pages in again.

On CPU a stage's tensors come from glibc's malloc. Its default adapts two thresholds at run
time: blocks above the mmap threshold (128 KiB at first) are mapped for each allocation and
unmapped when freed, and free memory above the trim threshold at a heap's top goes back to the
kernel. Each task of a training iteration allocates and frees the same large activations, so
with the defaults each one maps (or regrows) fresh pages and faults them in one by one, in the
kernel's time on the task's thread: hundreds of page faults per task on the vlm's last stage in
the compute lane's thread, which allocates from an arena of its own.

Fixing both thresholds at the largest values glibc's own rule reaches (32 MiB blocks mapped on
their own, 64 MiB of free top kept) keeps an iteration's memory for the next task: the process
holds its peak, as a GPU's caching allocator does. Elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger("rrfp.loop")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); mallopt refuses more
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # as glibc's rule pairs them

_lock = threading.Lock()
_kept: bool | None = None  # None: not tried yet


def keep_freed_memory() -> bool:
    """Once per process: glibc's malloc keeps freed blocks for reuse (see the module docstring).
    True when it does now, False where there is no glibc or it refused."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = _set_thresholds()
        return _kept


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        logger.debug("no glibc malloc: its thresholds stay as they are")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either ends glibc's adaptation of both
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    version.restype = ctypes.c_char_p
    logger.debug(
        "glibc %s malloc: %s",
        version().decode(),
        "freed memory up to the thresholds kept for reuse" if done else "mallopt refused",
    )
    return bool(done)
