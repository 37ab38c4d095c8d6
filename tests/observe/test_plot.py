"""`rrfp plot` on a long measured trace: it draws one iteration (the last by default, or the one
asked for) or a window, one row per rank with the stages a rank holds sharing its row, labels only
where they fit, and a legend of the task kinds present. Bad picks are one line and exit 2."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

from harness.cli_run import rrfp_in_process

from rrfp.observe.plot import _label, iterations, kinds_present, row_of, select
from rrfp.observe.trace import Span, chrome_trace


def measured_trace(steps: int, ranks: int = 2, mb: int = 4, virtual: int = 2) -> list[Span]:
    """A run's spans as rrfp train records them: one process per rank, each task with its
    iteration, and with two stages per rank (v shape) the rank in every span."""
    spans, t = [], 100.0
    stages = ranks * virtual
    for it in range(steps):
        for m in range(mb):
            for s in range(stages):
                rank = s if s < ranks else 2 * ranks - 1 - s
                for kind, dur in (("F", 0.002), ("B", 0.003), ("W", 0.001)):
                    args = {"iteration": it, "rank": rank}
                    spans.append(Span(f"rank {rank}", s, f"{kind}{m}", t, t + dur, args))
                    t += dur
    return spans


def png_size(path: Path) -> tuple[int, int]:
    w, h = struct.unpack(">II", path.read_bytes()[16:24])
    return w, h


def rrfp_plot(*args: str) -> subprocess.CompletedProcess:
    """`rrfp plot ARGS` in this process (tests/sim/test_sim.py runs it once as a process)."""
    return rrfp_in_process("plot", *args)


def test_rows_are_ranks_and_select_picks_an_iteration_or_a_window():
    spans = measured_trace(3)
    assert {row_of(sp) for sp in spans} == {0, 1}
    assert {sp.stage for sp in spans if row_of(sp) == 1} == {1, 2}
    assert iterations(spans) == [0, 1, 2]
    one = select(spans, iteration=1)
    assert {sp.args["iteration"] for sp in one} == {1} and min(sp.start for sp in one) == 0.0
    window = select(one, start=0.010, end=0.020)
    assert window and all(0.010 <= sp.start < sp.end <= 0.020 for sp in window)
    try:
        select(spans, iteration=7)
    except ValueError as e:
        assert "no iteration 7" in str(e) and "0..2" in str(e)
    else:
        raise AssertionError("iteration 7 is not in the trace")


def test_labels_only_where_they_fit_and_legend_only_present_kinds():
    sp = Span("rank 0", 2, "F13", 0.0, 1.0)
    assert _label(sp, shared=True, width_px=200) == "F13 s2"
    assert _label(sp, shared=False, width_px=200) == "F13"
    assert _label(sp, shared=False, width_px=16) == "13"
    assert _label(sp, shared=False, width_px=5) is None
    one_f_one_b = [("fixed 1f1b", [Span("x", 0, "F0", 0, 1), Span("x", 0, "B0", 1, 2)])]
    assert kinds_present(one_f_one_b) == ["F", "B"]
    assert kinds_present([("r", measured_trace(1))]) == ["F", "B", "W"]


def test_a_200_step_trace_draws_its_last_iteration_readably(tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    trace.write_text(json.dumps(chrome_trace(measured_trace(200))))
    p = rrfp_plot(str(trace), "--out", str(png))
    assert p.returncode == 0, p.stderr
    assert "iteration 199 of 0..199, 48 tasks" in p.stdout, p.stdout
    w, h = png_size(png)
    assert w == 1320 and h < 400, (w, h)  # one timeline, one row per rank
    p = rrfp_plot(str(trace), "--out", str(png), "--iteration", "5", "--from", "5", "--to", "20")
    assert p.returncode == 0 and "iteration 5 of 0..199" in p.stdout, p.stderr
    shown = int(p.stdout.split("tasks")[0].split()[-1])
    assert 0 < shown < 48
    for bad, needle in (
        (["--iteration", "200"], "no iteration 200"),
        (["--from", "5", "--to", "1"], "--from 5 must be below --to 1"),
        (["--iteration", "3", "--from", "900", "--to", "950"], "no task in"),
    ):
        p = rrfp_plot(str(trace), "--out", str(png), *bad)
        assert p.returncode == 2 and needle in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_trace_of_many_timelines_draws_six_or_the_ones_picked(tmp_path):
    """A simulated trace holds one timeline per table row: the plot draws the first six, says which
    it left out, and --timelines picks by name; an unknown name is one line and exit 2."""
    spans = [
        Span(f"row {i}", s, f"F{m}", m + s, m + s + 1.0)
        for i in range(8)
        for s in range(2)
        for m in range(3)
    ]
    trace, png = tmp_path / "sim.json", tmp_path / "sim.png"
    trace.write_text(json.dumps(chrome_trace(spans)))
    p = rrfp_plot(str(trace), "--out", str(png))
    assert p.returncode == 0 and "6 timeline(s)" in p.stdout, p.stderr
    assert "left out 2 timeline(s) (--timelines picks): row 6, row 7" in p.stdout, p.stdout
    p = rrfp_plot(str(trace), "--out", str(png), "--timelines", "row 7,row 1")
    assert p.returncode == 0 and "2 timeline(s)" in p.stdout, p.stderr
    p = rrfp_plot(str(trace), "--out", str(png), "--timelines", "row 9")
    assert p.returncode == 2 and "--timelines: no timeline row 9" in p.stderr, p.stderr
