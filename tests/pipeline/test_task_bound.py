"""A task's own bound (rrfp/pipeline/task_bound.py): the floor, 3 x it before a task of the kind has
finished, 10 x the longest of the kind above it; a task past it is named, one of its own
TimeoutError is not."""

from __future__ import annotations

import asyncio

import pytest

from rrfp.core.errors import TaskOverrun
from rrfp.core.tasks import Kind, Task
from rrfp.pipeline.task_bound import FACTOR, FIRST, TaskBound
from rrfp.pipeline.timeouts import Timeouts

pytestmark = pytest.mark.unit


def test_the_bound_is_the_floor_then_ten_times_the_longest_of_the_kind():
    bound = TaskBound(2.0)
    f0, b0 = Task(Kind.F, 0), Task(Kind.B, 0)
    assert bound.bound(0, f0)[0] == FIRST * 2.0  # nothing measured yet
    bound.measured(0, f0, 0.1)
    assert bound.bound(0, f0) == (2.0, "timeouts.task_s")  # 10 x 0.1 is below the floor
    bound.measured(0, f0, 0.5)
    bound.measured(0, f0, 0.3)
    assert bound.bound(0, f0)[0] == pytest.approx(FACTOR * 0.5)
    assert bound.bound(0, b0)[0] == FIRST * 2.0  # another kind: its own measurements
    assert bound.bound(1, f0)[0] == FIRST * 2.0  # another stage too


def test_a_task_past_its_bound_is_named_and_its_own_timeout_error_passes():
    async def main():
        bound = TaskBound(0.05)
        bound.measured(1, Task(Kind.F, 0), 0.001)
        with pytest.raises(TaskOverrun, match=r"rank 3 stage 1: iteration 2: task F1 .* has run"):
            async with bound.running("rank 3 stage 1", 1, Task(Kind.F, 1), 2):
                await asyncio.sleep(10)
        with pytest.raises(TimeoutError):
            async with bound.running("rank 3 stage 1", 1, Task(Kind.F, 2), 2):
                raise TimeoutError("the model's own")
        async with bound.running("rank 3 stage 1", 1, Task(Kind.B, 0), 2):
            await asyncio.sleep(0.01)
        assert bound.longest[1, "B"] >= 0.01

    asyncio.run(main())


def test_task_s_follows_progress_s_unless_set():
    assert Timeouts.derive(3).task_s == 60
    waits = Timeouts.derive(2, progress_s=6)
    assert waits.task_s == 12
    assert waits.said("task_s") == "timeouts.task_s = 12 s, 2 x timeouts.progress_s"
    assert Timeouts.derive(2, task_s=5).said("task_s") == "timeouts.task_s = 5 s"
