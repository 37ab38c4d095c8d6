"""The environment and command lines of the processes tests start: one place that says what a
child inherits, so each test's process sees what a user's would and none of the test runner's.

A child inherits the test process's environment without a launcher's variables (torchrun's,
an outer job's RANK or MASTER_PORT) and without rrfp's own settings (RRFP_LOG, RRFP_FAULT...):
a test that wants one passes it. It runs with one intra-op thread (the ranks of a test share
two cores with the test runner) and unbuffered output (tests read what it prints as it goes).
"""

from __future__ import annotations

import os
import sys

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
DROPPED_PREFIXES = ("TORCHELASTIC", "RRFP_")


def rank_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank of a one-node job whose store is at 127.0.0.1:``port``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


def child_env(rank: int | None = None, world: int = 1, port: int = 9, **extra: str) -> dict:
    """The environment of a process a test starts: the test's, less launcher and rrfp variables,
    with one thread and unbuffered output; a rank of a ``world`` job at ``port`` if ``rank`` is
    given (port 9: a rendezvous nobody serves); then ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and not k.startswith(DROPPED_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if rank is not None:
        env.update(rank_vars(rank, world, port))
    env.update(extra)
    return env


def rrfp_argv(*args: str) -> list[str]:
    """``python -m rrfp ARGS`` with this interpreter."""
    return [sys.executable, "-m", "rrfp", *args]


# ``torchrun --standalone``, with this interpreter: a one-node job with a store of its own
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
