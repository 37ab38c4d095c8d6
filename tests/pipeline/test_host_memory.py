"""On glibc, keep_freed_host_memory keeps freed blocks in the process: memory that a task touches,
frees and touches again (B's held tensors, freed by W) faults its pages in once, not every time."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from rrfp.pipeline.split_backward.host_memory import keep_freed_host_memory

PAGES = 64 * 2**20 // 4096  # 64 blocks of 1 MiB


def _faults_of_one_round() -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    blocks = [torch.ones(2**18) for _ in range(64)]  # 1 MiB each, written
    del blocks
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_memory_freed_and_touched_again_faults_once():
    assert keep_freed_host_memory()
    rounds = [_faults_of_one_round() for _ in range(4)]
    # glibc's defaults give the freed heap top back and fault every round in again (~PAGES each)
    assert rounds[-1] < PAGES // 20, rounds
    assert keep_freed_host_memory()  # once per process, then the same answer
