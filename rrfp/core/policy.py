"""The arbitration policy: one pure function, asked by every ``StageTracker``.

``choose`` never blocks and never touches torch. Given what is ready now, it
returns the task to run, or None to wait for the next arrival or completion.
The simulator, the runtime and the nominal orders all reach it through the
tracker, so there is one policy and one set of readiness rules.
"""
from __future__ import annotations

import enum
from typing import Callable, Container, Iterable, Mapping, Sequence

from rrfp.core.budget import InFlight, Limit
from rrfp.core.tasks import Kind, Task


class Dispatch(str, enum.Enum):
    """How a stage picks its next task from the hint."""

    READY = "ready"  # best-priority ready task
    FIXED = "fixed"  # next task in hint order, waiting for it

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, spec: "str | Dispatch") -> "Dispatch":
        try:
            return cls(spec)
        except ValueError:
            raise ValueError(f"unknown executor {spec!r} (choose from ready, fixed)") from None


class ReadyTasks(Container[Task], Iterable[Task]):
    """Protocol of ``ready``: membership of every dependency-ready task, and
    iteration that may yield only the best-priority ready task of each kind."""


def choose(
    dispatch: Dispatch,
    ready: ReadyTasks,
    priority: Mapping[Task, int],
    order: Sequence[Task],
    position: int,
    held: InFlight,
    limit: Limit,
    size_of: Callable[[int], int] | None = None,
) -> Task | None:
    """Pick the task a stage runs next (lower priority value runs first).

    ``ready`` holds tasks whose dependencies are met; the budget is applied
    here. ``READY`` runs the best task the budget allows. Forwards are
    admitted in priority order: if the best F does not fit, no F runs, which
    keeps large microbatches from starving. ``FIXED`` runs ``order[position]``
    when it is ready and ignores the budget: its memory is what its order implies.
    """
    if dispatch is Dispatch.FIXED:
        if position >= len(order):
            return None
        nxt = order[position]
        return nxt if nxt in ready else None
    best: Task | None = None
    best_p = 0
    best_f: Task | None = None
    best_f_p = 0
    for task in ready:
        p = priority[task]
        if task.kind is Kind.F:
            if best_f is None or p < best_f_p:
                best_f, best_f_p = task, p
        elif best is None or p < best_p:
            best, best_p = task, p
    if best_f is not None and (best is None or best_f_p < best_p):
        size = size_of(best_f.mb) if size_of is not None else 0
        if limit.admits(held, size):
            return best_f
    return best
