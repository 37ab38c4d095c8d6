"""Each iteration's planned hint, made one iteration ahead in a thread of its own.

The plan for iteration i+1 is made while iteration i runs (``prepare``), so
planning stays off the critical path; an iteration nobody prepared is planned
when it starts, and its wait is reported. Every rank plans the same iteration
from the same inputs (the cost model, every microbatch's features, the
preset) with a deterministic planner, so all stages and TP peers follow one
plan without exchanging it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rrfp.core.budget import Budget
from rrfp.core.durations import TaskTimes
from rrfp.core.entry_order import Plan
from rrfp.core.hints import Hint
from rrfp.core.policy import Dispatch
from rrfp.sim.planned_hint import plan_iteration


@dataclass(frozen=True)
class PlanReport:
    plan: Plan
    waited_s: float  # how long the iteration waited for it (about zero when it was made ahead)


class IterationPlanner:
    def __init__(
        self, times: TaskTimes, stages: int, n_microbatches: int, budget: Budget, dispatch: Dispatch
    ) -> None:
        self.times, self.S, self.M, self.budget, self.dispatch = (
            times,
            stages,
            n_microbatches,
            budget,
            dispatch,
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rrfp-plan")
        self._pending: dict[int, concurrent.futures.Future] = {}

    def _make(self, iteration: int, features) -> tuple[Hint, Plan]:
        return plan_iteration(
            self.times, iteration, self.S, self.M, self.budget, self.dispatch, features
        )

    def prepare(self, iteration: int, features: Sequence[dict] | None = None) -> None:
        """Start planning ``iteration`` now; it must later run with the same features."""
        if iteration not in self._pending:
            self._pending[iteration] = self._pool.submit(self._make, iteration, features)

    async def hint(
        self, iteration: int, features: Sequence[dict] | None = None
    ) -> tuple[Hint, PlanReport]:
        for old in [i for i in self._pending if i < iteration]:  # prepared but never run
            self._pending.pop(old).cancel()
        fut = self._pending.pop(iteration, None) or self._pool.submit(
            self._make, iteration, features
        )
        t0 = time.perf_counter()
        made_hint, made = await asyncio.wrap_future(fut)
        return made_hint, PlanReport(made, time.perf_counter() - t0)

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pool.shutdown(wait=False)
