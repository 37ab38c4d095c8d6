"""A bound on a task's own time, so that a task that never returns (a forward stuck in a user's
code, a collective inside it whose peers are all there but that never completes, a hung kernel)
is named instead of counting as progress for ever.

A task's duration is progress to its peers (rrfp/comm/heartbeat.py): however long a forward
takes, they wait. What tells a stuck task from a long one is what the job has measured: a task
that runs ``FACTOR`` times longer than the longest of its kind (F, B or W of the same stage)
measured so far on this rank is stuck, with ``timeouts.task_s`` as the floor, so that a task a
little slower than usual (a loaded machine, a slow peer's collective) is never blamed. Before
anything of its kind was measured (the first iteration: compilation, warm-up, the allocator
growing) the bound is ``FIRST`` times the floor.

The floor defaults to twice ``timeouts.progress_s``, above the bound of a wait at a collective
inside a task (a TP all-reduce): a rank kept there by a peer that never comes names that peer
first, and only a task that stays stuck past it names itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rrfp.core.errors import TaskOverrun
from rrfp.core.tasks import Task

FACTOR = 10.0  # a task this many times its kind's longest measured one is stuck
FIRST = 3.0  # before any measurement of its kind: this many times the floor


class TaskBound:
    """The bound on each task of this rank's stages, from the longest of its kind so far.
    ``floor_s`` as ``floor_key`` says it in a line (``timeouts.task_s = 12 s``)."""

    def __init__(self, floor_s: float, floor_key: str = "timeouts.task_s") -> None:
        self.floor_s, self.floor_key = floor_s, floor_key
        self.longest: dict[tuple[int, str], float] = {}  # (stage, kind letter) -> seconds

    def bound(self, stage: int, task: Task) -> tuple[float, str]:
        """How long ``task`` of ``stage`` may run, and why, in words."""
        longest = self.longest.get((stage, task.kind.name))
        if longest is None:
            return FIRST * self.floor_s, (
                f"{FIRST:g} x {self.floor_key}, as no {task.kind.name} task of this stage has "
                "finished yet"
            )
        if FACTOR * longest <= self.floor_s:
            return self.floor_s, self.floor_key
        return FACTOR * longest, (
            f"{FACTOR:g} x the longest {task.kind.name} task of this stage so far, "
            f"{longest:.3g} s; {self.floor_key} at least"
        )

    def measured(self, stage: int, task: Task, seconds: float) -> None:
        key = (stage, task.kind.name)
        self.longest[key] = max(self.longest.get(key, 0.0), seconds)

    @asynccontextmanager
    async def running(self, where: str, stage: int, task: Task, it: int) -> AsyncIterator[None]:
        """Bounds the awaits inside (the task on its lane); TaskOverrun names ``task`` once it
        has run past its bound. Its duration is measured when it returns."""
        limit, why = self.bound(stage, task)
        began, timer = time.monotonic(), asyncio.timeout(limit)
        try:
            async with timer:
                yield
        except TimeoutError:
            if not timer.expired():  # the task's own TimeoutError
                raise
            took = time.monotonic() - began
            raise TaskOverrun(
                f"{where}: iteration {it}: task {task} (microbatch {task.mb}) has run for "
                f"{took:.1f} s and not returned, over its bound of {limit:g} s ({why}): stuck in "
                "its compute, a collective inside it or a kernel"
            ) from None
        self.measured(stage, task, time.monotonic() - began)
