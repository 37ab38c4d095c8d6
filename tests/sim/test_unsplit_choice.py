"""schedule.unsplit_stages = "auto": each stage priced split and whole from the cost model, the
stages whose unsplit backward shortens the predicted iteration chosen, the same on every call."""

from __future__ import annotations

import pytest
from harness.synthetic_costs import constant_costs
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.sim.unsplit_choice import MIN_GAIN, RunSchedule, choose_unsplit_stages


def run_schedule(
    cost: CostModel, hint: str, budget: str = "2x", M: int = 8, dispatch=Dispatch.READY
) -> RunSchedule:
    return RunSchedule(
        VirtualLayout(cost.num_stages),
        M,
        resolve(hint),
        dispatch,
        Budget.parse(budget),
        Variability(),
    )


def choose(cost: CostModel, hint: str, budget: str = "2x", M: int = 8, dispatch=Dispatch.READY):
    return choose_unsplit_stages(cost, run_schedule(cost, hint, budget, M, dispatch))


# the last stage's split costs 20% more F and B + W than its whole, the first's nothing
LAST_PAYS = constant_costs([(1.0, 1.0, 1.0), (1.2, 1.2, 1.2)], [(1.0, 2.0), (1.0, 2.0)])


@pytest.mark.parametrize(
    "hint, budget, dispatch",
    [
        ("plan", "4", Dispatch.READY),
        ("plan", "4", Dispatch.FIXED),
        ("bfw", "2x", Dispatch.READY),
        ("zbh1", "1x", Dispatch.FIXED),
    ],
)
def test_the_stage_whose_split_costs_more_than_it_fills_runs_whole(hint, budget, dispatch):
    choice = choose(LAST_PAYS, hint, budget, dispatch=dispatch)
    assert choice.stages == (1,)
    assert choice.makespan < choice.split_makespan * (1 - MIN_GAIN)
    assert "predicted" in choice.describe() and "x the makespan split everywhere" in (
        choice.describe()
    )


def test_a_split_that_costs_nothing_stays():
    """B + W at the whole backward's cost, F the same: the split can only fill bubbles."""
    free = constant_costs([(1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)], [(1.0, 2.0)] * 3)
    for hint in ("plan", "bfw", "zbh1"):
        choice = choose(free, hint)
        assert choice.stages == (), hint
        assert choice.makespan == choice.split_makespan
        assert "no stage's unsplit backward" in choice.describe()


@pytest.mark.parametrize("hint", ["plan", "bfw"])
def test_where_the_split_costs_every_stage_alike_none_splits(hint):
    """Eight stages, each split 20% dearer than whole: unsplitting any one alone leaves the others
    bounding the pipeline (no gain), every one of them together does gain; the search from every
    stage unsplit finds it."""
    cost = constant_costs([(1.2, 1.2, 1.2)] * 8, [(1.0, 2.0)] * 8)
    choice = choose(cost, hint, M=32)
    assert choice.stages == tuple(range(8))
    assert choice.makespan < 0.95 * choice.split_makespan


def test_without_whole_costs_it_says_how_to_get_them():
    cost = CostModel(LAST_PAYS.coef, 1.0, typical=(1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="calibrate a split schedule again"):
        choose(cost, "plan", "4")
    no_typical = CostModel(LAST_PAYS.coef, 1.0, whole=LAST_PAYS.whole)
    with pytest.raises(ValueError, match="no typical microbatch"):
        choose(no_typical, "plan", "4")


task = st.floats(0.2, 3.0)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(2, 4).flatmap(
        lambda S: st.tuples(
            st.lists(st.tuples(task, task, st.floats(0.0, 2.0)), min_size=S, max_size=S),
            st.lists(st.tuples(task, task), min_size=S, max_size=S),
        )
    ),
    st.sampled_from([("plan", "4"), ("bfw", "2x"), ("zbh1", "1x")]),
    st.integers(2, 8),
)
def test_the_choice_is_what_it_predicts_and_no_worse_than_either_end(costs, schedule, M):
    """On generated costs: the choice's makespan is the simulated one of its stages, no worse than
    every stage split, better by MIN_GAIN where it leaves any unsplit, no worse than every stage
    unsplit but for the tie; two calls choose alike."""
    split, whole = costs
    cost = constant_costs(split, whole)
    hint, budget = schedule
    choice = choose(cost, hint, budget, M)
    assert choose(cost, hint, budget, M) == choice
    run = run_schedule(cost, hint, budget, M)

    def span(stages):
        return run.predicted_makespan(cost, frozenset(stages))

    assert choice.makespan == pytest.approx(span(choice.stages))
    assert choice.split_makespan == pytest.approx(span(()))
    assert choice.makespan <= choice.split_makespan
    if choice.stages:
        assert choice.makespan < choice.split_makespan * (1 - MIN_GAIN)
    # no worse than leaving every stage unsplit, beyond the tie that keeps the schedule as asked
    assert choice.makespan * (1 - MIN_GAIN) <= span(range(cost.num_stages))


def test_virtual_stages_are_chosen_by_global_stage():
    """With two stages per rank (pp 2, interleaved) the choice names global stages: the last one,
    whose split alone costs."""
    split = [(1.0, 1.0, 1.0)] * 3 + [(1.2, 1.2, 1.2)]
    cost = constant_costs(split, [(1.0, 2.0)] * 4)
    run = RunSchedule(
        VirtualLayout(2, 2), 8, resolve("plan"), Dispatch.READY, Budget.parse("4"), Variability()
    )
    choice = choose_unsplit_stages(cost, run)
    assert choice.stages == (3,)
    assert choice.makespan < choice.split_makespan
