"""The measured peak memory against a known allocation: a tensor of known size, every page written,
raises the CPU measure (peak resident set) by at least its bytes (less a few pages the process may
free meanwhile), and the next window, after it is freed, starts below that peak again. No timing."""

from __future__ import annotations

import gc

import pytest
import torch

from rrfp.observe import peak_memory
from rrfp.observe.peak_memory import RSS_LABEL, RSS_SINCE_START_LABEL, PeakMemory

SIZE = 96 * 2**20  # above glibc's largest mmap threshold (32 MiB): freed, it leaves the process
# what the rest of a long test process may free between reading its resident set and allocating
# (0.2 MiB seen after a thousand tests): the measure must rise by the allocation less this
SLACK = 4 * 2**20


def _rss() -> int:
    for line in peak_memory.STATUS.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not peak_memory.STATUS.exists(), reason="needs /proc (Linux)")
def test_the_cpu_peak_rises_by_a_known_allocation_and_resets_each_window():
    peak = PeakMemory(torch.device("cpu"))
    assert peak.label == RSS_LABEL  # Linux: the peak resets at each take()
    gc.collect()
    peak.take()  # a new window, starting at the present resident set
    start = _rss()
    x = torch.ones(SIZE // 4)  # float32: SIZE bytes, each page written
    assert x.sum().item() == SIZE // 4
    del x
    held = peak.take()
    assert held >= start + SIZE - SLACK, (held, start)
    assert peak.take() < held - SIZE // 2  # freed: the next window's peak is below it


def test_without_a_resettable_peak_the_label_says_since_start(tmp_path, monkeypatch):
    monkeypatch.setattr(peak_memory, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    peak = PeakMemory(torch.device("cpu"))
    assert peak.label == RSS_SINCE_START_LABEL and not peak.resets
    assert peak.take() > 0
