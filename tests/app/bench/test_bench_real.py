"""`rrfp bench --real`: task times are the model's real compute, each row's bound and replay come
from its own traced task times, and the host time around each task is taken apart from the trace.
One small job runs it end to end; the figures' arithmetic is checked on made-up spans."""

from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest
from harness.bench_tables import SMALL_DATA, rrfp_bench, table_rows

from rrfp.app.bench import threads
from rrfp.app.bench.analysis import (
    Paired,
    host_parts,
    host_summary,
    paired_beyond_replay,
    paired_parts,
    realized_work,
)
from rrfp.app.bench.suite import BenchSpec, Case, Contender
from rrfp.core.bounds import lower_bound
from rrfp.core.cost import CostModel
from rrfp.core.tasks import Kind, Task
from rrfp.observe.instrument import TraceRecorder
from rrfp.observe.trace import Span


def bench_spec(args: list[str]):
    from rrfp.app.cli.bench_command import build_spec
    from rrfp.app.cli.main import build_parser

    return build_spec(build_parser().parse_args(["bench", "--quick", *args]))


def test_real_and_unit_ms_zero_are_the_same_run():
    for args in (["--real"], ["--unit-ms", "0"], ["--real", "--unit-ms", "0"]):
        spec, _ = bench_spec(args)
        assert spec.unit_ms == 0 and spec.real, args
    spec, _ = bench_spec(["--unit-ms", "3"])
    assert not spec.real


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--unit-ms", "-1"], "--unit-ms must be >= 0"),
        (["--real", "--unit-ms", "5"], "--unit-ms 5 contradicts it"),
        (["--real", "--pp", "3"], "3 ranks need as many cores, and this machine has 2"),
        (["--device", "cuda"], "--device cuda runs real compute only: add --real"),
        (["--pin"], "--pin pins CPU ranks computing for real"),
    ],
)
def test_real_refusals_are_one_line(monkeypatch, args, needle):
    from rrfp.app.errors import UsageError

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(UsageError) as info:
        bench_spec(args)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_gpu_run_needs_the_gpus(monkeypatch):
    import torch

    from rrfp.app.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="1 ranks need as many GPUs, and this machine has 0"):
        bench_spec(["--real", "--device", "cuda"])


def span(process, stage, name, start, end, compute=None, it=1, **args):
    extra = {} if compute is None else {"compute": list(compute), "returned": compute[1] + 1e-4}
    return Span(process, stage, name, start, end, {"iteration": it, **extra, **args})


def test_realized_work_takes_the_lanes_compute_not_the_span():
    case = Case("gpt", "unused.toml", "lang", False)
    spec = BenchSpec((case,), pp=2, n_microbatches=2, reps=1, unit_ms=0.0)
    ready = Contender.parse("ready bfw")
    # each span is 1 s longer than the lane's work: the host time around it
    spans, want = [], np.zeros((2, 2, 3))
    t = 0.0
    for s in (0, 1):
        for k, kind in enumerate("FBW"):
            for mb in (0, 1):
                took = 0.01 * (1 + s + k + mb)
                spans.append(span("ready bfw", s, f"{kind}{mb}", t, t + took + 1, (t, t + took)))
                want[s, mb, k] = took
                t += took + 1
    work = realized_work(spec, ready, spans + [span("ready bfw", 0, "wait", 0, 50)])
    assert np.allclose(work.durations, want)
    zero = np.zeros((2, 2))
    assert work.lower_bound_s == pytest.approx(lower_bound(want, zero, zero, True))
    # torch's spans carry no lane times: their own length, by torch's stage (zb: two per rank)
    zb = Contender.parse("torch zb")
    spans = [
        Span("torch zb", 0, "F0", 0.0, 0.25, {"iteration": 1, "torch_stage": 3}),
        Span("torch zb", 1, "B1", 1.0, 1.5, {"iteration": 1, "torch_stage": 2}),
    ]
    work = realized_work(spec, zb, spans)
    assert work.durations.shape == (4, 2, 3)
    assert work.durations[3, 0, 0] == 0.25 and work.durations[2, 1, 1] == 0.5
    assert work.rank_of == (0, 1, 1, 0)  # the v shape


def test_host_parts_split_a_tasks_time_around_its_compute():
    sp = Span(
        "ready bfw",
        0,
        "F0",
        10.0,
        10.5,
        {"iteration": 1, "decide_s": 0.001, "compute": [10.1, 10.3], "returned": 10.35},
    )
    parts = host_parts(sp)
    assert parts == pytest.approx(
        {"decide": 0.001, "to lane": 0.1, "from lane": 0.05, "after": 0.15}
    )
    assert host_parts(Span("torch 1f1b", 0, "F0", 0, 1, {"iteration": 1})) is None
    # one rank, one iteration: a wait, then two tasks with a gap between them
    spans = [
        span("ready bfw", 0, "wait", 0.0, 1.0),
        span("ready bfw", 0, "F0", 1.0, 2.0, (1.25, 1.75), decide_s=0.0),
        span("ready bfw", 0, "B0", 3.0, 4.0, (3.25, 3.75), decide_s=0.0),
    ]
    woke = [
        {"contender": "ready bfw", "iteration": 1, "rank": 0, "roles": {"loop": [0.2, 6, 0, 0.05]}}
    ]
    h = host_summary("ready bfw", spans, woke)
    assert h.per_task["compute"] == pytest.approx(0.5)
    assert h.per_iteration["compute"] == pytest.approx(1.0)
    assert h.per_iteration["wait"] == pytest.approx(1.0)
    assert h.per_iteration["host"] == pytest.approx(1.0)  # 0.5 around each task
    assert h.per_iteration["other"] == pytest.approx(1.0)  # the gap between the tasks
    assert h.wakes_per_task == {"loop": 3.0} and h.cpu_s == {"loop": 0.2}
    assert h.queued_s == {"loop": 0.05}
    assert host_summary("torch 1f1b", spans, woke) is None


def test_paired_reports_spread_and_when_the_median_settled():
    p = Paired.of([2.0, 1.0, 1.0, 1.0, 1.0])
    assert (p.median, p.low, p.high, p.n) == (1.0, 1.0, 2.0, 5)
    assert p.settled_after == 3  # medians 2.0, then 1.5, then 1.0 from the third iteration on
    assert (p.q1, p.q3) == (1.0, 1.0)
    p = Paired.of([1.0, 1.5, 1.0, 1.5, 1.0])
    assert p.settled_after == 5 and p.median == 1.0  # the running median swings until the last
    assert Paired.of([]) is None


def test_beyond_replay_takes_each_rows_replay_out():
    rows = [
        {"contender": "ready bfw", "iteration": 1, "wall_s": 1.2, "simulated_s": 1.0},
        {"contender": "fixed bfw", "iteration": 1, "wall_s": 1.5, "simulated_s": 1.25},
        {"contender": "ready bfw", "iteration": 2, "wall_s": 1.0, "simulated_s": None},
        {"contender": "fixed bfw", "iteration": 2, "wall_s": 1.0, "simulated_s": 1.0},
    ]
    assert paired_beyond_replay(rows, "ready bfw", "fixed bfw") == [pytest.approx(1.0)]


def test_trace_recorder_keeps_a_tasks_detail_on_its_span():
    rec = TraceRecorder("ready bfw")
    rec.task_detail(0, 3, Task(Kind.F, 1), {"decide_s": 1e-5, "compute": [1.0, 2.0]})
    rec.task(0, 3, Task(Kind.F, 1), 0.5, 2.5)
    rec.task(0, 3, Task(Kind.B, 1), 3.0, 4.0)  # no detail given: none carried over
    first, second = rec.spans
    assert first.args == {"iteration": 3, "decide_s": 1e-5, "compute": [1.0, 2.0]}
    assert second.args == {"iteration": 3}
    # a task's message is taken by the peer after its span, or (rarely) before it is recorded
    rec.task_sent(0, 3, Task(Kind.F, 1), {"posted": 2.5, "sent": 2.6, "taken": 2.7})
    rec.task_sent(0, 3, Task(Kind.F, 2), {"posted": 4.5})
    rec.task(0, 3, Task(Kind.F, 2), 4.0, 4.5)
    assert first.args["sent"] == {"posted": 2.5, "sent": 2.6, "taken": 2.7}
    assert rec.spans[2].args == {"iteration": 3, "sent": {"posted": 4.5}}
    assert "sent" not in second.args


def test_thread_roles_and_what_they_spent():
    assert threads.role("rrfp-lane-stage0_0", False) == "lane"
    assert threads.role("rrfp-waiter-fwd 0->1", False) == "channels"
    assert threads.role(None, False, "gloo_tcp_loop") == "gloo"
    assert threads.role(None, False, "pt_tcpstore") == "store"
    assert threads.role("MainThread", True) == "loop"
    before = {1: ("loop", 1.0, 10, 0, 0.0), 2: ("lane", 2.0, 5, 1, 1.0)}
    after = {
        1: ("loop", 1.5, 13, 0, 0.25),
        2: ("lane", 4.0, 9, 1, 1.5),
        3: ("lane", 0.5, 2, 0, 0.25),
    }
    got = threads.between(before, after)
    assert got["loop"] == pytest.approx([0.5, 3, 0, 0.25])
    assert got["lane"] == pytest.approx([2.5, 6, 0, 0.75])
    if not threads.TASKS.is_dir():
        pytest.skip("no /proc: snapshots are empty here")
    done = threading.Event()
    worker = threading.Thread(target=done.wait, name="rrfp-lane-test")
    worker.start()
    try:
        now = threads.snapshot()
    finally:
        done.set()
        worker.join()
    assert now[threading.main_thread().native_id][0] == "loop"
    assert now[worker.native_id][0] == "lane"
    # the counts are the system's: between what its status file said just before and just after
    main = threading.main_thread().native_id
    first = _switches(main)
    _, cpu, wakes, preempted, queued = threads.snapshot()[main][:5]
    last = _switches(main)
    assert first[0] <= wakes <= last[0] and first[1] <= preempted <= last[1]
    assert first[0] > 0 and cpu > 0 and queued >= 0


def _switches(tid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of thread ``tid``, read plainly."""
    status = (threads.TASKS / str(tid) / "status").read_text()
    got = dict(line.split(":\t") for line in status.splitlines() if "ctxt_switches" in line)
    return int(got["voluntary_ctxt_switches"]), int(got["nonvoluntary_ctxt_switches"])


@pytest.mark.e2e
def test_real_quick_runs_every_kind_of_row_on_real_compute(tmp_path):
    out = tmp_path / "results"
    contenders = (
        "fixed-bfw,ready-bfw,ready-plan,ready-plan-auto-unsplit,torch-1f1b,drop-in-ready-bfw"
    )
    res = rrfp_bench(
        "--real",
        "--quick",
        "--contenders",
        contenders,
        *("--set", "model.n_layer=4", *SMALL_DATA),  # two layers a stage, short sequences
        "--out",
        str(out),
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["unit_ms"] == 0 and doc["real_compute"]
    assert doc["emulated_device_time"] is None and doc["machine"]["load"]
    [wl] = doc["workloads"]
    names = {
        "fixed bfw",
        "ready bfw",
        "ready plan",
        "ready plan auto unsplit",
        "torch 1f1b",
        "drop-in ready bfw",
    }
    assert {s["contender"] for s in wl["summary"]} == names
    # the auto row's model is fitted split and whole, and the bench says what it chose
    auto = CostModel.from_json((out / "cost-gpt-auto-unsplit.json").read_text())
    assert (
        auto.whole is not None
        and CostModel.from_json((out / "cost-gpt.json").read_text()).whole is None
    )
    assert re.search(
        r"gpt, the auto unsplit rows: (stage [\d, ]+ unsplit|all split) \(", res.stdout
    )
    # the parent plans each iteration again to replay it: priced as the ranks priced it
    auto_rows = [r for r in wl["rows"] if r["contender"] == "ready plan auto unsplit"]
    assert auto_rows and all(r["simulated_s"] is not None for r in auto_rows)
    md = (out / "results.md").read_text()
    assert "real compute on cpu" in md and "vs replay" in md
    assert names <= set(table_rows(md))
    # the host table: rrfp's rows (the drop-in included), not torch's
    assert {h["contender"] for h in wl["host"]} == names - {"torch 1f1b"}
    for h in wl["host"]:
        assert h["per_task"]["compute"] > 0 and h["wakes_per_task"]["lane"] > 0
    # the compute table: every row, torch's included, against the one unsplit row (torch 1f1b)
    assert {c["contender"] for c in wl["compute"]} == names
    assert all(c["per_rank_s"] > 0 and c["backward_s"] > 0 for c in wl["compute"])
    assert "over torch 1f1b's (unsplit)" in md
    # the critical path: every row's, torch's included; its compute and gaps fit its iteration
    assert {p["contender"] for p in wl["critical_path"]} == names and "Critical path" in md
    for p in wl["critical_path"]:
        gaps = p["rank_gaps_s"] + p["message_gaps_s"]
        assert p["tasks_s"] > 0 and p["rank_hops"] + p["message_hops"] > 0, p
        assert p["tasks_s"] + gaps <= p["iteration_s"] * (1 + 1e-9), p
    # every rrfp task span carries the lane's own work inside it, and each row's bound is the one
    # of those realized task times (torch's: its spans)
    trace = json.loads((out / "trace-gpt.json").read_text())["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    tasks = [e for e in trace if e["ph"] == "X" and e["name"] != "wait"]
    spans = {}
    for e in tasks:
        if pids[e["pid"]] == "torch 1f1b":
            continue
        c0, c1 = (t * 1e6 for t in e["args"]["compute"])
        assert e["ts"] - 1 <= c0 <= c1 <= e["ts"] + e["dur"] + 1, e
        spans[(pids[e["pid"]], e["args"]["iteration"], e["tid"], e["name"])] = e["args"]
    # a message's stamps follow its way, from the producer's compute to the consumer's decision
    ways = 0
    for (who, it, stage, name), args in spans.items():
        if "arrived" not in args:
            continue
        producer = spans[(who, it, stage - 1 if name[0] == "F" else stage + 1, name)]
        sent, got = producer["sent"], args["arrived"]
        way = [producer["compute"][1], sent["posted"], sent["sent"], got["received"]]
        way += [got["delivered"], *args["decided"], args["compute"][0]]
        assert way == sorted(way) and sent["sent"] <= sent["taken"], (who, it, stage, name)
        ways += 1
    assert ways >= len(names - {"torch 1f1b"}) * 2 * 4  # every row's F and B messages
    for r in wl["rows"]:
        dur = np.zeros((2, 4, 3))
        for e in tasks:
            if pids[e["pid"]] == r["contender"] and e["args"]["iteration"] == r["iteration"]:
                c = e["args"].get("compute")
                took = (c[1] - c[0]) if c else e["dur"] / 1e6
                dur[e["tid"], int(e["name"][1:]), "FBW".index(e["name"][0])] += took
        zero = np.zeros((2, 4))
        split = r["contender"] != "torch 1f1b"
        assert r["lower_bound_s"] == pytest.approx(lower_bound(dur, zero, zero, split), rel=1e-6)
        assert 0 < r["efficiency"] <= 1 + 1e-9


def test_a_microbatch_moves_to_the_device_whole():
    """--device cuda moves each microbatch: a named tuple (the vlm's inputs) stays one."""
    import collections

    import torch

    from rrfp.app.bench.rank import _on

    Inputs = collections.namedtuple("Inputs", "images ids")
    x = (Inputs(torch.ones(1), torch.zeros(2, dtype=torch.long)), [torch.ones(3), None])
    y = _on(torch.device("meta"), x)
    assert type(y[0]) is Inputs and y[0].ids.device.type == "meta" and y[0].ids.dtype == torch.long
    assert isinstance(y[1], list) and y[1][0].device.type == "meta" and y[1][1] is None


def test_paired_parts_split_the_wall_into_compute_cpu_and_queueing():
    spans = [
        span("ready bfw", 0, "F0", 0.0, 1.0, (0.0, 0.6)),
        span("ready bfw", 1, "F0", 0.0, 1.0, (0.0, 0.6)),
        span("fixed bfw", 0, "F0", 0.0, 1.0, (0.0, 0.5)),
        span("fixed bfw", 1, "F0", 0.0, 1.0, (0.0, 0.5)),
        span("fixed bfw", 1, "wait", 1.0, 9.0),
    ]
    threads = [
        {"contender": name, "iteration": 1, "rank": r, "roles": {"lane": [cpu, 1, 0, queued]}}
        for name, cpu, queued in (("ready bfw", 0.2, 0.4), ("fixed bfw", 0.2, 0.3))
        for r in (0, 1)
    ]
    parts = paired_parts(spans, threads, "ready bfw", "fixed bfw")
    assert parts["compute"] == [pytest.approx(1.2)]  # the lanes' wall time, waits left out
    assert parts["lane CPU"] == [pytest.approx(1.0)]
    assert parts["lane queued"] == [pytest.approx(4 / 3)]
