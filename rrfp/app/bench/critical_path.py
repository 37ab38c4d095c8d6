"""What lies on an iteration's critical path on real compute: its tasks, and the gaps between them.

An iteration ends with its last task. That task started after whichever came last of two events:
the task before it on its rank ended, or the task whose output it consumes ended (F(s) consumes
F(s-1); B(s) consumes B(s+1); W(s) follows B(s) on its own rank). Walking back from the last task
along whichever came last gives the chain that decided the iteration's time. The gap before each
of its tasks is time the iteration spent on neither compute: after a task on the same rank (the
runtime's hand-off, its decision, the lane starting the task) or after a task on another rank (the
message: posting, transport, delivery, then the same). Compute is each task's own (``task_times``:
the lane's work for rrfp; for torch's schedules, the call, so torch's host time inside a call counts
as task time and its gaps are a lower bound on its host time).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rrfp.app.bench.analysis import is_task, rank_of, stage_of, task_times
from rrfp.observe.trace import Span


@dataclass(frozen=True)
class CriticalPath:
    """One contender's critical path (seconds and counts, medians over iterations)."""

    contender: str
    tasks_s: float  # the compute of the tasks on it
    rank_gaps_s: float  # gaps after a task on the same rank
    rank_hops: float
    message_gaps_s: float  # gaps after a task on another rank: a message
    message_hops: float
    iteration_s: float  # from the iteration's first task start to its last task's end

    def as_dict(self) -> dict:
        return dict(vars(self))


def iteration_path(tasks: list[Span]) -> tuple[float, float, int, float, int, float]:
    """(compute, same-rank gaps, their count, message gaps, their count, first start to last end)
    of one iteration's critical path through ``tasks`` (that iteration's F, B and W spans)."""
    by_task = {(stage_of(sp), sp.name): sp for sp in tasks}
    on_rank: dict[int, list[Span]] = {}
    for sp in sorted(tasks, key=lambda sp: task_times(sp)[0]):
        on_rank.setdefault(rank_of(sp), []).append(sp)
    position = {id(sp): i for row in on_rank.values() for i, sp in enumerate(row)}

    def producer(sp: Span) -> Span | None:
        kind, stage = sp.name[0], stage_of(sp)
        source = {"F": (stage - 1, "F"), "B": (stage + 1, "B"), "W": (stage, "B")}[kind]
        return by_task.get((source[0], source[1] + sp.name[1:]))

    compute = rank_gaps = message_gaps = 0.0
    rank_hops = message_hops = 0
    task = max(tasks, key=lambda sp: task_times(sp)[1])
    seen: set[int] = set()
    while id(task) not in seen:
        seen.add(id(task))
        start, end = task_times(task)
        compute += end - start
        row, i = on_rank[rank_of(task)], position[id(task)]
        before = [sp for sp in (row[i - 1] if i else None, producer(task)) if sp is not None]
        if not before:
            break
        came_last = max(before, key=lambda sp: task_times(sp)[1])
        gap = max(0.0, start - task_times(came_last)[1])
        if rank_of(came_last) == rank_of(task):
            rank_gaps, rank_hops = rank_gaps + gap, rank_hops + 1
        else:
            message_gaps, message_hops = message_gaps + gap, message_hops + 1
        task = came_last
    window = max(task_times(sp)[1] for sp in tasks) - min(task_times(sp)[0] for sp in tasks)
    return compute, rank_gaps, rank_hops, message_gaps, message_hops, window


def critical_path(name: str, spans: list[Span]) -> CriticalPath | None:
    """``name``'s critical path, medians over its iterations; None when it has no task spans."""
    iterations: dict[int, list[Span]] = {}
    for sp in spans:
        if sp.process == name and is_task(sp):
            iterations.setdefault(sp.args.get("iteration", 0), []).append(sp)
    if not iterations:
        return None
    paths = [iteration_path(tasks) for tasks in iterations.values()]
    median = [statistics.median(p[k] for p in paths) for k in range(6)]
    return CriticalPath(name, *median)
