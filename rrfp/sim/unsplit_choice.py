"""Which stages of a split schedule should run their backward whole (``unsplit_stages = "auto"``).

A split backward costs a stage more compute than its unsplit one (the split's bookkeeping, and W's
inputs held through B), and pays only where a W fills a bubble. Whether it pays on a stage depends
on the whole pipeline, so the choice is simulated: each stage priced both ways from the cost
model's ``whole`` fit, the iteration planned or simulated as the run would run it on the
calibration's typical microbatch, and stages made unsplit one at a time, the one that shortens the
predicted makespan most first, while any does. Where the split costs every stage alike, no single
stage gains while the others bound the pipeline, so the search also starts from every stage
unsplit and splits them again one at a time; the better end wins. Pure: every rank makes the same
choice from the same file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes, known
from rrfp.core.hints import Hint
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim.engine import SimConfig, simulate
from rrfp.sim.planned_hint import make_plan

# a stage is left unsplit only if that shortens the predicted makespan by more than this share:
# below it the calibration's noise decides, and the split (the schedule as asked) stays
MIN_GAIN = 0.005


@dataclass(frozen=True)
class UnsplitChoice:
    stages: tuple[int, ...]  # the chosen unsplit stages, numbers from 0
    makespan: float  # predicted, in units of the average forward, with those stages unsplit
    split_makespan: float  # predicted with every stage split

    def line(self) -> str:
        """What was chosen, and why."""
        which = f"stage {', '.join(map(str, self.stages))} unsplit" if self.stages else "all split"
        return f"{which} ({self.describe()})"

    def describe(self) -> str:
        """Why these stages, for the start-up line."""
        if not self.stages:
            return f"no stage's unsplit backward shortens the predicted makespan by {MIN_GAIN:.1%}"
        return f"predicted {self.makespan / self.split_makespan:.3f}x the makespan split everywhere"


@dataclass(frozen=True)
class RunSchedule:
    """How the run orders an iteration, the setting each choice is simulated in."""

    layout: VirtualLayout
    n_microbatches: int
    hint: Hint
    dispatch: Dispatch
    budget: Budget
    variability: Variability

    def predicted_makespan(self, cost: CostModel, unsplit: Iterable[int]) -> float:
        """One iteration of typical microbatches with ``unsplit`` stages whole, as the run plans
        (a planned hint) or orders (any other) it, in units of the average forward."""
        feats = cost.typical_features()
        if feats is None:
            raise ValueError(
                "the cost model holds no typical microbatch (fitted before it was kept)"
            )
        layout, M = self.layout, self.n_microbatches
        predicted = TaskTimes(
            known(self.variability), split=True, cost=cost.run_whole(unsplit), layout=layout
        ).predicted(0, layout.num_stages, M, [feats] * M)
        if self.hint.planned:
            _, made = make_plan(
                predicted, self.budget, self.variability, True, self.dispatch, layout=layout
            )
            return made.predicted_makespan
        cfg = SimConfig(
            layout.ranks,
            M,
            self.hint,
            self.dispatch,
            self.budget,
            known(self.variability),
            split=True,
            durations=predicted,
            virtual=layout.virtual,
            placement=layout.placement,
        )
        return simulate(cfg).makespan


def choose_unsplit_stages(cost: CostModel, run: RunSchedule) -> UnsplitChoice:
    """The stages to leave unsplit: greedily from every stage split (the stage whose unsplit
    backward shortens the predicted makespan most, while one does by more than ``MIN_GAIN``) and
    from none split (the stage whose split does), the better of the two. ValueError when ``cost``
    has no whole-stage fit or typical microbatch (``rrfp calibrate`` of a split schedule writes
    both)."""
    if cost.whole is None:
        raise ValueError(
            "the cost model has no whole-stage costs to choose unsplit stages by: "
            "calibrate a split schedule again (rrfp calibrate measures both ways)"
        )

    def span(stages: frozenset[int]) -> float:
        return run.predicted_makespan(cost, stages)

    every = frozenset(range(run.layout.num_stages))
    split_span = span(frozenset())
    # from every stage split, leave unsplit the stage that gains most while one gains MIN_GAIN;
    # and from none split, split again the stage that gains most: where the split costs every
    # stage alike, leaving one stage unsplit gains nothing while the others bound the pipeline
    added = _greedy(span, frozenset(), split_span, lambda c: [c | {s} for s in sorted(every - c)])
    removed = _greedy(span, every, span(every), lambda c: [c - {s} for s in sorted(c)])
    # the better of the two; a tie within MIN_GAIN keeps fewer stages unsplit (the schedule asked)
    better = removed if removed[1] < added[1] * (1 - MIN_GAIN) else added
    chosen, best = better
    if best >= split_span * (1 - MIN_GAIN):
        chosen, best = frozenset(), split_span
    return UnsplitChoice(tuple(sorted(chosen)), best, split_span)


def _greedy(
    span: Callable[[frozenset[int]], float],
    start: frozenset[int],
    start_span: float,
    moves: Callable[[frozenset[int]], list[frozenset[int]]],
) -> tuple[frozenset[int], float]:
    """From ``start``, the move (``moves(chosen)``: the candidate sets, in stage order) that
    shortens ``span`` most, while one shortens it by more than MIN_GAIN."""
    chosen, best = start, start_span
    while True:
        tries = [(span(c), i, c) for i, c in enumerate(moves(chosen))]
        if not tries:
            return chosen, best
        got, _, c = min(tries, key=lambda t: (t[0], t[1]))
        if got >= best * (1 - MIN_GAIN):
            return chosen, best
        chosen, best = c, got
