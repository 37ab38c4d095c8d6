"""The CPU seconds per test that `make test-cpu` records (tests/harness/cpu_times.py) and sums
(tools/test_cpu.py): the walk of /proc reads the right fields, a process below the test is
counted once whether it outlives the test, ends during it or is reaped, and the report adds the
rows up by tier, file and test."""

from __future__ import annotations

import importlib.util
import json
import os
import resource

from harness import ROOT
from harness.cpu_times import below_cost, descendants


def _tool():
    """tools/test_cpu.py, loaded by path: it is a tool beside the package, not part of it."""
    spec = importlib.util.spec_from_file_location("rrfp_test_cpu", ROOT / "tools" / "test_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


def test_the_walk_reads_this_process_cpu():
    """Seen from its parent, the test process's CPU in /proc is what getrusage says it spent
    (its own and its reaped children's), to the clock tick."""
    sum(i * i for i in range(300_000))  # some CPU of its own to read
    mine = [cpu for (pid, _), cpu in descendants(os.getppid()).items() if pid == os.getpid()]
    spent = sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )
    assert len(mine) == 1
    assert spent - 0.05 <= mine[0] <= spent + 0.05, (mine, spent)


def test_each_process_below_is_counted_once():
    before = {(10, 1): 5.0, (11, 1): 2.0, (12, 1): 1.0}
    after = {
        (10, 1): 7.5,  # lived through the test: its 2.5 s since
        (12, 1): 1.0,  # idle
        (12, 9): 0.25,  # a new process on a reused pid: all of it
        (13, 4): 1.0,  # new
    }
    # 11 ended and was reaped by the test process: its 2.0 s before plus 0.5 s during the test
    assert below_cost(before, after, reaped_s=2.5) == 2.5 + 0.25 + 1.0 + 0.5
    # a child started and reaped within the test: only the reaped count has it
    assert below_cost({}, {}, reaped_s=3.0) == 3.0


def test_the_report_sums_by_tier_file_and_test(tmp_path):
    rows = [
        {"test": "a.py::x", "file": "a.py", "tier": "e2e", "wall_s": 4, "self_s": 1, "below_s": 9},
        {"test": "a.py::y", "file": "a.py", "tier": "unit", "wall_s": 1, "self_s": 2, "below_s": 0},
        {"test": "b.py::z", "file": "b.py", "tier": "unit", "wall_s": 2, "self_s": 3, "below_s": 0},
    ]
    rows[2]["outcome"] = "failed"
    for worker, part in (("gw0", rows[:2]), ("gw1", rows[2:])):
        (tmp_path / f"{worker}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    read = TOOL.read_rows(tmp_path)
    assert sorted(r["test"] for r in read) == ["a.py::x", "a.py::y", "b.py::z"]
    assert TOOL.totals(read, "tier") == {"e2e": [10, 4, 1], "unit": [5, 3, 2]}
    assert list(TOOL.totals(read, "file")) == ["a.py", "b.py"]  # dearest first
    text = TOOL.report(read, top=1)
    assert "all            15.0      7.0      3" in text
    assert "a.py::x" in text and "b.py::z" not in text.split("dearest 1 tests")[1]
    assert "failed (1, their CPU-s is short): b.py::z" in text
