"""The test harness's ranks: one that ends without reporting (os._exit, an OOM kill's SIGKILL)
fails its test at once with a line naming it and how it ended, instead of the test waiting out
its whole timeout while its peers wait on it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

# far longer than noticing an end takes: a test that reached it did not notice
TIMEOUT_S = 60


def _one_rank_ends(rank: int, world: int, how: str) -> str:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10 * TIMEOUT_S)  # a peer waiting for the rank that ended: it never reports
    return "finished"


@pytest.mark.parametrize(
    ("how", "line"),
    [("exit", "exited with code 3"), ("kill", "was ended by SIGKILL")],
)
def test_a_rank_that_ends_without_a_result_is_named(how, line):
    with pytest.raises(AssertionError) as failed:
        run_ranks(_one_rank_ends, 2, how, timeout=TIMEOUT_S)
    assert str(failed.value) == f"rank 1 failed: its process {line} before it reported a result"
