"""The test tiers, by what a test does, marked in its file:

- ``unit`` (no mark needed): runs in the test process and starts no other.
- ``multirank``: starts gloo ranks from the test (tests/harness/distributed.py).
- ``e2e``: starts the CLI, torchrun or another interpreter as a subprocess.
- ``long`` (beside one of the two above): waits out a fault by design, a rank killed, stopped,
  busy or slow, and the timeout that names it or the run that finishes despite it.

`make test-quick` runs ``-m unit``; `make test` runs every tier but ``long``, which
`make test-long` runs (CI runs both); the torchtitan tests run under `make test-titan`. A test
without a process mark that starts a process fails at once with a line saying to mark it, so the
quick tier stays in-process without anyone reading sources to keep it so. ``slow`` is kept as the
name of both process tiers together.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
from unittest import mock

import pytest

PROCESS_MARKS = ("multirank", "e2e")
# The torchtitan tests need the titan extra, which `make` does not install (its datasets pins a
# huggingface-hub that transformers 5, the hf extra, refuses): `make test-titan` installs it in a
# venv of its own and sets RRFP_TITAN_TESTS=1, and only then are they collected.
collect_ignore_glob = [] if os.environ.get("RRFP_TITAN_TESTS") == "1" else ["titan/*"]
# each test's CPU seconds, with RRFP_TEST_CPU=DIR (`make test-cpu`)
pytest_plugins = ["harness.cpu_times"]


def pytest_configure(config):
    for line in (
        "unit: runs in the test process, starts no other (the default; `make test-quick`)",
        "multirank: starts gloo ranks from the test",
        "e2e: starts the CLI, torchrun or another interpreter as a subprocess",
        "slow: a test of a process tier (multirank or e2e), added to them by conftest",
        "long: waits out a fault and the timeout that names it; `make test-long` runs it",
    ):
        config.addinivalue_line("markers", line)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if session.config.pluginmanager.hasplugin("dsession"):
        # pytest-xdist's controller, which runs no test: it starts the one forkserver its workers
        # fork their ranks from, before it starts them. Not when each test's CPU is recorded:
        # that counts the processes below a test's own, and the shared server's are not.
        from harness import cpu_times
        from harness.distributed import start_session_forkserver

        if not os.environ.get(cpu_times.ENV):
            start_session_forkserver()
        return
    # One intra-op thread in the test process: with two, OpenMP's spinning workers fight the
    # ranks and other jobs for the 2 cores (the spawned ranks already run with 1).
    import torch

    torch.set_num_threads(1)


def _starts_processes(item) -> bool:
    return any(item.get_closest_marker(m) for m in PROCESS_MARKS)


def _tier(item) -> int:
    """0 for e2e, 1 for multirank, 2 for unit: the order the files are handed out in."""
    if item.get_closest_marker("e2e"):
        return 0
    return 1 if item.get_closest_marker("multirank") else 2


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
        else:
            item.add_marker(pytest.mark.unit)
    # `make test` hands whole files to its workers in collection order (--dist loadfile
    # --no-loadscope-reorder): the files that start CLIs and torchrun jobs, the longest, go
    # first, the in-process ones last, so the workers end together instead of one waiting on a
    # long file that was handed out last.
    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 2), _tier(item))
    items.sort(key=lambda item: first[item.path])  # stable: a file's tests stay in their order


class UnmarkedProcessStart(AssertionError):
    pass


def _refuse(item, what: str):
    def refuse(*args, **kwargs):
        raise UnmarkedProcessStart(
            f"{item.nodeid} starts a process ({what}) but is not marked: mark it "
            "pytest.mark.multirank (gloo ranks) or pytest.mark.e2e (CLI, torchrun, subprocess)"
        )

    return refuse


@contextlib.contextmanager
def _no_process_starts(item):
    """Every way a test starts a process (subprocess, multiprocessing and so
    torch.multiprocessing, fork, spawn, system) raises for ``item``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(subprocess.Popen, "_execute_child", _refuse(item, "subprocess"))
        )
        stack.enter_context(
            mock.patch.object(
                multiprocessing.process.BaseProcess, "start", _refuse(item, "multiprocessing")
            )
        )
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                stack.enter_context(mock.patch.object(os, name, _refuse(item, f"os.{name}")))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The unit tier starts no process, in the test or in a fixture it sets up: one that does
    fails loudly instead of slowing the quick tier."""
    if _starts_processes(item):
        yield
        return
    with _no_process_starts(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if _starts_processes(item):
        yield
        return
    with _no_process_starts(item):
        yield


@pytest.fixture(autouse=True)
def _torch_default_dtype():
    """Each test starts with torch's default dtype as the last one found it: a float64 reference
    computed in the test process sets it, and a later test in the same worker would otherwise
    build its 'float32' reference in float64 (different initial weights than its ranks draw)."""
    import torch

    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
