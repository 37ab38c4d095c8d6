"""A rank's measured peak memory, step by step, and what the number is.

On CUDA it is the caching allocator's peak of allocated bytes (``torch.cuda.max_memory_allocated``,
reset at each read): tensors only, as the estimate counts them. On a CPU there is no allocator
count, so it is the process's peak resident set (``VmHWM`` in ``/proc/self/status``, reset at each
read by writing 5 to ``/proc/self/clear_refs``): every byte the process touched, Python and torch's
own libraries included, so it is above what the tensors alone hold. Where the peak cannot be reset
(not Linux), it is the peak since the process started (``resource.getrusage``), and ``label`` says
so.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

CUDA_LABEL = "cuda allocated peak"
RSS_LABEL = "rss peak"
RSS_SINCE_START_LABEL = "rss peak since start"
STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakMemory:
    """``take()``: the peak bytes since the last ``take()`` (or since made), then a new window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.resets = self.cuda or _reset_rss()
        self.label = (
            CUDA_LABEL if self.cuda else RSS_LABEL if self.resets else RSS_SINCE_START_LABEL
        )

    def take(self) -> int:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak
        peak = _rss_peak()
        if self.resets:
            _reset_rss()
        return peak


def _rss_peak() -> int:
    """The process's peak resident bytes: VmHWM where /proc has it, else getrusage's maxrss."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS: bytes; Linux: KiB


def _reset_rss() -> bool:
    """Start a new peak-RSS window (Linux: "5" resets VmHWM to the current RSS); False if not."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True
