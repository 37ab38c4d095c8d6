"""`rrfp bench --workloads moe`: the mixture of experts on pp 2 x ep 2 gloo ranks, rrfp's
contenders and torch's schedules on the same stages with their experts sharded over each EP group;
every rank runs every task of its iteration, and the flags that cannot fit that shape are refused
with one line before any rank starts."""

from __future__ import annotations

import pytest
from harness.bench_tables import run_bench_moe, table_rows, tasks_per_lane

from rrfp.app.bench.suite import MOE_CONTENDERS

CONTENDERS = ("fixed bfw", "ready bfw", "ready bfw overlap", "ready plan", "torch 1f1b", "torch zb")
M = 2  # microbatches: every kind of task on every rank (a property of no particular M)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_moe_runs_rrfp_and_torch_on_pp2_ep2(tmp_path):
    out = tmp_path / "results"
    doc, _ = run_bench_moe(
        out, CONTENDERS, "--n-microbatches", str(M), "--reps", "1", "--unit-ms", "5"
    )
    assert (doc["config"]["pp"], doc["config"]["dp"], doc["config"]["ep"]) == (2, 2, 2)
    [wl] = doc["workloads"]
    assert [s["contender"] for s in wl["summary"]] == list(CONTENDERS)
    for s in wl["summary"]:  # every row with its peak in flight
        assert s["peak_inflight"] is not None and s["peak_inflight"] > 0, s
        assert s["wall_s"]["median"] > 0
    tasks = tasks_per_lane(out / "trace-moe.json")
    # one row per rank (the replicas of a stage apart): M microbatches x F, B(, W) each, and two
    # torch stages per rank under ZB-V
    for name in CONTENDERS:
        per_rank = {r: tasks.get((name, r), 0) for r in range(4)}
        kinds = 2 if name == "torch 1f1b" else 3
        stages = 2 if name == "torch zb" else 1
        assert per_rank == dict.fromkeys(range(4), M * kinds * stages), (name, per_rank)
    md = (out / "results.md").read_text()
    assert "pp 2 x ep 2 ranks" in md and "timed by their routing" in md
    assert set(table_rows(md)) == set(CONTENDERS)
    for line in (
        "Ablation, dispatch alone: ready bfw vs fixed bfw",
        "Against torch: ready plan vs torch zb",
        "Overlap ablation, the all-to-alls yielding to a W or not: ready bfw overlap vs ready bfw",
    ):
        assert line in md, line


def _spec(tmp_path, *args):
    from rrfp.app.cli.bench_command import build_spec
    from rrfp.app.cli.main import build_parser

    return build_spec(build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *args]))


def test_moe_is_pp2_ep2_with_its_own_contenders(tmp_path):
    spec, skipped = _spec(tmp_path, "--workloads", "moe")
    assert (spec.pp, spec.dp, spec.ep, spec.world) == (2, 2, 2, 4)
    [case] = spec.cases
    assert [c.name for c in case.contenders] == [c for c in MOE_CONTENDERS if c != "fixed plan"]
    assert list(skipped["moe"]) == ["fixed plan"]  # each replica plans its own order under EP
    assert case.train_config(spec).layout.ep == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workloads", "moe,gpt"], "moe runs in a job of its own (pp 2 x ep 2 ranks)"),
        (
            ["--workloads", "moe", "--contenders", "fixed-plan"],
            "fixed plan cannot run moe: under expert parallelism each replica plans its own",
        ),
        (["--workloads", "moe", "--contenders", "drop-in-ready-bfw"], "one replica per stage"),
        (["--workloads", "moe", "--contenders", "fixed-bfw-overlap"], "ready dispatch only"),
        (
            ["--workloads", "gpt", "--contenders", "ready-bfw-overlap"],
            "ready bfw overlap cannot run gpt: the overlap is at expert parallelism's all-to-alls",
        ),
    ],
)
def test_what_cannot_run_moe_is_one_usage_error(tmp_path, args, needle):
    from rrfp.app.errors import UsageError

    with pytest.raises(UsageError) as info:
        _spec(tmp_path, *args)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
