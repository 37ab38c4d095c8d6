"""`rrfp bench --real`'s critical path per row: walked back from each iteration's last task along
whichever came last of the rank's previous task and the task whose output it needed, with the
gaps split into same-rank hand-offs and messages."""

from __future__ import annotations

import pytest

from rrfp.app.bench.critical_path import critical_path, iteration_path
from rrfp.app.bench.report import critical_path_lines
from rrfp.observe.trace import Span


def task(name: str, stage: int, start: float, end: float, it: int = 1, **args) -> Span:
    return Span("row", stage, name, start, end, {"iteration": it, **args})


def one_f_one_b(it: int = 1, late: float = 0.0) -> list[Span]:
    """Two ranks, one microbatch: F0 on stage 0, a message, F0 and B0 on stage 1, a message back,
    B0 on stage 0; ``late`` delays the second message."""
    return [
        task("F0", 0, 0.0, 1.0, it),
        task("F0", 1, 1.3, 2.3, it),  # 0.3 after its input
        task("B0", 1, 2.4, 4.4, it),  # 0.1 after F0 on its rank
        task("B0", 0, 4.9 + late, 6.9 + late, it),  # 0.5 (+ late) after its input
    ]


def test_the_path_sums_compute_and_splits_the_gaps_by_where_they_came_from():
    compute, rank_gaps, rank_hops, message_gaps, message_hops, window = iteration_path(
        one_f_one_b()
    )
    assert compute == pytest.approx(6.0)
    assert (rank_gaps, rank_hops) == (pytest.approx(0.1), 1)
    assert (message_gaps, message_hops) == (pytest.approx(0.8), 2)
    assert window == pytest.approx(6.9)


def test_the_later_of_the_two_predecessors_is_the_one_on_the_path():
    """Stage 0's F1 ends after stage 1's B0 (4.4): B0 on stage 0 waited for its own rank, and the
    path goes through F1, not across."""
    spans = one_f_one_b() + [task("F1", 0, 1.1, 4.8)]
    compute, rank_gaps, rank_hops, message_gaps, message_hops, _ = iteration_path(spans)
    # B0@0 (2.0, 0.1 after F1@0) <- F1@0 (3.7, 0.1 after F0@0) <- F0@0 (1.0)
    assert compute == pytest.approx(6.7)
    assert (rank_gaps, rank_hops) == (pytest.approx(0.2), 2)
    assert (message_gaps, message_hops) == (0.0, 0)


def test_the_lanes_own_times_are_the_compute_and_a_local_stage_is_no_message():
    """rrfp's spans carry the lane's work (``compute``) inside the host time around it; torch's
    two half stages on one rank (``torch_stage``) hand over without a message, and W follows its
    own B."""
    spans = [
        Span("row", 0, "F0", 0.0, 1.5, {"iteration": 1, "compute": [0.2, 1.2]}),
        Span("row", 0, "F0", 1.6, 2.6, {"iteration": 1, "torch_stage": 1}),  # same rank
        Span("row", 0, "B0", 2.6, 3.6, {"iteration": 1, "torch_stage": 1}),
        Span("row", 0, "W0", 3.8, 4.0, {"iteration": 1, "torch_stage": 1}),
    ]
    compute, rank_gaps, rank_hops, message_gaps, message_hops, _ = iteration_path(spans)
    assert compute == pytest.approx(1.0 + 1.0 + 1.0 + 0.2)
    assert (rank_gaps, rank_hops) == (pytest.approx(0.4 + 0.0 + 0.2), 3)
    assert message_hops == 0


def test_a_rank_of_several_stages_is_told_by_its_rank():
    """rrfp's virtual stages: stage 1 on rank 1, stage 2 back on rank 0 (``rank``), so F0 from
    stage 1 to 2 is a message and from 2 to 3 (rank 1 again) another."""
    spans = [
        task("F0", 0, 0.0, 1.0, rank=0),
        task("F0", 1, 1.2, 2.0, rank=1),
        task("F0", 2, 2.5, 3.0, rank=0),
        task("F0", 3, 3.1, 4.0, rank=1),
    ]
    _, rank_gaps, rank_hops, message_gaps, message_hops, _ = iteration_path(spans)
    assert (message_gaps, message_hops) == (pytest.approx(0.2 + 0.5 + 0.1), 3)
    assert rank_hops == 0


def test_medians_over_iterations_and_the_table():
    spans = one_f_one_b(1) + one_f_one_b(2, late=0.2) + one_f_one_b(3, late=0.4)
    spans.append(task("wait", 0, 0.0, 9.0))  # not a task
    path = critical_path("row", spans)
    assert path is not None
    assert path.message_gaps_s == pytest.approx(1.0) and path.message_hops == 2
    assert path.iteration_s == pytest.approx(7.1)
    assert critical_path("other row", spans) is None
    [row] = critical_path_lines([path])[4:]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["row", "6000.0", "100.00", "1", "100000", "1000.00", "2", "500000", "15.5%"]
