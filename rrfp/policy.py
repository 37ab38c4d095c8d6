"""The arbitration policy: one pure function, called by the simulator and the runtime.

``choose`` never blocks and never touches torch. Given what is ready now, it
returns the task to run, or None to wait for the next arrival or completion.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Container, Iterable, Mapping, Sequence

from .tasks import Kind, Task


class Executor(str, enum.Enum):
    READY = "ready"  # best-ranked ready task
    FIXED = "fixed"  # next task in hint order, waiting for it

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class StageState:
    """What the policy needs to know of a stage besides its ready set."""

    inflight: int = 0  # microbatches with F started and last backward not done
    inflight_bytes: int = 0
    next_index: int = 0  # the fixed executor's position in the hint order
    peak_inflight: int = 0

    def admit(self, size: int = 0) -> None:
        self.inflight += 1
        self.inflight_bytes += size
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def release(self, size: int = 0) -> None:
        self.inflight -= 1
        self.inflight_bytes -= size


@dataclass(frozen=True, slots=True)
class Limit:
    """A stage's resolved budget. A microbatch larger than ``bytes`` runs alone."""

    count: int | None = None
    bytes: int | None = None

    def admits(self, state: StageState, size: int) -> bool:
        if self.count is not None and state.inflight >= self.count:
            return False
        if self.bytes is not None and state.inflight > 0 and state.inflight_bytes + size > self.bytes:
            return False
        return True


class ReadyTasks(Container[Task], Iterable[Task]):
    """Protocol of ``ready``: membership of every dependency-ready task, and
    iteration that may yield only the best-ranked ready task of each kind."""


def choose(
    executor: Executor,
    ready: ReadyTasks,
    rank: Mapping[Task, int],
    order: Sequence[Task],
    state: StageState,
    limit: Limit,
    size_of: Callable[[int], int] | None = None,
) -> Task | None:
    """Pick the task a stage runs next.

    ``ready`` holds tasks whose dependencies are met; the budget is applied
    here. ``ready`` runs the best-ranked one the budget allows. Forwards are
    admitted in rank order: if the best-ranked F does not fit, no F runs, which
    keeps large microbatches from starving. ``fixed`` runs ``order[next_index]``
    when it is ready and ignores the budget: its memory is what its order implies.
    """
    if executor is Executor.FIXED:
        if state.next_index >= len(order):
            return None
        nxt = order[state.next_index]
        return nxt if nxt in ready else None
    best: Task | None = None
    best_rank = 0
    best_f: Task | None = None
    best_f_rank = 0
    for task in ready:
        r = rank[task]
        if task.kind is Kind.F:
            if best_f is None or r < best_f_rank:
                best_f, best_f_rank = task, r
        elif best is None or r < best_rank:
            best, best_rank = task, r
    if best_f is not None and (best is None or best_f_rank < best_rank):
        size = size_of(best_f.mb) if size_of is not None else 0
        if limit.admits(state, size):
            return best_f
    return best
