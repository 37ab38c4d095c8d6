"""The quick tier: `make test-quick` runs what needs no second process.

A test is marked ``slow`` when it, a fixture it uses, or a test-module function
they call starts processes (gloo ranks, torchrun, the CLI in a subprocess).
Found by reading the source, two calls deep, so a new multi-process test lands
in the slow tier without anyone remembering to mark it.
"""

from __future__ import annotations

import inspect
import re

import pytest

SPAWNS = re.compile(
    r"\brun_ranks\(|\bsubprocess\.|\bRankProcs\b|\bRanks\(|torchrun|\.Process\(|rrfp_bench\("
)
CALLS = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def _spawns(fn, module, depth: int = 2) -> bool:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if SPAWNS.search(src):
        return True
    if depth == 0:
        return False
    for name in set(CALLS.findall(src)):
        g = getattr(module, name, None)
        if (
            inspect.isfunction(g)
            and g.__module__ == module.__name__
            and g is not fn
            and _spawns(g, module, depth - 1)
        ):
            return True
    return False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: starts processes (gloo ranks, torchrun); `make test-quick` skips it"
    )
    # One intra-op thread in the test process: with two, OpenMP's spinning workers fight the ranks and
    # other jobs for the 2 cores. tests/test_vlm.py::test_loss_falls took 24-39 s with 2 threads at
    # load 7 and 2-4 s with 1 (the spawned ranks already run with 1).
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        module = inspect.getmodule(fn)
        fixtures = [getattr(module, name, None) for name in getattr(item, "fixturenames", ())]
        if _spawns(fn, module) or any(
            f is not None and _spawns(getattr(f, "__wrapped__", f), module) for f in fixtures
        ):
            item.add_marker(pytest.mark.slow)
