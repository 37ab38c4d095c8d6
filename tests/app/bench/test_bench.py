"""`rrfp bench`: the quick suite runs every contender on real gloo ranks and leaves a well-formed
results folder; bad flags exit 2 with one line before any rank starts; a rank that fails mid-job
comes back as one line, not a hang."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from harness.bench_tables import SMALL_DATA, rrfp_bench, table_rows
from harness.cli_run import rrfp_in_process

from rrfp.app.bench.suite import DEFAULT_CONTENDERS, file_slug
from rrfp.app.bench.torch_schedules import stages_per_rank


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The quick suite at one layer per stage of the v shape (pp 2 x 2 local stages) and short
    sequences: every contender and every kind of row, at a quarter of the compute."""
    out = tmp_path_factory.mktemp("bench") / "results"
    small = ("--set", "model.n_layer=4", *SMALL_DATA)
    return out, rrfp_bench("--quick", *small, "--out", str(out), timeout=240)


@pytest.mark.e2e
def test_quick_run_writes_a_well_formed_folder(quick):
    out, res = quick
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert {"cpus", "torch", "hostname", "date"} <= doc["machine"].keys()
    assert (
        doc["config"]["pp"] == 2
        and doc["config"]["n_microbatches"] == 4
        and doc["config"]["reps"] == 1
    )
    [wl] = doc["workloads"]
    ran = [s["contender"] for s in wl["summary"]]
    skipped = wl["skipped"]
    # every contender of the default set either ran or says why not; the rrfp and torch ones run
    # here
    assert set(ran) | set(skipped) == set(DEFAULT_CONTENDERS) and not set(ran) & set(skipped)
    assert set(ran) == set(DEFAULT_CONTENDERS)  # all of them run in this build
    for name in ran:  # one measured iteration each, the same one, with a positive time and bound
        [row] = [r for r in wl["rows"] if r["contender"] == name]
        assert row["iteration"] == 1 and row["wall_s"] > 0 and 0 < row["efficiency"]
        assert row["lower_bound_s"] > 0
    # the order changes: the contenders took different positions in the iteration
    assert len({r["position"] for r in wl["rows"]}) == len(ran)
    for s in wl["summary"]:
        assert math.isfinite(s["speedup"]["median"]) and s["speedup"]["median"] > 0
        assert (s["plan_s"] is not None) == (" plan" in s["contender"])
    # two virtual stages per rank (v shape): every task of both local stages ran, peaks in the
    # rank's microbatches
    for name in ("ready bfw v2", "ready plan v2"):
        [row] = [r for r in wl["rows"] if r["contender"] == name]
        assert (
            0.5 <= row["peak_inflight"] <= 4 and row["lower_bound_s"] > 0 and row["simulated_s"] > 0
        )
    trace = json.loads((out / "trace-gpt.json").read_text())["traceEvents"]
    pid = next(
        e["pid"]
        for e in trace
        if e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == "ready bfw v2"
    )
    rows = {
        e["args"]["name"]
        for e in trace
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid
    }
    assert rows == {
        "stage 0 (rank 0)",
        "stage 1 (rank 1)",
        "stage 2 (rank 1)",
        "stage 3 (rank 0)",
    }, rows
    # the drop-in rows ran rrfp's executor through ScheduleReady: its readiness figures, and a step
    # that spent some (small) time outside the executor's iteration
    for name in ("drop-in ready bfw", "drop-in ready plan"):
        [row] = [r for r in wl["rows"] if r["contender"] == name]
        direct = next(r for r in wl["rows"] if r["contender"] == name.removeprefix("drop-in "))
        assert (
            1 <= row["peak_inflight"] <= 4 and row["decision_us"] > 0
        )  # rrfp's figures; torch has none
        assert 0 < row["overhead_s"] < row["wall_s"], row
        assert row["simulated_s"] == pytest.approx(
            direct["simulated_s"]
        )  # the same durations and hint
    assert all(
        r["overhead_s"] is None for r in wl["rows"] if not r["contender"].startswith("drop-in")
    )
    base = next(s for s in wl["summary"] if s["contender"] == "fixed 1f1b")
    assert base["speedup"]["median"] == pytest.approx(1.0)

    md = (out / "results.md").read_text()
    assert "emulated on CPU" in md
    # one measured iteration: the output says so before any figure, in the file and on stdout
    assert md.splitlines()[2].startswith("SMOKE RUN, NOT A BENCHMARK: 1 measured iteration")
    assert "SMOKE RUN, NOT A BENCHMARK" in res.stdout.split("| contender")[0]
    # every speedup is stated with the memory it was bought with, against fixed 1F1B's
    peak = {s["contender"]: s["peak_inflight"] for s in wl["summary"]}
    line = next(x for x in md.splitlines() if x.startswith("ready bfw: "))
    assert f"microbatches in flight against its {peak['fixed 1f1b']:g}" in line, line
    assert f"with {peak['ready bfw']:g} microbatches" in line, line
    rows = table_rows(md)
    assert set(rows) == set(ran)
    for name, cells in rows.items():
        speedup = float(cells[3].rstrip("x"))
        assert speedup > 0, (name, cells)
        assert float(cells[1]) > 0
    for name in skipped:
        assert f"Not run: {name}: " in md
    for line in (
        "Ablation, dispatch alone: ready plan vs fixed plan",
        "Against torch: ready plan vs torch 1f1b",
        "Against torch: ready plan vs torch zb",
        "Against torch: drop-in ready plan vs torch 1f1b",
        "Against torch: ready plan v2 vs torch zb",
        "Against torch: ready plan v2 vs torch dualpipev",
        "Against torch: drop-in ready bfw vs torch zb",
    ):
        found = re.search(re.escape(line) + r".*: median (\d+\.\d+)x", md)
        assert found and float(found.group(1)) > 0, line
    for dropin, direct in (
        ("drop-in ready bfw", "ready bfw"),
        ("drop-in ready plan", "ready plan"),
    ):
        found = re.search(
            f"Drop-in, the surface alone: {dropin} took (\\d+\\.\\d+)x the time of {direct} .* "
            f"its step spent (\\d+\\.\\d+) ms",
            md,
        )
        assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0, dropin
    assert "drop-in ready plan: each iteration planned when its step started" in md

    for name in ran:
        png = out / f"timeline-gpt-{file_slug(name)}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000, png
    trace = json.loads((out / "trace-gpt.json").read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert processes == set(ran)
    tasks = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] != "wait"]
    # every contender ran every task of its iteration on both ranks: 4 microbatches x (F, B[, W])
    # per stage, and torch's zero-bubble schedule holds two stages per rank
    per = {
        p: sum(
            1
            for e in tasks
            if trace_process(trace, e) == p and (p != "torch dualpipev" or e["name"][0] != "W")
        )
        for p in ran
    }
    per["torch dualpipev"] *= (
        1.5  # torch's DualPipeV runs some backwards whole (its W inside B): F and B counted
    )
    for name, count in per.items():
        split = name not in (
            "fixed 1f1b",
            "torch 1f1b",
        )  # the drop-in rows' hints split, as bfw and plan do
        stages = 2 * (
            stages_per_rank(name.split()[1])
            if name.startswith("torch")
            else 2
            if name.endswith(" v2")
            else 1
        )
        assert count == stages * 4 * (3 if split else 2), (name, count)
    assert str(out) in res.stdout and "| contender |" in res.stdout


def trace_process(trace: dict, event: dict) -> str:
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"
    }
    return names[event["pid"]]


BAD = [
    (["--pp", "0"], "--pp must be >= 1"),
    (["--contenders", "ready-nope"], "unknown hint 'nope'"),
    (["--contenders", "eager-bfw"], "'eager' is neither a dispatch mode (fixed, ready) nor torch"),
    (["--contenders", "torch-gpipe"], "torch gpipe cannot run gpt"),
    (["--workloads", "bert"], "'bert' is neither gpt nor vlm"),
    (["--unit-ms", "-1"], "--unit-ms must be >= 0"),
    (["--budget", "lots"], "--budget"),
    (["--pp", "16"], "n_layer=8"),
    (["--set", "model.n_embdd=3"], "unknown key model.n_embdd"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--contenders", "drop-in-torch-zb"], "the drop-in runs rrfp's executor"),
    (["--contenders", "drop-in-ready-nope"], "unknown hint 'nope'"),
    (
        ["--tp", "2", "--contenders", "drop-in-ready-bfw"],
        "drop-in ready bfw cannot run gpt: ScheduleReady runs",
    ),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_usage_error(tmp_path, args, needle):
    """Every flag and config is checked by the parser and ``build_spec`` before anything starts; the
    command prints their UsageError as its one line (two cases below run it: each costs a
    process)."""
    from rrfp.app.cli.bench_command import build_spec
    from rrfp.app.cli.main import build_parser
    from rrfp.app.errors import UsageError

    with pytest.raises(UsageError) as info:
        build_spec(
            build_parser().parse_args(["bench", "--quick", "--out", str(tmp_path / "out"), *args])
        )
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,needle", [BAD[0], BAD[7]], ids=["flag", "config"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    res = rrfp_in_process("bench", "--quick", "--out", str(tmp_path / "out"), *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("rrfp: error: "), (
        res.stderr
    )
    assert needle in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_failing_rank_is_one_line_not_a_hang(tmp_path):
    out = tmp_path / "out"
    res = rrfp_bench(
        "--workloads",
        "tests/fixtures/failing_stage.toml",
        "--contenders",
        "fixed-1f1b,ready-bfw",
        "--pp",
        "2",
        "--n-microbatches",
        "2",
        "--reps",
        "1",
        "--unit-ms",
        "1",
        "--out",
        str(out),
        timeout=100,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert re.match(
        r"rrfp: error: bench job failed: rank 1: RuntimeError: injected failure in stage 1's "
        r"forward",
        lines[0],
    ), lines[0]
    assert "Traceback" not in res.stderr
    assert (
        "injected failure" in (out / "job.log").read_text()
    )  # the traceback stays in the job's log


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_job_past_its_deadline_is_stopped_with_one_line(tmp_path):
    """Its stage 1 never returns (tests/fixtures/hanging_stage.py): the deadline alone ends it."""
    res = rrfp_bench(
        "--workloads",
        "tests/fixtures/hanging_stage.toml",
        "--contenders",
        "fixed-1f1b",
        "--pp",
        "2",
        "--n-microbatches",
        "2",
        "--reps",
        "1",
        "--unit-ms",
        "1",
        "--timeout",
        "2",
        "--out",
        str(tmp_path / "out"),
        timeout=60,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith(
        "rrfp: error: bench job failed: it did not finish within 2 s (--timeout)"
    ), lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_help_names_the_default_contenders_and_each_one_parses():
    """`rrfp bench --help` lists the default suite as it is, in the names the flag takes."""
    import re

    from rrfp.app.bench.suite import DEFAULT_CONTENDERS, Contender, file_slug
    from rrfp.app.cli.main import build_parser

    bench = next(
        a
        for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions
        if "--contenders" in a.option_strings
    )
    listed = re.search(r"default: (.*): those", bench.help)[1].split(", ")
    assert listed == [file_slug(e) for e in DEFAULT_CONTENDERS]
    assert [Contender.parse(e).name for e in listed] == list(DEFAULT_CONTENDERS)


def test_a_contender_is_its_framework_dispatch_and_hint():
    """A row's name splits into what it means: which framework runs it, rrfp's dispatch mode (none
    for a torch schedule, whose order is its own), the hint or schedule, and how it is reached."""
    from rrfp.app.bench.suite import Contender

    assert Contender.parse("ready-plan") == Contender("rrfp", "ready", "plan")
    assert Contender.parse("torch zb") == Contender("torch", None, "zb")
    dropin = Contender.parse("drop-in-fixed-1f1b")
    assert (dropin.framework, dropin.dispatch, dropin.drop_in) == ("rrfp", "fixed", True)
    v2 = Contender.parse("ready-bfw-v2")
    assert (v2.dispatch, v2.hint, v2.virtual, v2.placement) == ("ready", "bfw", 2, "v")
    for name in ("ready plan", "torch zb", "drop-in fixed 1f1b", "ready bfw v2"):
        assert Contender.parse(name).name == name
    whole = Contender.parse("ready-plan-last-unsplit")
    assert (whole.hint, whole.unsplit, whole.name) == ("plan", "last", "ready plan last unsplit")
    assert whole.unsplit_stages == (-1,)
    auto = Contender.parse("fixed-plan-auto-unsplit")
    assert (auto.dispatch, auto.hint, auto.unsplit, auto.name) == (
        "fixed",
        "plan",
        "auto",
        "fixed plan auto unsplit",
    )
    assert auto.unsplit_stages == "auto"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("fixed-1f1b-last-unsplit", "does not split"),
        ("drop-in-ready-plan-last-unsplit", "rrfp's own rows"),
        ("ready-bfw-auto-unsplit", "planned rows only"),
        ("ready-1f1b-auto-unsplit", "does not split"),
    ],
)
def test_last_unsplit_is_for_rrfps_split_rows(text, needle):
    from rrfp.app.bench.suite import Contender
    from rrfp.app.errors import UsageError

    with pytest.raises(UsageError, match=needle):
        Contender.parse(text)


def test_a_last_unsplit_row_plans_with_its_own_calibration():
    """Its plan prices the last stage's B whole and W at nothing: a cost model of its own."""
    from rrfp.app.bench.suite import Contender, cost_key

    whole, split = Contender.parse("ready plan last unsplit"), Contender.parse("ready plan")
    assert cost_key("gpt", whole) != cost_key("gpt", split) == "gpt"
    auto = Contender.parse("ready plan auto unsplit")
    assert (
        cost_key("gpt", auto) == "gpt-auto-unsplit" and cost_key("gpt", whole) == "gpt-last-unsplit"
    )


def test_an_auto_unsplit_row_chooses_as_a_runs_config_does(tmp_path):
    """The row's settings leave unsplit the stages ``unsplit_stages = "auto"`` picks from its cost
    model, and its plan prices them whole; a config of the same settings chooses alike."""
    from harness.synthetic_costs import cost_file

    from rrfp.app.bench.runners import schedule_settings
    from rrfp.app.bench.suite import BenchSpec, Contender
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.core.cost import CostModel
    from rrfp.core.variability import Variability

    path = cost_file(tmp_path, stages=2, pays=1)
    cost = CostModel.from_json(open(path).read())
    spec = BenchSpec((), pp=2, n_microbatches=8, budget="4", unit_ms=0)
    got = schedule_settings(spec, Contender.parse("ready plan auto unsplit"), Variability(), cost)
    assert got.unsplit_stages == (1,) and got.cost.coef[1][2][0] == 0.0
    sets = ["pp=2", "hint=plan", "budget=4", 'unsplit_stages="auto"', f"emulation.cost={path}"]
    cfg = TrainConfig.load("configs/gpt-tiny.toml", [*sets, "emulation.preset=none"], world_size=2)
    assert cfg.unsplit_stages == got.unsplit_stages


def test_the_agent_is_a_fork_only_where_the_ranks_compute_as_they_must(monkeypatch):
    """The job's agent (and so each rank) is a fork of the bench's process only where that
    process's torch was loaded with one OpenMP thread (a fork's torch.set_num_threads(1) does not
    undo more) and knows no CUDA (a fork cannot use it); else it is an interpreter of its own."""
    import torch

    from rrfp.app.bench.agent import forkable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert forkable()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not forkable()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not forkable()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not forkable()
