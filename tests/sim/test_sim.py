import json
import subprocess

import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process
from harness.launch import child_env, rrfp_argv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.budget import Budget
from rrfp.core.hints import BUILTIN
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, SimDeadlock, simulate

variabilities = st.builds(
    Variability,
    name=st.just("random"),
    f=st.floats(0.1, 3),
    b=st.floats(0.1, 3),
    w=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    jitter=st.floats(0, 1),
    length_sigma=st.floats(0, 1),
    straggler_p=st.floats(0, 0.3),
    vision_stage0=st.booleans(),
    comm=st.sampled_from([0.0, 0.05, 0.5]),
    comm_jitter=st.floats(0, 1),
)
budgets = st.one_of(
    st.integers(1, 40).map(Budget.parse),
    st.sampled_from(["1x", "1.5x", "2x", "3x"]).map(Budget.parse),
)


def check_invariants(r):
    cfg = r.config
    S, M, split = cfg.pp, cfg.n_microbatches, cfg.split_backward
    var, seed = cfg.variability, cfg.seed
    at = {}
    for s, t, a, b in r.timeline:
        key = (s, int(t.kind), t.mb)
        assert key not in at, f"{t} ran twice on stage {s}"
        at[key] = (a, b)
        assert b - a == pytest.approx(var.duration(seed, 0, s, t.mb, t.kind, split))
    kinds = (0, 1, 2) if split else (0, 1)
    assert len(at) == S * M * len(kinds), "every task runs exactly once"
    eps = 1e-9
    for s in range(S):
        spans = sorted(v for k, v in at.items() if k[0] == s)
        for (_, b0), (a1, _) in zip(spans, spans[1:]):
            assert a1 >= b0 - eps, "a stage runs one task at a time"
        for m in range(M):
            fa, fb = at[(s, 0, m)]
            ba, bb = at[(s, 1, m)]
            if s > 0:
                assert fa >= at[(s - 1, 0, m)][1] + var.latency(seed, 0, s - 1, m, Kind.F) - eps
            assert ba >= fb - eps
            if s < S - 1:
                assert ba >= at[(s + 1, 1, m)][1] + var.latency(seed, 0, s + 1, m, Kind.B) - eps
            if split:
                assert at[(s, 2, m)][0] >= bb - eps
    if str(cfg.dispatch) == "ready" and cfg.budget.bytes is None:
        last = 2 if split else 1
        for s in range(S):
            limit = cfg.budget.microbatches(S, s)
            for m in range(M):
                t0 = at[(s, 0, m)][0]
                held = sum(
                    1
                    for k in range(M)
                    if at[(s, 0, k)][0] <= t0 and at[(s, last, k)][1] > t0 + eps or k == m
                )
                assert held <= limit, f"stage {s} holds {held} > budget {limit} at F{m}"
            assert r.peak_inflight[s] <= limit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 8),
    M=st.integers(1, 32),
    hint=st.sampled_from(list(BUILTIN)),
    dispatch=st.sampled_from(["ready", "fixed"]),
    budget=budgets,
    var=variabilities,
    seed=st.integers(0, 2**31),
    split=st.sampled_from([None, True, False]),
)
def test_properties(S, M, hint, dispatch, budget, var, seed, split):
    r = simulate(SimConfig(S, M, hint, dispatch, budget, var, seed=seed, split=split, record=True))
    check_invariants(r)
    assert r.makespan >= r.lower_bound - 1e-9
    assert 0 < r.efficiency <= 1 + 1e-9


@settings(max_examples=40, deadline=None)
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 16),
    hint=st.sampled_from(list(BUILTIN)),
    mb_budget=st.floats(0.3, 6),
    seed=st.integers(0, 1000),
)
def test_byte_budget(S, M, hint, mb_budget, seed):
    var = Variability.preset("lang")
    cfg = SimConfig(
        S,
        M,
        hint,
        "ready",
        Budget(bytes=int(mb_budget * 1000)),
        var,
        seed=seed,
        mb_bytes=1000,
        record=True,
    )
    r = simulate(cfg)
    check_invariants(r)


@pytest.mark.parametrize("hint", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,M", [(1, 1), (2, 5), (4, 8), (8, 32), (5, 3)])
def test_exact_fixed_makespan(hint, S, M):
    var = Variability.preset("none", b=1.0, w=0.0, comm=0.0)
    r = simulate(SimConfig(S, M, hint, "fixed", variability=var, split=False))
    assert r.makespan == (M + S - 1) * 2


def test_fixed_1f1b_memory_is_its_schedule():
    r = simulate(SimConfig(4, 8, "1f1b", "fixed", variability=Variability.preset("lang")))
    assert r.peak_inflight == [4, 3, 2, 1]
    r = simulate(SimConfig(4, 8, "gpipe", "fixed", variability=Variability.preset("lang")))
    assert r.peak_inflight == [8, 8, 8, 8]


def test_fixed_deadlock_is_reported():
    # stage 1 insists on F1 before F0 while stage 0 cannot send F1 before B0 returns
    def hint(S, s, M, split):
        return ["F0", "B0", "F1", "B1"] if s == 0 else ["F1", "F0", "B0", "B1"]

    with pytest.raises(
        SimDeadlock, match="stage 1 waits for F1 in its fixed order, which needs its input"
    ):
        simulate(SimConfig(2, 2, hint, "fixed", variability=Variability.preset("none")))
    # ready dispatch is not fooled by the same hint
    simulate(SimConfig(2, 2, hint, "ready", budget=1, variability=Variability.preset("none")))


def test_readiness_pays_off_under_lang():
    var = Variability.preset("lang")
    ratios = []
    for seed in range(5):
        base = simulate(SimConfig(8, 32, "1f1b", "fixed", variability=var, seed=seed)).makespan
        ratios.append(
            base / simulate(SimConfig(8, 32, "bfw", "ready", variability=var, seed=seed)).makespan
        )
    assert sorted(ratios)[2] > 1.2


def run_cli(*args):
    return rrfp_in_process(*args)


@pytest.mark.e2e
def test_sim_and_plot_commands_run_as_processes(tmp_path):
    """The subprocess smoke test of `rrfp sim` and `rrfp plot` (the other tests run them in this
    process): the entry point runs each, prints its result and exits 0, and a bad flag is one
    line and exit 2."""
    trace, png = tmp_path / "t.json", tmp_path / "t.png"

    def rrfp(*args):
        return subprocess.run(
            rrfp_argv(*args), env=child_env(), capture_output=True, text=True, timeout=120
        )

    p = rrfp("sim", "--pp", "2", "--n-microbatches", "4", "--seeds", "1", "--trace", str(trace))
    assert p.returncode == 0 and "1f1b" in p.stdout, p.stderr
    p = rrfp("plot", str(trace), "--out", str(png))
    assert p.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", p.stderr
    p = rrfp("sim", "--pp", "0")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "rrfp: error: argument --pp: --pp must be >= 1, got 0"
    ], p.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["sim", "--hints", "nope"], "unknown hint 'nope'"),
        (["sim", "--budget", "0"], "below 1"),
        (["sim", "--n-microbatches", "0"], "--n-microbatches must be >= 1"),
        (["sim", "--pp", "0"], "--pp must be >= 1"),
        (["sim", "--dispatch", "lazy"], "unknown dispatch mode"),
    ],
)
def test_cli_bad_input(args, needle):
    p = run_cli(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_cli_jitter_replaces_the_presets_and_is_checked():
    """`--jitter` sets the per-task sigma over any preset's (0.01 on `none`: a real machine's
    noise); a negative one is the CLI's one-line usage error."""
    from rrfp.app.cli.main import build_parser
    from rrfp.app.cli.sim_command import _resolve
    from rrfp.app.errors import UsageError

    def var(*flags):
        return _resolve(build_parser().parse_args(["sim", *flags]))[3]

    assert var("--preset", "none", "--jitter", "0.01").jitter == 0.01
    assert var("--preset", "lang", "--jitter", "0").jitter == 0.0
    assert var("--preset", "lang").jitter == Variability.preset("lang").jitter
    with pytest.raises(UsageError, match="jitter=-1.0"):
        var("--jitter", "-1")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plot", "configs/gpt-tiny.toml"], "configs/gpt-tiny.toml: not a Chrome trace (not JSON)"),
        (["sim", "--cost", "/nonexistent.json"], "--cost is the cost model a recorded run used"),
        (
            ["sim", "--pp", "100000", "--n-microbatches", "100000"],
            "is 10,000,000,000 stage-microbatches per simulation",
        ),
    ],
)
def test_cli_refuses_in_one_line_in_process(argv, needle, capsys, monkeypatch):

    from rrfp.app.cli.main import main

    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_cli_bad_csv(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("stage,task\n0,F0\n0,BX\n")
    p = run_cli("sim", "--pp", "2", "--n-microbatches", "2", "--seeds", "1", "--hints", str(bad))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "bad.csv:3" in p.stderr


def test_cli_outputs(tmp_path):
    out, trace, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "t.png"
    p = run_cli(
        "sim",
        "--pp",
        "4",
        "--n-microbatches",
        "8",
        "--seeds",
        "3",
        "--hints",
        "1f1b,bfw",
        "--json",
        str(out),
        "--trace",
        str(trace),
        "--plot",
        str(png),
    )
    assert p.returncode == 0, p.stderr
    assert "speedup vs fixed 1f1b" in p.stdout
    doc = json.loads(out.read_text())
    rows = {(r["dispatch"], r["hint"]): r for r in doc["rows"]}
    assert rows[("fixed", "1f1b")]["median_speedup"] == 1.0
    assert len(rows[("ready", "bfw")]["speedups"]) == 3
    assert len(rows[("ready", "bfw")]["stage_bubble"]) == 4 and all(
        0 <= b < 1 for b in rows[("ready", "bfw")]["stage_bubble"]
    )
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"][:1] for e in events if e["ph"] == "X"} == {"F", "B", "W"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_json_to_stdout_is_json_alone():
    """`rrfp sim --json -` pipes into jq: stdout is one JSON document, the table goes to stderr."""
    p = run_cli(
        "sim",
        "--pp",
        "2",
        "--n-microbatches",
        "4",
        "--seeds",
        "2",
        "--hints",
        "1f1b,bfw",
        "--json",
        "-",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {(r["dispatch"], r["hint"]) for r in doc["rows"]} >= {
        ("fixed", "1f1b"),
        ("ready", "bfw"),
    }
    assert "speedup vs fixed 1f1b" in p.stderr and "speedup" not in p.stdout.split("{", 1)[0]


def test_plot_draws_any_rrfp_trace(tmp_path):
    """`rrfp plot` reads a Chrome trace back into spans and draws one timeline per process."""
    from rrfp.observe.plot import spans_from_chrome

    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert (
        run_cli(
            "sim",
            "--pp",
            "3",
            "--n-microbatches",
            "4",
            "--seeds",
            "1",
            "--hints",
            "bfw",
            "--budget",
            "2x",
            "--trace",
            str(trace),
        ).returncode
        == 0
    )
    runs = spans_from_chrome(json.loads(trace.read_text()))
    by_name = dict(runs)
    assert runs[0][0] == "fixed 1f1b" and set(by_name) == {"fixed 1f1b", "ready bfw", "fixed bfw"}
    assert sorted({sp.name[0] for sp in by_name["ready bfw"]}) == ["B", "F", "W"]
    assert len(by_name["ready bfw"]) == 3 * 4 * 3 and len(by_name["fixed 1f1b"]) == 3 * 4 * 2
    p = run_cli("plot", str(trace), "--out", str(png))
    assert p.returncode == 0 and "3 timeline(s), 96 tasks" in p.stdout, p.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "bad.json").write_text("{")
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        p = run_cli("plot", str(bad))
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_plot_merges_the_ranks_of_a_measured_run():
    """Ranks share one clock: one timeline with every stage, from the first task (not a wait)."""
    from rrfp.observe.plot import spans_from_chrome
    from rrfp.observe.trace import Span, chrome_trace

    spans = [
        Span("rank 0", 0, "wait", 9.0, 10.0),
        Span("rank 0", 0, "F0", 10.0, 10.5),
        Span("rank 1", 1, "F0", 10.6, 11.0),
        Span("rank 1", 1, "B0", 11.0, 11.2),
    ]
    ((title, got),) = spans_from_chrome(chrome_trace(spans))
    assert title == "measured (all ranks)"
    assert [(sp.stage, sp.name, round(sp.start, 6)) for sp in got] == [
        (0, "F0", 0.0),
        (1, "F0", 0.6),
        (1, "B0", 1.0),
    ]


@pytest.mark.parametrize("S,M", [(4, 16), (8, 32)])
@pytest.mark.parametrize(
    "hint,budget", [("1f1b", "1x"), ("zbh1", "1x"), ("bfw", "2x"), ("plan", "2x")]
)
def test_without_variability_ready_matches_fixed_at_the_same_budget(S, M, hint, budget):
    """Readiness costs nothing when nothing varies: ready runs the hint's order as fast as fixed."""
    from rrfp.sim.planned_hint import planned_config

    var = Variability.preset("none")
    runs = {}
    for dispatch in ("ready", "fixed"):
        cfg = SimConfig(S, M, hint, dispatch, budget, var)
        if cfg.hint.planned:
            cfg, _ = planned_config(cfg)
        runs[dispatch] = simulate(cfg).makespan
    assert runs["ready"] <= runs["fixed"] * 1.01, runs


def test_default_table_shows_every_speedup_beside_its_memory():
    """Without --budget, ready rows and plans run at 2x and at 1x (1F1B's memory), and every row
    says how many microbatches it held: ready plan at 1x holds no more than fixed 1F1B."""
    p = run_cli(
        "sim",
        "--pp",
        "4",
        "--n-microbatches",
        "8",
        "--seeds",
        "2",
        "--hints",
        "1f1b,plan",
        "--json",
        "-",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    rows = {(r["dispatch"], r["hint"], r["budget"]): r for r in doc["rows"]}
    assert doc["budgets"] == ["2x", "1x"]
    assert set(rows) == {
        ("fixed", "1f1b", None),
        ("ready", "1f1b", "2x"),
        ("ready", "1f1b", "1x"),
        ("fixed", "plan", "2x"),
        ("fixed", "plan", "1x"),
        ("ready", "plan", "2x"),
        ("ready", "plan", "1x"),
    }
    one_f_one_b = rows[("fixed", "1f1b", None)]["peak_inflight"]
    assert one_f_one_b == 4
    assert (
        rows[("ready", "plan", "1x")]["peak_inflight"]
        <= one_f_one_b
        < rows[("ready", "plan", "2x")]["peak_inflight"]
    )
    header = next(line for line in p.stderr.splitlines() if "speedup" in line)
    assert header.index("speedup") < header.index("peak in-flight") < header.index("efficiency")
    assert (
        sum(" plan " in line and " 1x " in line for line in p.stderr.splitlines()) == 2
    )  # ready and fixed
    p = run_cli(
        "sim", "--pp", "2", "--n-microbatches", "4", "--seeds", "1", "--oracle", "--budget", "2x,1x"
    )
    assert p.returncode == 2 and "--oracle solves one budget" in p.stderr, p.stderr


def test_a_named_hint_that_runs_in_no_layout_is_refused(tmp_path, capsys):
    """`not run` lines beside other rows are information; when nothing the user named could run, it
    is an error."""
    from rrfp.app.cli.main import main

    order = tmp_path / "stage0.csv"
    order.write_text("stage,task\n0,F0\n")
    argv = [
        "sim",
        "--pp",
        "4",
        "--n-microbatches",
        "4",
        "--seeds",
        "1",
        "--dispatch",
        "fixed",
        "--hints",
        str(order),
    ]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "stage0.csv" in lines[0] and "missing 7 task(s)" in lines[0], lines
    assert main(argv[:-1] + [f"{order},bfw"]) == 0
    assert "not run: hint csv:stage0.csv" in capsys.readouterr().out
