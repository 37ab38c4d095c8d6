"""The arbitration policy: one pure function, asked by every ``StageTracker``.

``choose`` never blocks and never touches torch. Given what is ready now, it
returns the task to run, or None to wait for the next arrival or completion.
The simulator, the runtime and the nominal orders all reach it through the
tracker, so there is one policy and one set of readiness rules.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar, cast

from rrfp.core.budget import InFlight, Limit
from rrfp.core.tasks import Kind, Task


class Dispatch(enum.StrEnum):
    """How a stage picks its next task from the hint."""

    READY = "ready"  # best-priority ready task
    FIXED = "fixed"  # next task in hint order, waiting for it

    @classmethod
    def parse(cls, spec: str | Dispatch) -> Dispatch:
        try:
            return cls(spec)
        except ValueError:
            raise ValueError(f"unknown dispatch mode {spec!r} (choose from ready, fixed)") from None


DEFAULT_DISPATCH = Dispatch.READY  # every default dispatch mode


class Schedulable(Protocol):
    """What ``choose`` reads of an item: a ``Task``, or a rank's ``StageTask``."""

    @property
    def kind(self) -> Kind: ...

    @property
    def mb(self) -> int: ...


class StagedTask(Schedulable, Protocol):
    """An item of a rank with several stages: it also names its global stage."""

    @property
    def stage(self) -> int: ...


T = TypeVar("T", bound=Schedulable)
T_contra = TypeVar("T_contra", bound=Schedulable, contravariant=True)


class ReadyTasks(Protocol[T]):
    """Protocol of ``ready``: membership of every dependency-ready task, and
    iteration that may yield only the best-priority ready task of each kind."""

    def __contains__(self, item: T, /) -> bool: ...

    def __iter__(self) -> Iterator[T]: ...


class Priorities(Protocol[T_contra]):
    """Protocol of ``priority``: a task's rank (lower runs first), read by subscript."""

    def __getitem__(self, item: T_contra, /) -> int: ...


def choose(
    dispatch: Dispatch,
    ready: ReadyTasks[T],
    priority: Priorities[T],
    order: Sequence[T],
    position: int,
    held: InFlight,
    limit: Limit,
    size_of: Callable[[int], int] | None = None,
    admit: Callable[[T], bool] | None = None,
) -> T | None:
    """Pick the task a stage (or a rank's stages) runs next (lower priority value runs first).

    ``ready`` holds tasks whose dependencies are met; the budget is applied
    here. ``READY`` runs the best task the budget allows. Forwards are
    admitted in priority order: if the best F does not fit, no F runs, which
    keeps large microbatches from starving. ``FIXED`` runs ``order[position]``
    when it is ready and ignores the budget: its memory is what its order implies.

    A rank with several stages (rrfp.core.rank_tracker) passes items with
    ``stage``, ``kind`` and ``mb`` and its own ``admit`` (which reserves room
    for later stages' forwards, see docs/virtual-stages.md); then an F the budget
    refuses blocks the Fs ranked below it on the same or earlier stages only,
    so a microbatch already inside the rank can always move on.
    """
    if dispatch is Dispatch.FIXED:
        if position >= len(order):
            return None
        nxt = order[position]
        return nxt if nxt in ready else None
    best: T | None = None
    best_p = 0
    best_f: T | None = None
    best_f_p = 0
    # the other stages' best forwards (a rank of several stages)
    more_f: list[tuple[int, T]] | None = None
    for task in ready:
        p = priority[task]
        if task.kind is Kind.F:
            if best_f is None:
                best_f, best_f_p = task, p
                continue
            if more_f is None:
                more_f = []
            if p < best_f_p:
                more_f.append((best_f_p, best_f))
                best_f, best_f_p = task, p
            else:
                more_f.append((p, task))
        elif best is None or p < best_p:
            best, best_p = task, p
    if best_f is None or (best is not None and best_f_p >= best_p):
        return best
    if admit is None:
        size = size_of(best_f.mb) if size_of is not None else 0
        return best_f if limit.admits(held, size) else best
    if admit(best_f):
        return best_f
    if more_f is not None:
        # only a rank of several stages passes ``admit``, and its items carry their stage
        refused = cast(StagedTask, best_f).stage
        for p, f in sorted(more_f, key=_first):
            if best is not None and p >= best_p:
                break
            stage = cast(StagedTask, f).stage
            if stage > refused and admit(f):
                return f
            refused = max(refused, stage)
    return best


def _first(pair: tuple[int, object]) -> int:
    return pair[0]


def merge_local_priorities(per_stage: dict[int, dict[Task, int]]) -> dict[tuple[int, Task], int]:
    """One rank's priority from each of its stages' (lower first): tasks by their place in their
    stage's rule, and at the same place the later stage first. For BFW: B of the oldest microbatch
    first, on the later local stage first (nearer the loss), then F the same way, then W; a rank of
    one stage keeps its stage's order."""
    ranked = sorted(((p, -s), (s, t)) for s, prio in per_stage.items() for t, p in prio.items())
    return {pair: i for i, (_, pair) in enumerate(ranked)}
