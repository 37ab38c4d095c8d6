"""`rrfp bench --workloads moe --real`: real compute at pp 2. On CPU each rank computes on a core
of its own, so where pp 2 x ep 2 exceeds the cores the default is ep 1 (one replica per pipeline
rank, its experts local, the router's real imbalance in the compute), and pp 2 x ep 2 asked for by
name is one usage line; the overlap rows, which need EP's all-to-alls, are listed as not run."""

from __future__ import annotations

import pytest
from harness.bench_tables import run_bench_moe, tasks_per_lane

from rrfp.app.errors import UsageError

CONTENDERS = ("fixed 1f1b", "ready bfw", "fixed plan", "ready plan", "torch 1f1b")


def _spec(tmp_path, *args):
    from rrfp.app.cli.bench_command import build_spec
    from rrfp.app.cli.main import build_parser

    return build_spec(build_parser().parse_args(["bench", "--out", str(tmp_path / "o"), *args]))


def test_too_few_cores_for_ep2_runs_pp2_at_ep1(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    spec, skipped = _spec(tmp_path, "--workloads", "moe", "--real")
    assert (spec.pp, spec.dp, spec.ep, spec.world) == (2, 1, 1, 2)
    [case] = spec.cases
    assert case.train_config(spec).layout.ep == 1
    assert "fixed plan" in [c.name for c in case.contenders]  # ready plan's ablation, at ep 1
    assert set(skipped["moe"]) == {"ready bfw overlap", "ready plan overlap"}
    assert all("expert parallelism's all-to-alls" in why for why in skipped["moe"].values())
    monkeypatch.setattr("os.cpu_count", lambda: 4)  # room for ep 2: the default keeps it
    spec, _ = _spec(tmp_path, "--workloads", "moe", "--real")
    assert (spec.pp, spec.ep) == (2, 2)


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--real", "--pp", "2", "--ep", "2"],
            "--real on CPU runs one thread per rank: 4 ranks need as many cores, and this machine "
            "has 2 (lower --pp or --ep)",
        ),
        (["--ep", "3"], "--ep 3: moe's 8 experts do not split over it"),
    ],
)
def test_what_does_not_fit_is_one_usage_line(tmp_path, monkeypatch, args, needle):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(UsageError) as info:
        _spec(tmp_path, "--workloads", "moe", *args)
    assert str(info.value) == needle


def test_ep_is_the_moe_workloads(tmp_path):
    with pytest.raises(UsageError, match="--ep sets the moe workload's expert-parallel group"):
        _spec(tmp_path, "--workloads", "gpt", "--ep", "2")


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_moe_real_at_pp2(tmp_path):
    """Every row computes every task of its iteration on both ranks, each with its peak in
    flight; the ablations and the comparison with torch are printed (never a timing)."""
    out = tmp_path / "results"
    doc, _ = run_bench_moe(
        out, CONTENDERS, "--real", "--ep", "1", "--n-microbatches", "2", "--reps", "1"
    )
    assert (doc["config"]["pp"], doc["config"]["dp"], doc["config"]["ep"]) == (2, 1, 1)
    assert doc["config"]["unit_ms"] == 0
    [wl] = doc["workloads"]
    assert [s["contender"] for s in wl["summary"]] == list(CONTENDERS)
    for s in wl["summary"]:
        assert s["peak_inflight"] is not None and s["peak_inflight"] > 0, s
    tasks = tasks_per_lane(out / "trace-moe.json")
    for name in CONTENDERS:  # 2 microbatches x F, B(, W) on each of the two ranks
        kinds = 2 if name in ("fixed 1f1b", "torch 1f1b") else 3
        assert {r: tasks.get((name, r), 0) for r in range(2)} == dict.fromkeys(range(2), 2 * kinds)
    md = (out / "results.md").read_text()
    for line in (
        "Ablation, dispatch alone: ready plan vs fixed plan",
        "Against torch: ready plan vs torch 1f1b",
    ):
        assert line in md, line
