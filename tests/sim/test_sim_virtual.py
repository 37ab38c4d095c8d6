"""The simulator with virtual stages: each task once, dependencies with their latencies (none on
the V turn), one task at a time per rank, the rank budget held, no deadlock, local-stage
durations."""

import json

import numpy as np
import pytest
from harness.cli_run import rrfp_in_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.durations import TaskTimes
from rrfp.core.nominal import VIRTUAL_LATENCY
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.engine import _durations
from rrfp.sim.planned_hint import planned_config

LAYOUTS = [(2, "interleaved"), (2, "v"), (3, "interleaved")]
ORDERS = {"interleaved": "1f1b", "v": "zbv"}  # each placement's classic schedule


def check_virtual_invariants(r):
    cfg = r.config
    lay, M, split = cfg.layout, cfg.n_microbatches, cfg.split_backward
    N = lay.num_stages
    dur, lat_f, lat_b, sizes = _durations(cfg)
    at = {}
    for s, t, a, b in r.timeline:
        key = (s, int(t.kind), t.mb)
        assert key not in at, f"{t} ran twice on stage {s}"
        at[key] = (a, b)
        assert b - a == pytest.approx(dur[s, t.mb, t.kind])
    kinds = (0, 1, 2) if split else (0, 1)
    assert len(at) == N * M * len(kinds), "every task runs exactly once"
    eps = 1e-9
    for rank in range(lay.ranks):
        spans = sorted(v for k, v in at.items() if lay.rank_of(k[0]) == rank)
        for (_, b0), (a1, _) in zip(spans, spans[1:]):
            assert a1 >= b0 - eps, "a rank runs one task at a time"
    for s in range(N):
        for m in range(M):
            fa, fb = at[(s, 0, m)]
            ba, bb = at[(s, 1, m)]
            if s > 0:
                lat = (
                    0.0
                    if lay.is_local(s - 1, s)
                    else cfg.variability.latency(cfg.seed, 0, s - 1, m, Kind.F)
                )
                assert fa >= at[(s - 1, 0, m)][1] + lat - eps
            assert ba >= fb - eps
            if s < N - 1:
                lat = (
                    0.0
                    if lay.is_local(s, s + 1)
                    else cfg.variability.latency(cfg.seed, 0, s + 1, m, Kind.B)
                )
                assert ba >= at[(s + 1, 1, m)][1] + lat - eps
            if split:
                assert at[(s, 2, m)][0] >= bb - eps
    if str(cfg.dispatch) == "ready" and cfg.budget.bytes is None:
        last = 2 if split else 1
        for rank in range(lay.ranks):
            limit = cfg.budget.rank_limit(lay, rank).count
            mine = [(s, m) for s in lay.stages_of(rank) for m in range(M)]
            for s0, m0 in mine:  # local-stage microbatches held when each F starts, itself included
                t0 = at[(s0, 0, m0)][0]
                held = sum(
                    1
                    for s, m in mine
                    if (s, m) == (s0, m0)
                    or at[(s, 0, m)][0] <= t0
                    and at[(s, last, m)][1] > t0 + eps
                )
                assert held <= limit, (
                    f"rank {rank} holds {held} > budget {limit} at F{m0} of stage {s0}"
                )
            assert r.stats[rank].peak_inflight <= limit


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 5),
    M=st.integers(1, 12),
    layout=st.sampled_from(LAYOUTS),
    hint=st.sampled_from(["bfw", "bf", "gpipe", "plan", "order"]),
    dispatch=st.sampled_from(["ready", "fixed"]),
    budget=st.sampled_from(["1x", "2x", "0.5x", "0.25x", "3"]),
    preset=st.sampled_from(["lang", "jitter", "mm"]),
    comm=st.sampled_from([0.0, 0.05, 0.5]),
    seed=st.integers(0, 2**31),
)
def test_invariants_at_virtual_stages(S, M, layout, hint, dispatch, budget, preset, comm, seed):
    V, placement = layout
    hint = ORDERS[placement] if hint == "order" else hint
    if hint == "1f1b":
        M = S * max(1, M // S)  # torch's interleaved 1F1B takes whole rounds of microbatches
    var = Variability.preset(preset, comm=comm, comm_jitter=0.3)
    cfg = SimConfig(
        S, M, hint, dispatch, budget, var, seed=seed, record=True, virtual=V, placement=placement
    )
    if cfg.hint.planned:
        cfg = planned_config(cfg)[0]
    r = simulate(cfg)
    check_virtual_invariants(r)
    assert r.makespan >= r.lower_bound - 1e-9
    assert len(r.stats) == S and len(r.stage_stats) == S * V
    assert sum(st.busy for st in r.stats) == pytest.approx(sum(st.busy for st in r.stage_stats))


def test_the_v_turn_is_local_and_other_hops_pay_latency():
    var = Variability.preset("none", comm=5.0)
    for placement in ("v", "interleaved"):
        r = simulate(
            SimConfig(4, 4, "bfw", "ready", "2x", var, virtual=2, placement=placement, record=True)
        )
        at = {(s, str(t)): (a, b) for s, t, a, b in r.timeline}
        gap = at[(4, "F0")][0] - at[(3, "F0")][1]
        assert gap == (0.0 if placement == "v" else 5.0)
        assert at[(3, "B0")][0] - at[(4, "B0")][1] == gap


def test_a_local_stage_takes_one_vth_of_the_stage_and_draws_are_keyed_by_global_stage():
    var = Variability.preset("lang", slow_stage=1, slow_factor=2.0)
    lay = VirtualLayout(4, 2, "v")
    local = TaskTimes(var, 7, True, layout=lay).realized(0, 8, 6)
    flat = TaskTimes(Variability.preset("lang"), 7, True).realized(
        0, 8, 6
    )  # 8 plain stages, no slow one
    slow = np.array([2.0 if lay.rank_of(s) == 1 else 1.0 for s in range(8)])[:, None, None]
    assert np.allclose(
        local, flat * slow / 2
    )  # rank 1's both local stages are slow, stage 1 alone is not
    assert TaskTimes(var, 7, True, layout=lay).units(0, 6, 3, Kind.B) == pytest.approx(
        local[6, 3, 1]
    )
    one = SimConfig(4, 6, variability=Variability.preset("none", comm=0.0), virtual=2)
    assert simulate(one).stats[0].busy == pytest.approx(
        3.0 * 6
    )  # F + B + W per microbatch, over 2 local stages


def test_virtual_stages_beat_one_stage_per_rank_under_lang_in_their_classic_schedules():
    """Halving the fill and drain: fixed interleaved 1F1B and fixed ZB-V beat fixed 1F1B (V = 1)."""
    var = Variability.preset("lang")
    for seed in range(3):
        base = simulate(SimConfig(8, 32, "1f1b", "fixed", variability=var, seed=seed)).makespan
        for placement, hint in ORDERS.items():
            r = simulate(
                SimConfig(
                    8, 32, hint, "fixed", variability=var, seed=seed, virtual=2, placement=placement
                )
            )
            assert r.makespan < base
    r = simulate(SimConfig(4, 8, "zbv", "fixed", variability=var, virtual=2, placement="v"))
    assert (
        max(r.peak_microbatches) == 4
    )  # ZB-V holds 1F1B's rank-0 memory (S microbatches) on every rank
    assert r.peak_microbatches == [4.0] * 4


@pytest.mark.parametrize(
    "placement,hint,comm",
    [
        ("v", "zbv", 0.0),
        ("v", "plan", 0.0),
        ("interleaved", "1f1b", 0.0),
        ("interleaved", "plan", 0.0),
        ("v", "bfw", VIRTUAL_LATENCY),
        ("interleaved", "bfw", VIRTUAL_LATENCY),
        ("v", "bf", VIRTUAL_LATENCY),
        ("interleaved", "bf", VIRTUAL_LATENCY),
    ],
)
def test_without_variability_ready_is_fixed_at_the_same_hint(placement, hint, comm):
    """Nothing varies: ready dispatch runs the fixed order's schedule to the last digit. A schedule
    hint's order holds with free messages; a plan is replayed from ready's own run; a class hint's
    nominal order over virtual stages is what ready does when messages take the nominal latency
    (bf: the backward unsplit, a B as long as B + W)."""
    var = Variability.preset("none", comm=comm)
    runs = {}
    for dispatch in ("ready", "fixed"):
        cfg = SimConfig(8, 32, hint, dispatch, "2x", var, virtual=2, placement=placement)
        if cfg.hint.planned:
            cfg, _ = planned_config(cfg)
        runs[dispatch] = simulate(cfg).makespan
    assert runs["ready"] == pytest.approx(runs["fixed"], rel=1e-12), runs


# (placement, hint, budget, may ready be faster): fixed ZB-V holds exactly 1x (S microbatches on
# every rank) and fixed interleaved 1F1B 1.4x on rank 0, so ready compares with them at 1x and 2x;
# at 2x ready ZB-V holds more than the fixed order and may gain by it
SAME_BUDGET = [
    ("v", "zbv", "1x", False),
    ("v", "zbv", "2x", True),
    ("v", "plan", "1x", False),
    ("v", "plan", "2x", False),
    ("v", "bfw", "2x", False),
    ("interleaved", "1f1b", "2x", False),
    ("interleaved", "plan", "1x", False),
    ("interleaved", "plan", "2x", False),
    ("interleaved", "bfw", "2x", False),
]


@pytest.mark.parametrize("placement,hint,budget,faster", SAME_BUDGET)
@pytest.mark.parametrize("S,M", [(8, 32), (4, 16)])
def test_with_latency_and_no_variability_ready_loses_nothing_to_fixed_at_the_same_hint(
    placement, hint, budget, faster, S, M
):
    """Messages take 0.05 and nothing varies: ready dispatch is within 1% of the fixed order at the
    same hint and memory. A rank that filled the wait for its next local stage's input with one more
    forward of the local stage before (no lead limit) lost 5.7% on ZB-V's own order at 8 x 32."""
    var = Variability.preset("none", comm=0.05)
    runs = {}
    for dispatch in ("ready", "fixed"):
        cfg = SimConfig(S, M, hint, dispatch, budget, var, virtual=2, placement=placement)
        if cfg.hint.planned:
            cfg, _ = planned_config(cfg)
        runs[dispatch] = simulate(cfg).makespan
    ratio = runs["ready"] / runs["fixed"]
    assert ratio <= 1.01, runs
    if not faster:
        assert ratio >= 0.99, runs


def test_a_local_stage_runs_ahead_of_the_next_by_at_most_the_stages_between_them():
    """Ready dispatch, lang: at every start, local stage 0's forwards lead local stage 1's by at
    most the layout's lead on that rank (2(S - r) - 1 in the v shape, S interleaved)."""
    for placement in ("v", "interleaved"):
        cfg = SimConfig(
            4,
            16,
            "bfw",
            "ready",
            "4x",
            Variability.preset("lang"),
            seed=3,
            virtual=2,
            placement=placement,
            record=True,
        )
        lay = cfg.layout
        assert [lay.leads(r) for r in range(4)] == (
            [(7,), (5,), (3,), (1,)] if placement == "v" else [(4,)] * 4
        )
        started = {r: [0, 0] for r in range(4)}
        most = {r: 0 for r in range(4)}
        for s, t, _start, _end in sorted(simulate(cfg).timeline, key=lambda e: e[2]):
            if t.kind is Kind.F:
                r = lay.rank_of(s)
                started[r][lay.local_index(s)] += 1
                most[r] = max(most[r], started[r][0] - started[r][1])
                assert started[r][0] - started[r][1] <= lay.leads(r)[0], (placement, r, t, s)
        assert max(most.values()) == max(
            lead for r in range(4) for lead in lay.leads(r)
        )  # the limit binds


def run_cli(*args):
    return rrfp_in_process(*args)


def test_cli_runs_virtual_layouts_beside_the_plain_pipeline():
    p = run_cli(
        "sim",
        "--pp",
        "4",
        "--n-microbatches",
        "8",
        "--seeds",
        "2",
        "--hints",
        "bfw,zbv,1f1b",
        "--budget",
        "2x",
        "--virtual",
        "1,2",
        "--placement",
        "interleaved,v",
        "--json",
        "-",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    rows = {(r["dispatch"], r["hint"], r["virtual"], r["placement"]) for r in doc["rows"]}
    assert ("fixed", "zbv", 2, "v") in rows and ("fixed", "1f1b", 2, "interleaved") in rows
    assert ("ready", "bfw", 2, "v") in rows and ("ready", "bfw", 1, "interleaved") in rows
    assert ("fixed", "1f1b", 2, "v") not in rows and ("fixed", "zbv", 1, "interleaved") not in rows
    assert any("ZB-V needs the v placement" in why for why in doc["not_run"])
    base = next(
        r for r in doc["rows"] if (r["dispatch"], r["hint"], r["virtual"]) == ("fixed", "1f1b", 1)
    )
    assert base["median_speedup"] == 1.0  # the baseline stays fixed 1F1B with one stage per rank


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--virtual", "3", "--placement", "v"], "placement v needs exactly 2 stages per rank"),
        (["--virtual", "2", "--placement", "zigzag"], "unknown placement 'zigzag'"),
        (["--virtual", "two"], "--virtual: not a list of integers"),
        (
            ["--pp", "8", "--n-microbatches", "64", "--virtual", "2", "--oracle"],
            "S*V*M <= 512, here 1024",
        ),
    ],
)
def test_cli_refuses_bad_virtual_input_in_one_line(args, needle):
    p = run_cli("sim", "--pp", "2", "--n-microbatches", "2", "--seeds", "1", *args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_cli_oracle_compares_each_row_with_its_own_layouts_optimum():
    pytest.importorskip("ortools", reason="the oracle is the optional extra rrfp[oracle]")
    p = run_cli(
        "sim",
        "--pp",
        "2",
        "--n-microbatches",
        "4",
        "--seeds",
        "1",
        "--hints",
        "zbv,bfw",
        "--virtual",
        "2",
        "--placement",
        "v",
        "--oracle",
        "--json",
        "-",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    optimum = {s["layout"]: s for s in doc["oracle"]["seeds"]}
    assert set(optimum) == {"V2 v", "V1"} and all(s["optimal"] for s in optimum.values())
    assert doc["oracle"]["solved"] == 2
    assert (
        optimum["V2 v"]["makespan"] < optimum["V1"]["makespan"]
    )  # the V halves the fill and drain
    for row in doc["rows"]:
        ref = optimum["V2 v" if row["virtual"] == 2 else "V1"]["makespan"]
        d = row["vs_optimum"]
        assert d["per_seed"] == pytest.approx([row["makespans"][0] / ref]) and not d["upper_limit"]
        if d["holds_budget"]:
            assert d["per_seed"][0] >= 1 - 3 * 3 * 4 * 4 / 1000
    rows = {(r["dispatch"], r["hint"], r["virtual"]) for r in doc["rows"]}
    assert {("ready", "bfw", 2), ("fixed", "zbv", 2), ("fixed", "1f1b", 1)} <= rows
    assert "optimum V2 v:" in p.stderr and "1 of 1 seeds solved to optimality" in p.stderr
    assert "vs optimum" in p.stderr


def test_trace_and_plot_show_a_row_per_stage_with_its_rank(tmp_path):
    from rrfp.observe.plot import spans_from_chrome
    from rrfp.observe.trace import chrome_trace

    r = simulate(
        SimConfig(
            2,
            2,
            "bfw",
            variability=Variability.preset("none"),
            virtual=2,
            placement="v",
            record=True,
        )
    )
    doc = chrome_trace(r.spans("ready bfw"))
    rows = {
        e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"
    }
    assert rows == {
        0: "stage 0 (rank 0)",
        1: "stage 1 (rank 1)",
        2: "stage 2 (rank 1)",
        3: "stage 3 (rank 0)",
    }
    ((title, spans),) = spans_from_chrome(json.loads(json.dumps(doc)))
    assert {sp.stage: sp.args["rank"] for sp in spans} == {0: 0, 1: 1, 2: 1, 3: 0}
    p = run_cli(
        "sim",
        "--pp",
        "2",
        "--n-microbatches",
        "2",
        "--seeds",
        "1",
        "--hints",
        "bfw",
        "--virtual",
        "2",
        "--placement",
        "v",
        "--plot",
        str(tmp_path / "t.png"),
        "--trace",
        str(tmp_path / "t.json"),
    )
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "t.png").stat().st_size > 1000
    names = {
        e["args"]["name"]
        for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
        if e.get("name") == "thread_name"
    }
    assert (
        "stage 3 (rank 0)" in names and "stage 0" in names
    )  # the V = 1 baseline keeps its plain rows


def test_replay_of_a_virtual_run_simulates_its_layout(tmp_path):
    """A run with V = 2 records virtual and placement; its cost model has one entry per global
    stage, and each step is simulated on that layout (a planned run with each step's plan)."""
    from harness.synthetic_costs import synthetic

    from rrfp.core.budget import Budget
    from rrfp.core.cost import CostModel
    from rrfp.core.policy import Dispatch
    from rrfp.sim.planned_hint import plan_iteration
    from rrfp.sim.replay import replay

    model = CostModel.fit(synthetic(stages=4)[1])
    var, lay = Variability.preset("lang"), VirtualLayout(2, 2, "v")
    feats = [
        {"tokens": float(t), "attn": float(t * t), "patches": 0.0}
        for t in (64, 512, 32, 480, 96, 400)
    ]
    doc = {
        "pp": 2,
        "virtual": 2,
        "placement": "v",
        "n_microbatches": 6,
        "seed": 3,
        "preset": "lang",
        "hint": "plan",
        "dispatch": "ready",
        "budget": "2x",
        "split": True,
        "unit_ms": 10.0,
        "features": [feats],
        "step_wall_s": [1.0],
    }
    ((step, sim_ms, _),) = replay(doc, model)
    times = TaskTimes(var, 3, True, model, lay)
    hint, _ = plan_iteration(times, 0, 2, 6, Budget.parse("2x"), Dispatch.READY, feats)
    want = (
        simulate(
            SimConfig(
                2,
                6,
                hint,
                "ready",
                "2x",
                var,
                seed=3,
                durations=times.realized(0, 4, 6, feats).tolist(),
                virtual=2,
                placement="v",
            )
        ).makespan
        * 10.0
    )
    assert sim_ms == pytest.approx(want, rel=1e-12)
    assert times.realized(0, 4, 6, feats)[1, 2, 0] == pytest.approx(
        model.units(1, 0, feats[2]) * var.noise(3, 0, 1, 2, 0)
    )  # no 1/V: fitted per local stage
    sizes, cost = tmp_path / "sizes.json", tmp_path / "cost.json"
    sizes.write_text(json.dumps({**doc, "virtual": 1, "placement": "interleaved"}))
    cost.write_text(model.to_json())
    p = run_cli("sim", "--replay", str(sizes), "--cost", str(cost))
    assert p.returncode == 2 and "the cost model has 4 stage(s) but the run had 2" in p.stderr, (
        p.stderr
    )
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_oracle_takes_a_byte_budget_with_virtual_stages():
    """V = 2 with a byte budget: both layouts solved, every ready row at or above its optimum, and a
    fixed row that held more than the rank limit marked, not compared as a schedule of the
    problem."""
    pytest.importorskip("ortools", reason="the oracle is the optional extra rrfp[oracle]")
    p = run_cli(
        "sim",
        "--pp",
        "2",
        "--n-microbatches",
        "3",
        "--seeds",
        "2",
        "--hints",
        "zbv,bfw",
        "--virtual",
        "2",
        "--placement",
        "v",
        "--budget",
        "1MiB",
        "--oracle",
        "--oracle-time-limit",
        "60",  # room for a loaded machine: each proof takes about a CPU-second
        "--json",
        "-",
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {s["layout"] for s in doc["oracle"]["seeds"]} == {"V2 v", "V1"}
    assert doc["oracle"]["solved"] == 4  # 2 seeds x 2 layouts, each proven
    rows = {(r["dispatch"], r["hint"], r["virtual"]): r["vs_optimum"] for r in doc["rows"]}
    for key in (("ready", "bfw", 2), ("ready", "zbv", 2)):
        assert rows[key]["holds_budget"] is True
        assert min(rows[key]["per_seed"]) >= 1 - 1e-3, (
            key
        )  # within the optimum's rounding (1/1000 per task)
    assert (
        rows[("fixed", "zbv", 2)]["holds_budget"] is False
    )  # it runs its order past the rank limit
    assert "held more bytes than the optimum's rank limit" in p.stderr
