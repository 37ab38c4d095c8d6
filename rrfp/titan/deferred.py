"""A ScheduleReady built at its first step.

torchtitan's Trainer calls the pipelining function on a model still on the meta device and only
then materialises the stages (``to_empty``, ``init_weights``), while ScheduleReady reads the
parameters when it is built (the executor, the check of parameters two stages share). So
``pipeline_ready`` hands torchtitan this instead, and the schedule is built, on every rank, at the
first ``step`` or ``eval``: every pp rank makes that call, which is what building one needs.
"""

from __future__ import annotations

from collections.abc import Callable

from rrfp.pipelining.schedule import ScheduleReady


class DeferredReady:
    """``step`` and ``eval`` as ScheduleReady's (the two torchtitan calls), on one built at the
    first of them by ``build``."""

    def __init__(self, build: Callable[[], ScheduleReady]) -> None:
        self._build = build
        self.schedule: ScheduleReady | None = None

    def _built(self) -> ScheduleReady:
        if self.schedule is None:
            self.schedule = self._build()
        return self.schedule

    def step(self, *args, **kwargs):
        return self._built().step(*args, **kwargs)

    def eval(self, *args, **kwargs):
        return self._built().eval(*args, **kwargs)

    def close(self) -> None:
        """Close the schedule if it was built (collective, as ScheduleReady.close)."""
        if self.schedule is not None:
            self.schedule.close()
