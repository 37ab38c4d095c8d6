"""One pipeline rank's arbiter over its V stages: which of their ready tasks runs next.

A rank runs one task at a time, whatever stage it belongs to, so with virtual
stages the choice is among the ready tasks of all the rank's stages. Each
stage keeps its own ``StageTracker`` (the readiness rules, unchanged, over
S x V global stages); this adds what is the rank's: one running task, one
priority over (stage, task) pairs, one fixed order, and one budget over the
rank's memory. The one policy function (``rrfp.core.policy.choose``) decides.

With one stage per rank (V = 1) this is that stage's tracker and the stage budget: every
caller drives a ``RankTracker`` whatever V is.

Budget (docs/design.md, "Virtual stages"): memory is counted in local-stage
microbatches (a local stage holds 1/V of a microbatch's activations on the
rank). Forwards of later local stages have room reserved, as in structured
buffer pools: an F on the rank's local stage c is admitted only if V-1-c units
stay free after it. A microbatch already inside the rank can therefore always
move on to its next local stage, so a tight budget never deadlocks; with V = 1
nothing is reserved and the rule is the stage budget.

Lead (docs/design.md, on how far a local stage may run ahead): under ready dispatch
local stage c's forwards may run at most ``layout.leads(rank)[c]`` ahead of
local stage c + 1's, the stages a microbatch crosses between the two. Every
further one would fill a wait that a message in flight was about to end, and a
task once started is not preempted, so with latency on the links running ahead
loses time that the rank's own order keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from rrfp.core.budget import InFlight, Limit
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch, Priorities, ReadyTasks, choose
from rrfp.core.tasks import Kind, Task, last_backward
from rrfp.core.tracker import StageSpec, StageTracker, TrackerError


class StageTask(NamedTuple):
    """A task of one global stage: what a rank with several stages ranks, runs and reports."""

    stage: int
    task: Task

    @property
    def kind(self) -> Kind:
        return self.task.kind

    @property
    def mb(self) -> int:
        return self.task.mb

    def __str__(self) -> str:
        return f"{self.task}@{self.stage}"


@dataclass(frozen=True)
class RankSpec:
    """What a rank knows before an iteration starts: its stages' rules, the rank's policy inputs."""

    layout: VirtualLayout
    rank: int
    n_microbatches: int
    split: bool
    dispatch: Dispatch
    priority: Mapping[tuple[int, Task], int]  # over (stage, task) pairs; lower runs first
    order: Sequence[tuple[int, Task]]  # what fixed dispatch follows, over the rank's stages
    limit: Limit  # in local-stage microbatches (and bytes), over the whole rank

    @property
    def stages(self) -> tuple[int, ...]:
        return self.layout.stages_of(self.rank)

    def stage_spec(self, stage: int) -> StageSpec:
        """Stage ``stage``'s own spec: the rank's priority and order restricted to it."""
        prio = {t: p for (s, t), p in self.priority.items() if s == stage}
        order = tuple(t for s, t in self.order if s == stage)
        return StageSpec(
            self.layout.num_stages,
            stage,
            self.n_microbatches,
            self.split,
            self.dispatch,
            prio,
            order,
            self.limit,
        )

    @property
    def num_tasks(self) -> int:
        return self.layout.virtual * self.n_microbatches * (3 if self.split else 2)


class _RankReady:
    """The rank's ready tasks as ``choose`` reads them: each stage's best of each kind."""

    __slots__ = ("_trackers",)

    def __init__(self, trackers: dict[int, StageTracker]) -> None:
        self._trackers = trackers

    def __iter__(self) -> Iterator[StageTask]:
        for s, tr in self._trackers.items():
            for t in tr.ready:
                yield StageTask(s, t)

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, tuple):
            return False
        tr = self._trackers.get(item[0])
        return tr is not None and item[1] in tr.ready


class _RankPriority:
    """``priority[(stage, task)]`` read from per-stage tables (hot in ``choose``)."""

    __slots__ = ("_tables",)

    def __init__(self, tables: dict[int, list[list[int]]]) -> None:
        self._tables = tables

    def __getitem__(self, item: StageTask) -> int:
        task = item[1]
        return self._tables[item[0]][task.kind][task.mb]


class RankTracker:
    """One rank, one iteration: its V stages' trackers, one running task, one budget.

    ``size_of(mb)`` gives the activation bytes of microbatch ``mb`` at one local stage (for
    byte budgets); the size a local stage admitted is the size it releases.
    """

    def __init__(self, spec: RankSpec, size_of: Callable[[int], int] | None = None) -> None:
        self.spec = spec
        self._size_of = size_of
        self.stages = spec.stages
        self.trackers: dict[int, StageTracker] = {
            s: StageTracker(spec.stage_spec(s), size_of) for s in self.stages
        }
        self._local = {s: c for c, s in enumerate(self.stages)}  # global stage -> local stage
        # ``choose`` reads (stage, task) items as it reads a stage's tasks: casts, not copies
        self._ready = cast(ReadyTasks[StageTask], _RankReady(self.trackers))
        # each stage's tracker holds the rank's priority restricted to it (RankSpec.stage_spec)
        self._priority = cast(
            Priorities[StageTask],
            _RankPriority({s: tr.priority_table for s, tr in self.trackers.items()}),
        )
        self._items = tuple(StageTask(s, t) for s, t in spec.order)
        self._order: Sequence[StageTask] = self._items
        self._last = last_backward(spec.split)
        self._sizes: dict[tuple[int, int], int] = {}
        self.held = InFlight()  # over the rank, in local-stage microbatches
        self._leads = spec.layout.leads(spec.rank)
        self.forwards = [0] * spec.layout.virtual  # forwards started, per local stage
        self.position = 0
        self.finished = 0
        self.running: StageTask | None = None
        # one task run beside the running one while that one waits at a collective (an EP task
        # at its all-to-all): the lane's device is free meanwhile
        self.beside: StageTask | None = None
        self.arrivals = 0

    # -- events --------------------------------------------------------------

    def arrive(self, stage: int, kind: Kind, mb: int) -> None:
        """The input of F(mb) (kind F) or the gradient for B(mb) (kind B) reached ``stage``."""
        self._tracker(stage).arrive(kind, mb)
        self.arrivals += 1

    def next(self, among: Iterable[StageTask] | None = None) -> StageTask | None:
        """The (stage, task) to run now, or None. ``among`` replaces the rank's ready set (TP
        agreement passes the pairs ready on every TP rank)."""
        if self.running is not None:
            return None
        spec = self.spec
        return choose(
            spec.dispatch,
            self._ready if among is None else cast(ReadyTasks[StageTask], among),
            self._priority,
            self._order,
            self.position,
            self.held,
            spec.limit,
            None,
            self._admits,
        )

    def next_beside(self, among: Iterable[StageTask]) -> StageTask | None:
        """The task of ``among`` to run beside the running one, or None: none runs, or one runs
        beside it already. The same policy and budget as ``next``."""
        if self.running is None or self.beside is not None:
            return None
        spec = self.spec
        return choose(
            spec.dispatch,
            cast(ReadyTasks[StageTask], among),
            self._priority,
            self._order,
            self.position,
            self.held,
            spec.limit,
            None,
            self._admits,
        )

    def start(self, stage: int, task: Task) -> None:
        if self.running is not None:
            raise TrackerError(
                f"rank {self.spec.rank}: {task} of stage {stage} started while "
                f"{self.running.task} of stage {self.running.stage} runs"
            )
        self._tracker(stage).start(task)
        self.running = StageTask(stage, task)
        self._started(stage, task)

    def start_beside(self, stage: int, task: Task) -> None:
        """``task`` of ``stage`` runs beside the running task, which waits at a collective
        meanwhile (``next_beside`` picked it); it finishes with ``finish`` like any task."""
        if self.running is None or self.beside is not None:
            raise TrackerError(
                f"rank {self.spec.rank}: {task} of stage {stage} started beside "
                f"{self.running if self.beside is None else self.beside}"
            )
        self._tracker(stage).start_beside(task)
        self.beside = StageTask(stage, task)
        self._started(stage, task)

    def _started(self, stage: int, task: Task) -> None:
        self.position += 1
        if task.kind is Kind.F:
            self.forwards[self._local[stage]] += 1
            size = self._size_of(task.mb) if self._size_of is not None else 0
            self._sizes[(stage, task.mb)] = size
            self.held.admit(size)

    def finish(self, stage: int, task: Task) -> int | None:
        """``task`` of ``stage`` is done. Returns the global stage its output goes to, or None;
        the caller delivers it (``arrive`` at once when this rank holds it, else a message)."""
        item = StageTask(stage, task)
        if item == self.beside:
            self.beside = None
        elif self.running != item:
            raise TrackerError(
                f"rank {self.spec.rank}: {task} of stage {stage} finished but "
                f"{'nothing' if self.running is None else self.running} runs"
            )
        else:
            self.running = None
        dest = self._tracker(stage).finish(task)
        self.finished += 1
        if task.kind is self._last:
            self.held.release(self._sizes.pop((stage, task.mb)))
        return dest

    def _admits(self, item: StageTask) -> bool:
        """The rank budget for an F of local stage c: its lead over local stage c + 1 stays within
        the layout's, and V-1-c units stay free for later local stages (by count and, at this
        microbatch's size, by bytes); a local stage with nothing held at it or later always fits
        by bytes, as a large microbatch runs alone at V = 1."""
        limit, held = self.spec.limit, self.held
        c = self._local[item[0]]
        reserve = self.spec.layout.virtual - 1 - c
        if reserve and self.forwards[c] - self.forwards[c + 1] >= self._leads[c]:
            return False
        if limit.count is not None and held.count + reserve >= limit.count:
            return False
        if limit.bytes is not None and any(self.trackers[s].held.count for s in self.stages[c:]):
            size = self._size_of(item[1].mb) if self._size_of is not None else 0
            if held.bytes + size * (1 + reserve) > limit.bytes:
                return False
        return True

    def _tracker(self, stage: int) -> StageTracker:
        tr = self.trackers.get(stage)
        if tr is None:
            raise TrackerError(
                f"rank {self.spec.rank} holds stages {', '.join(map(str, self.stages))}, "
                f"not stage {stage}"
            )
        return tr

    # -- questions -----------------------------------------------------------

    def holds(self, stage: int) -> bool:
        """Whether ``stage`` is one of this rank's (a message to it is a local turn)."""
        return stage in self.trackers

    @property
    def done(self) -> bool:
        return all(tr.done for tr in self.trackers.values())

    @property
    def peak_microbatches(self) -> float:
        """The most memory held at once, in microbatches of the rank's whole model (1F1B's unit)."""
        return self.held.peak / self.spec.layout.virtual

    def ready_tasks(self) -> set[StageTask]:
        """Every (stage, task) whose dependencies are met (before the budget applies)."""
        return {StageTask(s, t) for s, tr in self.trackers.items() for t in tr.ready_tasks()}

    def unlocked_by(self, stage: int, task: Task) -> set[StageTask]:
        """What finishing ``task`` of ``stage`` makes ready there, given the arrivals so far."""
        return {StageTask(stage, t) for t in self._tracker(stage).unlocked_by(task)}

    def outstanding(self, kind: Kind) -> int:
        return sum(tr.outstanding(kind) for tr in self.trackers.values())

    def blocked(self) -> str:
        """Why ``next()`` has nothing to run, naming stages ("waits for F3@5, ...")."""
        spec = self.spec
        if self.done:
            return "has nothing left to run"
        if self.running is not None:
            return f"is running {self.running}"
        if spec.dispatch is Dispatch.FIXED:
            nxt = self._items[self.position]
            why = self.trackers[nxt.stage].blocked()
            return f"waits for {nxt} in its fixed order: stage {nxt.stage} {why}"
        ready = sorted(self.ready_tasks())
        held = (
            f"{self.held.count} local-stage microbatch(es) in flight over stages "
            f"{', '.join(map(str, self.stages))} (limit {spec.limit.count or spec.limit.bytes})"
        )
        if ready:
            leads = ", ".join(
                f"local stage {c} ran {self.forwards[c] - self.forwards[c + 1]} forward(s) ahead "
                f"of local stage {c + 1} (at most {lead})"
                for c, lead in enumerate(self._leads)
            )
            return (
                f"has its budget full: {held}{'; ' + leads if leads else ''}; only "
                f"{', '.join(map(str, ready[:4]))} ready"
            )
        waits = "; ".join(
            f"stage {s}: {tr.outstanding(Kind.F)} input(s) and {tr.outstanding(Kind.B)} "
            "gradient(s) not arrived"
            for s, tr in self.trackers.items()
            if not tr.done
        )
        return f"has nothing ready ({waits}); {held}"
