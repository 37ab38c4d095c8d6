"""A task beside the running one (the lane's second thread, at an EP task's all-to-all): the
tracker holds both, one beside at a time, only while a task runs; the task beside releases its
budget when it finishes, like any task, and may outlast the running one."""

from __future__ import annotations

import pytest

from rrfp.core.budget import Budget
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.rank_tracker import RankTracker, StageTask
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import TrackerError

M = 3


def _last_stage() -> RankTracker:
    """Stage 1 of 2, split backward, ready BFW, a budget of 2 microbatches."""
    spec = resolve("bfw").rank_spec(VirtualLayout(2), 1, M, True, Dispatch.READY, Budget.parse(2))
    return RankTracker(spec)


def _run(tr: RankTracker, stage: int, task: Task) -> None:
    tr.start(stage, task)
    tr.finish(stage, task)


def test_a_w_beside_a_forward_holds_its_microbatch_until_it_finishes():
    tr = _last_stage()
    for mb in range(2):
        tr.arrive(1, Kind.F, mb)
        _run(tr, 1, Task(Kind.F, mb))
    _run(tr, 1, Task(Kind.B, 0))
    assert tr.held.count == 2  # B does not release under a split backward: W does
    tr.arrive(1, Kind.F, 2)
    assert tr.next() == StageTask(1, Task(Kind.B, 1))
    tr.start(1, Task(Kind.B, 1))  # the EP task, at its all-to-all
    assert tr.next() is None
    w = tr.next_beside([StageTask(1, Task(Kind.W, 0))])
    assert w == StageTask(1, Task(Kind.W, 0))
    tr.start_beside(*w)
    assert tr.next_beside([StageTask(1, Task(Kind.W, 0))]) is None  # one beside at a time
    with pytest.raises(TrackerError, match="started beside"):
        tr.start_beside(1, Task(Kind.W, 1))
    tr.finish(1, Task(Kind.B, 1))  # the running task ends first
    assert tr.held.count == 2 and tr.beside == w
    # the budget is still full while W runs: F2 waits for it
    assert tr.next() == StageTask(1, Task(Kind.W, 1))
    tr.finish(*w)
    assert tr.held.count == 1 and tr.beside is None
    assert tr.next(among=[StageTask(1, Task(Kind.F, 2))]) == StageTask(1, Task(Kind.F, 2))


def test_nothing_runs_beside_when_nothing_runs():
    tr = _last_stage()
    tr.arrive(1, Kind.F, 0)
    _run(tr, 1, Task(Kind.F, 0))
    _run(tr, 1, Task(Kind.B, 0))
    assert tr.next_beside([StageTask(1, Task(Kind.W, 0))]) is None
    with pytest.raises(TrackerError, match="started beside"):
        tr.start_beside(1, Task(Kind.W, 0))
