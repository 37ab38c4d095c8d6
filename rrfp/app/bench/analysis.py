"""From measured iterations to the bench's figures: each iteration's lower
bound and the simulator's prediction for the same durations, then per
contender the median and spread of its time, its speedup over fixed 1F1B
(the median of per-iteration ratios: alternated iterations are paired), and
its efficiency against the bound.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, replace

import numpy as np

from rrfp.app.bench.runners import planned_with
from rrfp.app.bench.suite import BASELINE, BenchSpec, Case, Contender, cost_key
from rrfp.core.bounds import lower_bound
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.observe.trace import Span
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import plan_iteration

log = logging.getLogger("rrfp.app.bench.analysis")


@dataclass(frozen=True)
class IterationWork:
    """An iteration's task costs in seconds of emulated device time, one per (iteration, split)."""

    durations: np.ndarray  # [S, M, 3] units (S x V global stages with virtual stages)
    lat_fwd: np.ndarray  # [S, M] units (zero on the V turn: no message)
    lat_bwd: np.ndarray
    split: bool
    unit_s: float
    rank_of: tuple[int, ...] | None = None  # virtual stages: the rank of each global stage

    @property
    def lower_bound_s(self) -> float:
        return (
            lower_bound(self.durations, self.lat_fwd, self.lat_bwd, self.split, self.rank_of)
            * self.unit_s
        )


def virtual_layout(spec: BenchSpec, contender: Contender | None) -> VirtualLayout | None:
    """The contender's virtual stages (None: one stage per rank, or a torch schedule)."""
    if contender is None or contender.is_torch or contender.virtual == 1:
        return None
    return VirtualLayout(spec.pp, contender.virtual, contender.placement)


def iteration_work(
    spec: BenchSpec,
    var: Variability,
    cost: CostModel | None,
    iteration: int,
    features: list[dict] | None,
    split: bool,
    contender: Contender | None = None,
) -> IterationWork:
    """The durations ``contender``'s ranks spent (TaskTimes, with its virtual layout's local
    stage times)."""
    layout = virtual_layout(spec, contender)
    S, M, seed = spec.pp if layout is None else layout.num_stages, spec.n_microbatches, spec.seed
    times = TaskTimes(var, seed, split, cost, layout=layout)
    lat_f, lat_b = times.latencies(iteration, S, M)
    if layout is None:
        return IterationWork(
            times.realized(iteration, S, M, features), lat_f, lat_b, split, spec.unit_ms / 1000
        )
    for g in range(S - 1):
        if layout.is_local(g, g + 1):  # the V turn sends nothing
            lat_f[g] = lat_b[g + 1] = 0.0
    return IterationWork(
        times.realized(iteration, S, M, features),
        lat_f,
        lat_b,
        split,
        spec.unit_ms / 1000,
        tuple(layout.rank_of(g) for g in range(S)),
    )


def simulated_s(
    spec: BenchSpec,
    var: Variability,
    cost: CostModel | None,
    contender: Contender,
    iteration: int,
    work: IterationWork,
    features: list[dict] | None,
    plan_order: list[int] | None = None,
    replay_var: Variability | None = None,
) -> float | None:
    """The simulator's time for this rrfp contender on the same durations (None for torch's
    schedules). A planned hint is planned again here from the same inputs: the planner is
    deterministic, so it is the plan the ranks followed (``plan_order``, theirs, is checked; None if
    it differs)."""
    if contender.is_torch:
        return None
    hint, dispatch, budget = (
        resolve(contender.hint),
        Dispatch.parse(contender.dispatch),
        Budget.parse(spec.budget),
    )
    layout = virtual_layout(spec, contender)
    if hint.planned:
        hint, made = plan_iteration(
            TaskTimes(var, spec.seed, work.split, cost, layout=layout),
            iteration,
            spec.pp,
            spec.n_microbatches,
            budget,
            dispatch,
            features,
        )
        if plan_order is not None and list(made.order) != list(plan_order):
            log.warning(
                "%s iteration %d: the ranks planned %s, the parent %s: not simulated",
                contender.name,
                iteration,
                plan_order,
                list(made.order),
            )
            return None
    cfg = SimConfig(
        spec.pp,
        spec.n_microbatches,
        hint,
        dispatch,
        budget,
        replay_var or var,
        seed=spec.seed,
        iteration=iteration,
        split=work.split,
        durations=work.durations.tolist(),
        virtual=contender.virtual,
        placement=contender.placement,
    )
    return simulate(cfg).makespan * work.unit_s


KINDS = "FBW"


def is_task(sp: Span) -> bool:
    """Whether a span is a task's (F3, B0, W7), not a wait's or a phase's."""
    return sp.name[:1] in KINDS and sp.name[1:].isdigit()


def stage_of(sp: Span) -> int:
    """The stage a task span ran: torch's schedules record it apart from their row."""
    return sp.args.get("torch_stage", sp.stage)


def task_times(sp: Span) -> tuple[float, float]:
    """When a task's own work ran: the lane's times when the trace has them (the host time around
    it excluded), else the span's (torch's schedules: its call)."""
    compute = sp.args.get("compute")
    return (compute[0], compute[1]) if compute else (sp.start, sp.end)


def task_seconds(sp: Span) -> float:
    """A task's realized time (``task_times``)."""
    start, end = task_times(sp)
    return end - start


def realized_work(spec: BenchSpec, contender: Contender, spans: list[Span]) -> IterationWork:
    """Real compute: one iteration's task times as its spans measured them (seconds), no
    latency: the bound and the replay of what the ranks really computed."""
    if contender.is_torch:
        from rrfp.app.bench import torch_schedules as ts

        per_rank = ts.stages_per_rank(contender.hint)
        layout = VirtualLayout(spec.pp, per_rank, ts.placement_of(contender.hint))
    else:
        layout = VirtualLayout(spec.pp, contender.virtual, contender.placement)
    S, M = layout.num_stages, spec.n_microbatches
    dur = np.zeros((S, M, 3))
    for sp in spans:
        if not is_task(sp):
            continue
        dur[stage_of(sp), int(sp.name[1:]), KINDS.index(sp.name[0])] += task_seconds(sp)
    lat = np.zeros((S, M))
    rank_of = tuple(layout.rank_of(g) for g in range(S)) if layout.virtual > 1 else None
    return IterationWork(dur, lat, lat.copy(), contender.split, 1.0, rank_of)


def annotate(
    spec: BenchSpec,
    case: Case,
    var: Variability,
    cost: CostModel | dict | None,
    rows: list[dict],
    iterations: list[dict],
    spans: list[Span] | None = None,
) -> None:
    """Add ``lower_bound_s``, ``efficiency`` and ``simulated_s`` to every row, in place. With real
    compute the durations are each row's own, from ``spans``, and ``cost`` is by ``cost_key``
    (the models the planned hints planned with)."""
    if spec.ep > 1:  # durations from the routing, per replica: the preset's draw is not them
        for r in rows:
            r["lower_bound_s"] = r["efficiency"] = r["simulated_s"] = None
        return
    if spec.real:
        _annotate_real(spec, case, var, cost or {}, rows, iterations, spans or [])
        return
    feats = {it["iteration"]: it["features"] for it in iterations}
    contenders = {c.name: c for c in case.contenders}
    works: dict[tuple[int, bool], IterationWork] = {}
    for r in rows:
        contender, it = contenders[r["contender"]], r["iteration"]
        features = feats.get(it) if cost else None
        key = (it, contender.split, virtual_layout(spec, contender))
        if key not in works:
            works[key] = iteration_work(spec, var, cost, it, features, contender.split, contender)
        work = works[key]
        r["lower_bound_s"] = work.lower_bound_s
        r["efficiency"] = work.lower_bound_s / r["wall_s"]
        r["simulated_s"] = simulated_s(
            spec, var, cost, contender, it, work, features, r.get("plan_order")
        )


def _annotate_real(
    spec: BenchSpec,
    case: Case,
    var: Variability,
    costs: dict,
    rows: list[dict],
    iterations: list[dict],
    spans: list[Span],
) -> None:
    """Real compute: each row's bound from its own realized task times, and ``simulated_s`` the
    simulator replaying them with no host time and no latency (what the runtime added shows as
    measured over replay)."""
    feats = {it["iteration"]: it["features"] for it in iterations}
    contenders = {c.name: c for c in case.contenders}
    by_row: dict[tuple[str, int], list[Span]] = {}
    for sp in spans:
        by_row.setdefault((sp.process, sp.args.get("iteration", 0)), []).append(sp)
    quiet = replace(var, comm=0.0, comm_jitter=0.0)
    # each contender's plan prices its tasks as its ranks did: one choice per row, not per iteration
    priced = {
        c.name: planned_with(spec, c, var, costs.get(cost_key(case.name, c)))
        for c in case.contenders
    }
    for r in rows:
        contender, it = contenders[r["contender"]], r["iteration"]
        work = realized_work(spec, contender, by_row.get((contender.name, it), []))
        r["lower_bound_s"] = work.lower_bound_s
        r["efficiency"] = work.lower_bound_s / r["wall_s"]
        cost = priced[contender.name]
        r["simulated_s"] = simulated_s(
            spec, var, cost, contender, it, work, feats.get(it), r.get("plan_order"), quiet
        )


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.low, "max": self.high}


@dataclass(frozen=True)
class Summary:
    """One contender on one workload, over its measured iterations."""

    contender: str
    iterations: int
    wall_s: Spread
    speedup: Spread | None  # fixed 1F1B's time / this one's, per iteration
    efficiency: Spread | None  # None: no bound (expert parallelism's routed durations)
    vs_simulated: Spread | None  # measured / simulated - 1
    peak_inflight: (
        float | None
    )  # microbatches one stage held at once (the max over ranks and iterations)
    decision_us: float | None
    plan_s: float | None
    plan_waited_s: float | None
    overhead_s: Spread | None = (
        None  # drop-in: the step's time outside the executor's iteration and plan
    )

    def as_dict(self) -> dict:
        doc = {
            k: getattr(self, k)
            for k in (
                "contender",
                "iterations",
                "peak_inflight",
                "decision_us",
                "plan_s",
                "plan_waited_s",
            )
        }
        for k in ("wall_s", "speedup", "efficiency", "vs_simulated", "overhead_s"):
            doc[k] = None if getattr(self, k) is None else getattr(self, k).as_dict()
        return doc


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _paired(rows: list[dict], first: str, second: str) -> list[tuple[float, float]]:
    """Both contenders' times, iteration by iteration (both ran it)."""
    a = {r["iteration"]: r["wall_s"] for r in rows if r["contender"] == first}
    b = {r["iteration"]: r["wall_s"] for r in rows if r["contender"] == second}
    return [(a[i], b[i]) for i in sorted(a.keys() & b.keys())]


def paired_ratios(rows: list[dict], numerator: str, denominator: str) -> list[float]:
    """``numerator``'s time over ``denominator``'s, iteration by iteration (both ran it)."""
    return [a / b for a, b in _paired(rows, numerator, denominator)]


def paired_beyond_replay(rows: list[dict], numerator: str, denominator: str) -> list[float]:
    """Real compute: per iteration, ``numerator``'s time over its replay divided by
    ``denominator``'s. A replay is the simulator running the row's dispatch and hint on the row's
    own realized task times with no host time and no latency, so this is what one runtime added
    relative to the other with the compute and the ideal order taken out: above 1,
    ``numerator``'s dispatch cost more than the other's."""
    a = {r["iteration"]: r for r in rows if r["contender"] == numerator}
    b = {r["iteration"]: r for r in rows if r["contender"] == denominator}
    out = []
    for i in sorted(a.keys() & b.keys()):
        x, y = a[i], b[i]
        if x.get("simulated_s") and y.get("simulated_s"):
            out.append((x["wall_s"] / x["simulated_s"]) / (y["wall_s"] / y["simulated_s"]))
    return out


def paired_differences(rows: list[dict], first: str, second: str) -> list[float]:
    """``first``'s time minus ``second``'s in seconds, iteration by iteration."""
    return [a - b for a, b in _paired(rows, first, second)]


def summarize(rows: list[dict], contenders: list[str]) -> list[Summary]:
    out = []
    for name in contenders:
        mine = [r for r in rows if r["contender"] == name]
        if not mine:
            continue
        sims = [r["wall_s"] / r["simulated_s"] - 1 for r in mine if r.get("simulated_s")]
        peaks = [r["peak_inflight"] for r in mine if r["peak_inflight"] is not None]
        out.append(
            Summary(
                name,
                len(mine),
                Spread.of([r["wall_s"] for r in mine]),
                Spread.of(paired_ratios(rows, BASELINE, name)),
                Spread.of([r["efficiency"] for r in mine if r.get("efficiency") is not None]),
                Spread.of(sims),
                max(peaks) if peaks else None,
                _median([r["decision_us"] for r in mine]),
                _median([r["plan_s"] for r in mine]),
                _median([r.get("plan_waited_s") for r in mine]),
                Spread.of([r["overhead_s"] for r in mine if r.get("overhead_s") is not None]),
            )
        )
    return out


@dataclass(frozen=True)
class Paired:
    """One contender's time over another's, iteration by iteration (alternated runs are paired):
    the median, its spread, and after how many iterations the running median stayed within
    ``SETTLED`` of the final one."""

    median: float
    low: float
    high: float
    q1: float
    q3: float
    n: int
    settled_after: int

    @classmethod
    def of(cls, ratios: list[float]) -> Paired | None:
        if not ratios:
            return None
        final = statistics.median(ratios)
        q1, _, q3 = (
            statistics.quantiles(ratios, n=4, method="inclusive")
            if len(ratios) > 1
            else [final] * 3
        )
        settled = len(ratios)
        for k in range(len(ratios), 0, -1):
            if abs(statistics.median(ratios[:k]) / final - 1) > SETTLED:
                break
            settled = k
        return cls(final, min(ratios), max(ratios), q1, q3, len(ratios), settled)

    def as_dict(self) -> dict:
        return dict(vars(self))


SETTLED = 0.01  # a running median within 1% of the final one has settled


HOST_PARTS = ("decide", "to lane", "from lane", "after")


def host_parts(sp: Span) -> dict[str, float] | None:
    """Where one rrfp task's host time went, in seconds (None when its trace has no lane times):
    the decisions that picked it, from the task's start to the lane running it (its inputs taken,
    the hand-off to the lane thread), from the lane's end to the loop having the result, and
    after (its messages posted, the loop's turn that lets the senders issue them)."""
    compute, returned = sp.args.get("compute"), sp.args.get("returned")
    if compute is None or returned is None:
        return None
    return {
        "decide": sp.args.get("decide_s", 0.0),
        "to lane": compute[0] - sp.start,
        "from lane": returned - compute[1],
        "after": sp.end - returned,
    }


@dataclass(frozen=True)
class HostSummary:
    """One rrfp contender's host time on real compute: per task, the median of each part
    (seconds); per rank and iteration (medians over iterations of the mean over ranks), the
    wall time split into compute, host time around the tasks, waits for a message, and the rest
    (the loop's other work between tasks); and by thread role the wake-ups per task, and CPU
    seconds and seconds queued for a core (runnable, not running) per rank and iteration."""

    contender: str
    per_task: dict[str, float]
    per_iteration: dict[str, float]
    wakes_per_task: dict[str, float]
    cpu_s: dict[str, float]
    queued_s: dict[str, float]

    def as_dict(self) -> dict:
        return dict(vars(self))


def rank_of(sp: Span) -> int:
    """The rank a span ran on: its ``rank`` where a rank holds several stages, else its row."""
    return sp.args.get("rank", sp.stage)


def host_summary(name: str, spans: list[Span], threads: list[dict]) -> HostSummary | None:
    mine = [sp for sp in spans if sp.process == name]
    parts = [p for sp in mine if sp.name != "wait" and (p := host_parts(sp)) is not None]
    if not parts:
        return None
    per_task = {k: statistics.median(p[k] for p in parts) for k in HOST_PARTS}
    per_task["compute"] = statistics.median(task_seconds(sp) for sp in mine if sp.name != "wait")
    split: dict[str, list[float]] = {}
    by: dict[tuple[int, int], list[Span]] = {}
    for sp in mine:
        by.setdefault((sp.args.get("iteration", 0), rank_of(sp)), []).append(sp)
    per_it: dict[int, list[dict]] = {}
    for (it, _), group in by.items():
        tasks = sorted((sp for sp in group if sp.name != "wait"), key=lambda sp: sp.start)
        waits = {(sp.start, sp.end) for sp in group if sp.name == "wait"}  # one per local stage
        host = [host_parts(sp) for sp in tasks]
        compute = sum(task_seconds(sp) for sp in tasks)
        around = sum(sum(p.values()) for p in host if p)
        waited = sum(e - s for s, e in waits)
        if not tasks:
            continue
        # the rank's own window: from its first wait or task to its last task's end
        window = tasks[-1].end - min([tasks[0].start, *(s for s, _ in waits)])
        per_it.setdefault(it, []).append(
            {
                "compute": compute,
                "host": around,
                "wait": waited,
                "other": max(0.0, window - compute - around - waited),
            }
        )
    for ranks in per_it.values():
        for k in ("compute", "host", "wait", "other"):
            split.setdefault(k, []).append(sum(r[k] for r in ranks) / len(ranks))
    tasks_per_rank = len(parts) / max(1, len(by))
    wakes: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    queued: dict[str, list[float]] = {}
    for t in threads:
        if t["contender"] != name:
            continue
        for who, (cpu_s, woke, _, *waited) in t["roles"].items():
            wakes.setdefault(who, []).append(woke / tasks_per_rank)
            cpu.setdefault(who, []).append(cpu_s)
            queued.setdefault(who, []).append(waited[0] if waited else 0.0)
    return HostSummary(
        name,
        per_task,
        {k: statistics.median(v) for k, v in split.items()},
        {k: statistics.median(v) for k, v in wakes.items()},
        {k: statistics.median(v) for k, v in cpu.items()},
        {k: statistics.median(v) for k, v in queued.items()},
    )


@dataclass(frozen=True)
class ComputeSummary:
    """One contender's real compute (seconds, medians over iterations): its tasks' compute per rank
    and iteration, and its backward (B and W, or the unsplit B) per microbatch and rank, so a
    split backward's cost shows beside an unsplit one's on the same stages."""

    contender: str
    split: bool
    per_rank_s: float
    backward_s: float | None  # None: no backward task ran

    def as_dict(self) -> dict:
        return dict(vars(self))


def compute_summary(contender: Contender, spans: list[Span]) -> ComputeSummary | None:
    """Real compute: ``contender``'s F, B and W spans summed per rank and iteration, and B + W per
    microbatch and rank (a rank's stages together: torch's two-stage schedules hold half stages)."""
    ranks: dict[int, dict[int, float]] = {}  # iteration -> rank -> compute
    back: dict[int, dict[tuple[int, int], float]] = {}  # iteration -> (rank, microbatch) -> B + W
    for sp in spans:
        if sp.process != contender.name or not is_task(sp):
            continue
        it, rank, t = sp.args.get("iteration", 0), rank_of(sp), task_seconds(sp)
        mine = ranks.setdefault(it, {})
        mine[rank] = mine.get(rank, 0.0) + t
        if sp.name[0] != "F":
            theirs = back.setdefault(it, {})
            key = (rank, int(sp.name[1:]))
            theirs[key] = theirs.get(key, 0.0) + t
    if not ranks:
        return None
    per_rank = [statistics.fmean(r.values()) for r in ranks.values()]
    backward = [statistics.fmean(b.values()) for b in back.values() if b]
    return ComputeSummary(
        contender.name,
        contender.split,
        statistics.median(per_rank),
        statistics.median(backward) if backward else None,
    )


def paired_parts(
    spans: list[Span], threads: list[dict], numerator: str, denominator: str
) -> dict[str, list[float]]:
    """Real compute: per iteration, ``numerator`` over ``denominator`` for what the wall time is
    made of, summed over the ranks: ``compute`` (the lanes' work, wall clock), ``lane CPU`` (the
    CPU time the lane threads used) and ``lane queued`` (their time runnable but waiting for a
    core). Equal CPU with longer compute is the machine's scheduler, not the runtime."""
    sums: dict[tuple[str, int], dict[str, float]] = {}
    for sp in spans:
        if sp.name != "wait" and sp.process in (numerator, denominator):
            key = (sp.process, sp.args.get("iteration", 0))
            acc = sums.setdefault(key, {})
            acc["compute"] = acc.get("compute", 0.0) + task_seconds(sp)
    for t in threads:
        lane = t["roles"].get("lane")
        if lane is None or t["contender"] not in (numerator, denominator):
            continue
        acc = sums.setdefault((t["contender"], t["iteration"]), {})
        acc["lane CPU"] = acc.get("lane CPU", 0.0) + lane[0]
        if len(lane) > 3:
            acc["lane queued"] = acc.get("lane queued", 0.0) + lane[3]
    out: dict[str, list[float]] = {}
    for (who, it), mine in sums.items():
        if who != numerator or (denominator, it) not in sums:
            continue
        theirs = sums[(denominator, it)]
        for k, v in mine.items():
            if theirs.get(k):
                out.setdefault(k, []).append(v / theirs[k])
    return out
