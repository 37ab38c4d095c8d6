"""Where a task becomes ready: one stage's state for one iteration, with no I/O.

The rules live here and nowhere else:

- F(m) is ready when its input arrived (stage 0: at once) and, for the ready
  dispatch, when the in-flight budget admits microbatch m;
- B(m) is ready when F(m) finished and its output gradient arrived (the last
  stage: when F(m) finished);
- W(m) is ready when B(m) finished (only with a split backward);
- m is in flight from the start of F(m) to the end of its last backward task.

The runtime's arbiter, the simulator and the nominal orders all drive a
``StageTracker`` with the same four events (``arrive``, ``next``, ``start``,
``finish``); none keeps its own copy of these rules. ``next`` asks the one
policy function (``rrfp.core.policy.choose``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from rrfp.core.budget import InFlight, Limit
from rrfp.core.policy import Dispatch, ReadyTasks, choose
from rrfp.core.tasks import Kind, Task, last_backward


class TrackerError(ValueError):
    """An event that breaks the rules: a duplicate arrival, a task that is not ready."""


@dataclass(frozen=True)
class StageSpec:
    """What a stage knows before an iteration starts; built once, used by every iteration."""

    num_stages: int
    stage: int
    n_microbatches: int
    split: bool
    dispatch: Dispatch
    priority: Mapping[Task, int]  # lower runs first (ready dispatch)
    order: Sequence[Task]  # what fixed dispatch follows
    limit: Limit

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_tasks(self) -> int:
        return self.n_microbatches * (3 if self.split else 2)


@lru_cache(maxsize=8)
def _task_table(n_microbatches: int) -> tuple[tuple[Task, ...], ...]:
    """Every task object of an iteration, shared by all stages: ``table[kind][mb]``."""
    return tuple(tuple(Task(k, m) for m in range(n_microbatches)) for k in Kind)


class _ReadySet:
    """Ready tasks as one heap per kind keyed by priority, plus membership flags.

    Iteration yields each kind's best task, which is all the policy needs;
    ``all()`` gives every ready task (for TP agreement and error messages)."""

    __slots__ = ("heaps", "flags", "tasks")

    def __init__(self, n_microbatches: int) -> None:
        self.heaps: list[list[tuple[int, int]]] = [[], [], []]
        self.flags = [bytearray(n_microbatches) for _ in range(3)]
        self.tasks = _task_table(n_microbatches)

    def add(self, kind: Kind, mb: int, priority: int) -> None:
        self.flags[kind][mb] = 1
        heapq.heappush(self.heaps[kind], (priority, mb))

    def remove(self, task: Task) -> None:
        self.flags[task.kind][task.mb] = 0
        heap = self.heaps[task.kind]
        if heap and heap[0][1] == task.mb:
            heapq.heappop(heap)  # fixed dispatch takes from anywhere: others are dropped lazily

    def __contains__(self, task: Task) -> bool:
        return bool(self.flags[task.kind][task.mb])

    def __iter__(self) -> Iterator[Task]:
        for k in range(3):
            heap, flags = self.heaps[k], self.flags[k]
            while heap and not flags[heap[0][1]]:
                heapq.heappop(heap)
            if heap:
                yield self.tasks[k][heap[0][1]]

    def all(self) -> set[Task]:
        return {self.tasks[k][m] for k in range(3) for m, f in enumerate(self.flags[k]) if f}


class StageTracker:
    """One stage, one iteration: feed it events, ask it what to run.

    ``size_of(mb)`` gives a microbatch's activation bytes, for byte budgets;
    the size a microbatch was admitted with is the size released.
    """

    def __init__(self, spec: StageSpec, size_of: Callable[[int], int] | None = None) -> None:
        self.spec = spec
        M = spec.n_microbatches
        self._size_of = size_of
        self._policy_size_of = size_of if spec.limit.bytes is not None else None
        self._prio = [[0] * M for _ in range(3)]
        for task, p in spec.priority.items():
            self._prio[task.kind][task.mb] = p
        self._ready = _ReadySet(M)
        self._policy_ready = cast(ReadyTasks[Task], self._ready)  # what ``choose`` reads
        self._arrived = [bytearray(M), bytearray(M)]  # F inputs, B gradients
        self._f_done = bytearray(M)
        self._sizes = [0] * M
        self._last = last_backward(spec.split)
        self._first_stage, self._last_stage, self._split = spec.is_first, spec.is_last, spec.split
        self._policy_args = (spec.dispatch, spec.priority, spec.order)
        self.held = InFlight()
        self.position = 0  # tasks started: fixed dispatch's place in its order
        self.finished = 0
        self.running: Task | None = None
        # a task run beside the running one while it waits at a collective (start_beside)
        self.beside: Task | None = None
        self.arrivals = 0  # grows with every arrival: lets a waiter see that something came in
        if spec.is_first:
            for m in range(M):
                self._ready.add(Kind.F, m, self._prio[Kind.F][m])

    # -- events --------------------------------------------------------------

    def arrive(self, kind: Kind, mb: int) -> None:
        """F: the input of F(mb) arrived from the previous stage. B: the
        gradient for B(mb) arrived from the next stage."""
        spec = self.spec
        if kind is Kind.W or not 0 <= mb < spec.n_microbatches:
            raise TrackerError(
                f"stage {spec.stage}: no {kind.name} arrival for microbatch {mb} "
                f"(M={spec.n_microbatches})"
            )
        if self._first_stage if kind is Kind.F else self._last_stage:
            raise TrackerError(
                f"stage {spec.stage} of {spec.num_stages} receives no {kind.name} messages"
            )
        arrived = self._arrived[kind]
        if arrived[mb]:
            raise TrackerError(
                f"stage {spec.stage}: {kind.name} message for microbatch {mb} arrived twice"
            )
        arrived[mb] = 1
        self.arrivals += 1
        if kind is Kind.F or self._f_done[mb]:
            self._ready.add(kind, mb, self._prio[kind][mb])

    def next(self, among: ReadyTasks[Task] | None = None) -> Task | None:
        """The task to run now, or None. ``among`` replaces the local ready set
        (TP agreement passes the tasks ready on every TP rank)."""
        if self.running is not None:
            return None
        dispatch, priority, order = self._policy_args
        return choose(
            dispatch,
            self._policy_ready if among is None else among,
            priority,
            order,
            self.position,
            self.held,
            self.spec.limit,
            self._policy_size_of,
        )

    def start(self, task: Task) -> None:
        if self.running is not None:
            raise TrackerError(f"stage {self.spec.stage}: {task} started while {self.running} runs")
        self._take(task)
        self.running = task

    def start_beside(self, task: Task) -> None:
        """``task`` runs beside the running task (or beside another stage's, RankTracker), which
        waits at a collective meanwhile; one at a time."""
        if self.beside is not None:
            raise TrackerError(f"stage {self.spec.stage}: {task} started beside {self.beside}")
        self._take(task)
        self.beside = task

    def _take(self, task: Task) -> None:
        if not self._ready.flags[task.kind][task.mb]:
            raise TrackerError(f"stage {self.spec.stage}: {task} started but it is not ready")
        self._ready.remove(task)
        self.position += 1
        if task.kind is Kind.F:
            size = self._size_of(task.mb) if self._size_of is not None else 0
            self._sizes[task.mb] = size
            self.held.admit(size)

    def finish(self, task: Task) -> int | None:
        """``task`` is done. Returns the stage its output goes to (F: the next
        stage, B: the previous one), or None when it sends nothing."""
        if task == self.beside:
            self.beside = None
        elif task is not self.running and task != self.running:
            raise TrackerError(f"stage {self.spec.stage}: {task} finished but {self.running} runs")
        else:
            self.running = None
        self.finished += 1
        kind, mb = task.kind, task.mb
        if kind is self._last:
            self.held.release(self._sizes[mb])
        if kind is Kind.F:
            self._f_done[mb] = 1
        nxt = self._unlocks(kind, mb)
        if nxt is not None:
            self._ready.add(nxt, mb, self._prio[nxt][mb])
        if kind is Kind.F:
            return None if self._last_stage else self.spec.stage + 1
        if kind is Kind.B:
            return None if self._first_stage else self.spec.stage - 1
        return None

    def _unlocks(self, kind: Kind, mb: int) -> Kind | None:
        """The task of ``mb`` that finishing its ``kind`` makes ready, given the arrivals so far."""
        if kind is Kind.F and (self._last_stage or self._arrived[Kind.B][mb]):
            return Kind.B
        if kind is Kind.B and self._split:
            return Kind.W
        return None

    # -- questions -----------------------------------------------------------

    @property
    def priority_table(self) -> list[list[int]]:
        """``table[kind][mb]``: each task's priority, as the policy compares them (read-only)."""
        return self._prio

    @property
    def ready(self) -> _ReadySet:
        """The ready tasks as the policy reads them: membership of all, iteration over each kind's
        best (a RankTracker merges its stages' through this)."""
        return self._ready

    @property
    def done(self) -> bool:
        return self.finished == self.spec.num_tasks

    def ready_tasks(self) -> set[Task]:
        """Every task whose dependencies are met (before the budget applies)."""
        return self._ready.all()

    def unlocked_by(self, task: Task) -> set[Task]:
        """What finishing ``task`` will make ready, given the arrivals so far."""
        nxt = self._unlocks(task.kind, task.mb)
        return set() if nxt is None else {Task(nxt, task.mb)}

    def outstanding(self, kind: Kind) -> int:
        """How many F inputs (or B gradients) have not arrived yet."""
        if kind is Kind.W or (self.spec.is_first if kind is Kind.F else self.spec.is_last):
            return 0
        return self.spec.n_microbatches - sum(self._arrived[kind])

    def blocked(self) -> str:
        """Why ``next()`` has nothing to run, as a verb phrase ("waits for F3, ...")."""
        spec = self.spec
        if self.done:
            return "has nothing left to run"
        if self.running is not None:
            return f"is running {self.running}"
        if spec.dispatch is Dispatch.FIXED:
            nxt = spec.order[self.position]
            need = {
                Kind.F: "its input",
                Kind.B: f"F{nxt.mb} and its gradient",
                Kind.W: f"B{nxt.mb}",
            }[nxt.kind]
            return f"waits for {nxt} in its fixed order, which needs {need}"
        ready = sorted(self.ready_tasks())
        limit = spec.limit.count or spec.limit.bytes
        held = f"{self.held.count} microbatch(es) in flight (limit {limit})"
        if ready:
            return f"has its budget full: {held}; only {', '.join(map(str, ready[:4]))} ready"
        return (
            f"has nothing ready: {self.outstanding(Kind.F)} input(s) and "
            f"{self.outstanding(Kind.B)} gradient(s) not arrived; {held}"
        )
