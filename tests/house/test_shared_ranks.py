"""The shared ranks (tests/harness/rank_pool.py): a function finds the process as a fresh rank
would, whatever the last one changed of it; one that leaves a process or a thread running ends the
pool; a failing one fails its test with the rank's traceback."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

TIMEOUT_S = 60


def _state(rank, world, change: bool):
    """What of the process a test could see, drawn before changing it (``change``)."""
    import logging
    import os
    import random
    import signal
    import subprocess
    import sys

    import torch

    import rrfp.pipelining.schedule as schedule

    seen = {
        "pid": os.getpid(),
        "draws": (torch.rand(2).tolist(), random.random()),
        "env": os.environ.get("SPOOL_LEFT"),
        "cwd": os.getcwd(),
        "path": sys.path[0],
        "dtype": str(torch.get_default_dtype()),
        "device": str(torch.get_default_device()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "sigusr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
        "level": logging.getLogger("rrfp").level,
        "grad": torch.is_grad_enabled(),
        "patched": (schedule._check_module.__name__, hasattr(schedule, "SPOOL_ADDED")),
    }
    if change:
        os.environ["SPOOL_LEFT"] = "1"
        os.chdir("/")
        sys.path.insert(0, "/nowhere")
        torch.set_default_dtype(torch.float64)
        torch.set_default_device("meta")
        torch.use_deterministic_algorithms(True)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        logging.getLogger("rrfp").setLevel(logging.ERROR)
        torch.set_grad_enabled(False)
        schedule._check_module, schedule.SPOOL_ADDED = len, 1  # patched, never put back
        if change == "child":
            subprocess.Popen(["sleep", "8"])  # left running: the ranks cannot be reused
        if change == "native":  # a thread threading does not list, as gloo's own are
            import _thread
            import time

            _thread.start_new_thread(time.sleep, (8,))
    return seen


def test_a_function_finds_the_process_as_a_fresh_rank_would():
    first = run_ranks(_state, 2, True, timeout=TIMEOUT_S, shared=True)
    again = run_ranks(_state, 2, False, timeout=TIMEOUT_S, shared=True)
    for rank in range(2):
        assert again[rank]["pid"] == first[rank]["pid"], "the ranks were not reused"
        assert again[rank] == first[rank], f"rank {rank} kept what the last function changed"


@pytest.mark.parametrize("what", ["child", "native"], ids=["a process", "a native thread"])
def test_a_function_that_leaves_something_running_ends_the_shared_ranks(what):
    left = run_ranks(_state, 2, what, timeout=TIMEOUT_S, shared=True)
    after = run_ranks(_state, 2, False, timeout=TIMEOUT_S, shared=True)
    assert {after[r]["pid"] for r in range(2)}.isdisjoint(left[r]["pid"] for r in range(2))


def _fails(rank, world):
    if rank == 1:
        raise ValueError("the rank's own words")
    return rank


def test_a_failing_function_fails_with_the_ranks_traceback():
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fails, 2, timeout=TIMEOUT_S, shared=True)
    text = str(failed.value)
    assert text.startswith("rank 1 failed:\n") and "ValueError: the rank's own words" in text
    assert "in _fails" in text, text
