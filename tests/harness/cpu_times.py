"""What each test costs in CPU seconds, which the machine's load does not change (wall time it
does): opt in with ``RRFP_TEST_CPU=DIR`` and each test process appends one JSON line per test to
``DIR/<worker>.jsonl``; ``tools/test_cpu.py DIR`` (``make test-cpu``) sums them by tier, file and
test. It is how `make test`'s time bound is kept: a test that got dearer shows at the top.

A test's CPU is its process's own (setup, call and teardown, module fixtures included) plus
every process below it: the children it waited for (``RUSAGE_CHILDREN``), and those it did not,
read from /proc: forkserver children are the forkserver's to reap, so their CPU is counted as it
grows, by a walk of the test process's descendants before and after the test.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

ENV = "RRFP_TEST_CPU"
TICK = os.sysconf("SC_CLK_TCK")
OUTCOME = pytest.StashKey[str]()
WORST = {"passed": 0, "skipped": 1, "failed": 2}  # a test's outcome: the worst of its phases'


def _stats() -> dict[int, tuple[int, int, float]]:
    """Every process's (parent, start tick, CPU seconds of it and of its reaped children)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # gone since the scan
            continue
        fields = text[text.rindex(")") + 2 :].split()
        # after the name: state ppid ... utime(11) stime cutime cstime ... starttime(19)
        cpu = sum(int(f) for f in fields[11:15]) / TICK
        found[int(entry.name)] = (int(fields[1]), int(fields[19]), cpu)
    return found


def descendants(root: int) -> dict[tuple[int, int], float]:
    """{(pid, start tick): CPU seconds} of each process below ``root``, counting the children each
    has reaped (a pid and its start tick name one process even if the pid is reused)."""
    stats = _stats()
    below: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        below.setdefault(ppid, []).append(pid)
    out, todo = {}, list(below.get(root, []))
    while todo:
        pid = todo.pop()
        _, start, cpu = stats[pid]
        out[(pid, start)] = cpu
        todo.extend(below.get(pid, []))
    return out


def _rusage_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def below_cost(before: dict, after: dict, reaped_s: float) -> float:
    """CPU seconds spent below the test process between two walks: what each process still
    there spent since (all of it if new), plus ``reaped_s``, what the test process's reaped
    children spent over their lives, less the part of that a process there before had already
    spent (a process that vanished was reaped, by the test process or by one below it, whose
    count took its whole life)."""
    grown = sum(cpu - before.get(key, 0.0) for key, cpu in after.items())
    vanished = sum(cpu for key, cpu in before.items() if key not in after)
    return grown + reaped_s - vanished


def _tier(item) -> str:
    for mark in ("e2e", "multirank"):
        if item.get_closest_marker(mark):
            return mark
    return "unit"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if os.environ.get(ENV):
        item.stash[OUTCOME] = max(
            item.stash.get(OUTCOME, "passed"), report.outcome, key=WORST.__getitem__
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    where = os.environ.get(ENV)
    if not where:
        yield
        return
    me = os.getpid()
    before = descendants(me)
    self0, children0 = _rusage_s(resource.RUSAGE_SELF), _rusage_s(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    yield
    wall = time.monotonic() - t0
    self_s = _rusage_s(resource.RUSAGE_SELF) - self0
    reaped = _rusage_s(resource.RUSAGE_CHILDREN) - children0
    below = below_cost(before, descendants(me), reaped)
    row = {
        "test": item.nodeid,
        "file": item.nodeid.split("::")[0],
        "tier": _tier(item),
        "long": item.get_closest_marker("long") is not None,
        "outcome": item.stash.get(OUTCOME, "passed"),
        "wall_s": round(wall, 3),
        "self_s": round(self_s, 3),
        "below_s": round(max(below, 0.0), 3),
    }
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(out / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
