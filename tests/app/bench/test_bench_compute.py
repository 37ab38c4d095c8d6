"""`rrfp bench --real`'s compute per row: the tasks' compute per rank and iteration, and the
backward per microbatch and rank against the unsplit row's, from the spans (rrfp's, and torch's
two-stage schedules, whose half stages a rank holds together)."""

from __future__ import annotations

import pytest

from rrfp.app.bench.analysis import compute_summary
from rrfp.app.bench.report import compute_lines
from rrfp.app.bench.suite import Contender
from rrfp.observe.trace import Span


def spans_of(name: str, tasks: dict[str, float], stages_per_rank: int = 1) -> list[Span]:
    """Two iterations of 2 ranks x 2 microbatches; each task (``{"F": s, ...}``) takes its seconds
    on every stage, a rank's stages told apart by ``torch_stage`` as the torch runner records."""
    out, t = [], 0.0
    for it in (1, 2):
        for rank in (0, 1):
            for local in range(stages_per_rank):
                for mb in (0, 1):
                    for kind, seconds in tasks.items():
                        args = {"iteration": it}
                        if stages_per_rank > 1:
                            args["torch_stage"] = rank * stages_per_rank + local
                        out.append(Span(name, rank, f"{kind}{mb}", t, t + seconds, args))
                        t += seconds
    return out


def test_compute_per_rank_and_backward_against_the_unsplit_row():
    rows = {
        "fixed 1f1b": {"F": 1.0, "B": 2.0},
        "ready bfw": {"F": 1.0, "B": 1.5, "W": 1.0},
        "torch zb": {"F": 0.5, "B": 0.75, "W": 0.5},  # two half stages per rank
    }
    spans = []
    for name, tasks in rows.items():
        spans += spans_of(name, tasks, 2 if name == "torch zb" else 1)
    spans.append(Span("ready bfw", 0, "wait", 0.0, 9.0, {"iteration": 1}))  # not a task
    got = {name: compute_summary(Contender.parse(name), spans) for name in rows}
    assert got["fixed 1f1b"].per_rank_s == pytest.approx(6.0)  # 2 microbatches x (1 + 2)
    assert got["fixed 1f1b"].backward_s == pytest.approx(2.0)
    assert got["ready bfw"].per_rank_s == pytest.approx(7.0)
    assert got["ready bfw"].backward_s == pytest.approx(2.5)
    assert got["torch zb"].per_rank_s == pytest.approx(7.0)  # 2 stages x 2 microbatches x 1.75
    assert got["torch zb"].backward_s == pytest.approx(2.5)  # both half stages' B + W
    assert (got["fixed 1f1b"].split, got["ready bfw"].split) == (False, True)
    table = compute_lines(list(got.values()))
    assert "over fixed 1f1b's (unsplit)" in table[0]
    by_row = {line.split(" | ")[0].strip("| "): line for line in table[4:]}
    assert by_row["fixed 1f1b"].endswith("| 1.000x |")
    assert by_row["ready bfw"].endswith("| 1.250x |")
    assert by_row["torch zb"].endswith("| 1.250x |")


def test_no_unsplit_row_says_so():
    spans = spans_of("ready bfw", {"F": 1.0, "B": 1.5, "W": 1.0})
    table = compute_lines([compute_summary(Contender.parse("ready bfw"), spans)])
    assert "none ran" in table[0]
    assert table[4].endswith("| — |")
    assert compute_summary(Contender.parse("fixed 1f1b"), spans) is None  # no spans of its own
