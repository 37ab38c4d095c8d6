"""The bench's results folder: results.json (every measured iteration, the
config and the machine), results.md (one table per workload), one timeline
PNG per contender for the same iteration, and a Chrome trace per workload.
Every file is written atomically.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rrfp.app.bench.analysis import (
    HOST_PARTS,
    SETTLED,
    ComputeSummary,
    HostSummary,
    Paired,
    Spread,
    Summary,
    paired_beyond_replay,
    paired_differences,
    paired_parts,
    paired_ratios,
)
from rrfp.app.bench.critical_path import CriticalPath
from rrfp.app.bench.suite import BASELINE, BenchSpec, Case, file_slug
from rrfp.observe.plot import plot_timelines
from rrfp.observe.trace import Span, chrome_trace, write_atomic, write_json

EMULATED = (
    "Device time is emulated on CPU: each task holds its stage's compute lane for its emulated "
    "duration (units x unit_ms; the tiny model's real compute runs inside that time), so the "
    "figures compare schedules and dispatch, not hardware."
)
REAL = (
    "Real compute: each task takes what the model's compute takes on this machine, with no "
    "emulated time (on CPU one compute thread per rank). "
    "Efficiency is each row's own lower bound "
    "(its realized task times: busiest rank, or longest microbatch chain) over its time; vs replay "
    "is its time over the simulator replaying those task times with no host time and no latency, "
    "minus one: what the runtime and the transport added."
)
MIN_REPS = 3  # fewer measured iterations per contender than this is a smoke run, not a benchmark
SMOKE = (
    "SMOKE RUN, NOT A BENCHMARK: {reps} measured iteration(s) per contender; the figures below "
    "show that every contender runs, not how fast. For figures, run without --quick (or with "
    "--reps {min} or more)."
)
# (headline, its ablation): each pair differs in dispatch alone
ABLATIONS = (
    ("ready bfw", "fixed bfw", "same order and memory"),
    ("ready zbh1", "fixed zbh1", "same order and memory"),
    ("ready plan", "fixed plan", "the plan's predicted run replayed as a fixed order"),
    (
        "ready plan last unsplit",
        "fixed plan last unsplit",
        "the plan's predicted run replayed as a fixed order",
    ),
    (
        "ready plan auto unsplit",
        "fixed plan auto unsplit",
        "the plan's predicted run replayed as a fixed order",
    ),
)
# (with the overlap, without): the same hint, budget and dispatch, the all-to-alls yielding or not
OVERLAPS = (("ready bfw overlap", "ready bfw"), ("ready plan overlap", "ready plan"))
# (some stages unsplit, every stage split): the same hint and dispatch
UNSPLIT_PAIRS = (
    ("ready plan auto unsplit", "ready plan"),
    ("ready plan auto unsplit", "ready plan last unsplit"),
    ("ready plan last unsplit", "ready plan"),
    ("ready bfw last unsplit", "ready bfw"),
    ("ready zbh1 last unsplit", "ready zbh1"),
)
# (ours, torch's): rrfp's best against torch.distributed.pipelining's schedules, paired like the
# rest
AGAINST_TORCH = (
    ("ready plan", "torch 1f1b"),
    ("ready plan", "torch zb"),
    ("ready plan last unsplit", "torch 1f1b"),
    ("ready plan last unsplit", "torch zb"),
    ("ready plan auto unsplit", "torch 1f1b"),
    ("ready plan auto unsplit", "torch zb"),
    ("ready bfw", "torch zb"),
    ("ready plan", "torch dualpipev"),
    ("ready bfw", "torch dualpipev"),
    ("ready plan overlap", "torch zb"),
    ("ready plan overlap", "torch dualpipev"),
    ("ready plan v2", "torch zb"),
    ("ready plan v2", "torch dualpipev"),
    ("ready bfw v2", "torch zb"),
    ("drop-in ready plan", "torch 1f1b"),
    ("drop-in ready plan", "torch zb"),
    ("drop-in ready bfw", "torch zb"),
)
EQUAL_MEMORY_TO = "torch zb"  # the table marks the rows that hold no more than this one (ZB-V)
# (through ScheduleReady, the executor directly): each pair differs in the surface alone
DROP_IN_PAIRS = (("drop-in ready bfw", "ready bfw"), ("drop-in ready plan", "ready plan"))


@dataclass
class CaseResult:
    case: Case
    rows: list[dict]
    iterations: list[dict]
    spans: list[Span]
    summaries: list[Summary]
    cost_model: str | None = None  # the calibrated model's file, for data-driven durations
    skipped: dict[str, str] = field(default_factory=dict)  # contender -> why it did not run
    threads: list[dict] = field(default_factory=list)  # per run and rank: CPU and wake-ups by role
    hosts: list[HostSummary] = field(default_factory=list)  # real compute: rrfp's host time
    computes: list[ComputeSummary] = field(default_factory=list)  # real compute: per row
    paths: list[CriticalPath] = field(default_factory=list)  # real compute: per row


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{format(v, spec)}{suffix}"


def _range(s: Spread | None, spec: str, scale: float = 1.0) -> str:
    return "—" if s is None else f"{format(s.low * scale, spec)}..{format(s.high * scale, spec)}"


def markdown(spec: BenchSpec, results: list[CaseResult], machine: dict) -> str:
    lines = ["# rrfp bench", ""]
    if spec.reps < MIN_REPS:
        lines += [SMOKE.format(reps=spec.reps, min=MIN_REPS), ""]
    time_is = (
        f"real compute on {spec.device}"
        if spec.real
        else f"{spec.unit_ms:g} ms of emulated device time per unit (one average forward)"
    )
    load = f", load average {machine['load']}" if machine.get("load") else ""
    load += ", each rank pinned to a core of its own" if spec.pin else ""
    lines += [
        f"PP={spec.pp} TP={spec.tp} M={spec.n_microbatches}, {spec.reps} measured iteration(s) per "
        f"contender after one warm-up, contenders reordered each iteration (balanced for position "
        f"and predecessor); {time_is}; ready budget "
        f"{spec.budget}. {machine['cpus']} CPUs{load}, torch {machine['torch']}, "
        f"{machine['hostname']}, {machine['date']}.",
        "",
        REAL if spec.real else EMULATED,
        "",
    ]
    for res in results:
        c = res.case
        source = (
            "task times from its data and this machine, as computed"
            if spec.real
            else f"task times from its data (cost model calibrated here: {res.cost_model}) x the "
            f"{c.preset} preset's noise"
            if res.cost_model
            else f"task times from the {c.preset} preset"
        )
        if spec.ep > 1:
            source += (
                f", on pp {spec.pp} x ep {spec.ep} ranks (each replica its own data and duration "
                "seed; in emulated time the MoE tasks' experts and all-to-alls timed by their "
                "routing, the rest by the preset: no bound and no simulator, which know the "
                "preset alone)"
            )
        sets = f" with {', '.join(c.overrides)}" if c.overrides else ""
        lines += [
            f"## {c.name}",
            "",
            f"{Path(c.config).name}{sets}: {source}.",
            "",
            "| contender | ms/iteration (median) | min..max | speedup vs fixed 1F1B | min..max "
            f"| peak in-flight | efficiency | {'vs replay' if spec.real else 'vs simulator'} "
            "| decision µs | plan ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        zb = next((s.peak_inflight for s in res.summaries if s.contender == EQUAL_MEMORY_TO), None)
        for s in res.summaries:
            sim = None if s.vs_simulated is None else s.vs_simulated.median
            mark = (
                " ≤"
                if zb is not None and s.peak_inflight is not None and s.peak_inflight <= zb + 1e-9
                else ""
            )
            lines.append(
                f"| {s.contender} | {s.wall_s.median * 1e3:.1f} | {_range(s.wall_s, '.1f', 1e3)} | "
                f"{_fmt(s.speedup and s.speedup.median, '.3f', 'x')} | {_range(s.speedup, '.3f')} "
                f"| {_fmt(s.peak_inflight, 'g')}{mark} | "
                f"{_fmt(s.efficiency and s.efficiency.median, '.3f')} | "
                f"{_fmt(sim, '+.1%')} | {_fmt(s.decision_us, '.1f')} | "
                f"{_fmt(s.plan_s and s.plan_s * 1e3, '.2f')} |"
            )
        lines.append("")
        lines += memory_lines(res.summaries)
        if zb is not None:
            lines.append(
                f"≤: peak in-flight at or below {EQUAL_MEMORY_TO}'s ({zb:g}): equal or lower "
                "memory than torch's ZB-V."
            )
        pairs = [
            (h, a, f"Ablation, dispatch alone: {h} vs {a} ({what})") for h, a, what in ABLATIONS
        ]
        pairs += [
            (h, a, f"Overlap ablation, the all-to-alls yielding to a W or not: {h} vs {a}")
            for h, a in OVERLAPS
        ]
        pairs += [
            (h, a, f"Stages unsplit or split, nothing else changed: {h} vs {a}")
            for h, a in UNSPLIT_PAIRS
        ]
        pairs += [
            (ours, theirs, f"Against torch: {ours} vs {theirs}") for ours, theirs in AGAINST_TORCH
        ]
        for headline, other, title in pairs:
            p = Paired.of(paired_ratios(res.rows, other, headline))
            if p:
                lines.append(
                    f"{title}: median {p.median:.3f}x (min {p.low:.3f}, max {p.high:.3f}, IQR "
                    f"{p.q1:.3f}..{p.q3:.3f}; {p.n} paired iterations, the median within "
                    f"{SETTLED:.0%} of its final value from iteration {p.settled_after} on)."
                )
                beyond = Paired.of(paired_beyond_replay(res.rows, headline, other))
                if spec.real and beyond and not title.startswith("Against"):
                    lines.append(
                        f"  The order and the compute taken out ({headline}'s time over its "
                        f"replay, over {other}'s): median {beyond.median:.3f} (IQR "
                        f"{beyond.q1:.3f}..{beyond.q3:.3f}, min {beyond.low:.3f}, max "
                        f"{beyond.high:.3f}): above 1, {headline}'s runtime added more."
                    )
                parts = paired_parts(res.spans, res.threads, headline, other)
                if spec.real and parts and not title.startswith("Against"):
                    said = "; ".join(
                        f"{k} {p.median:.3f} (IQR {p.q1:.3f}..{p.q3:.3f})"
                        for k, v in parts.items()
                        if (p := Paired.of(v)) is not None
                    )
                    lines.append(
                        f"  Per iteration, {headline} over {other}, summed over the ranks (paired "
                        f"medians): {said}."
                    )
        for dropin, direct in DROP_IN_PAIRS:
            ratios = paired_ratios(res.rows, dropin, direct)
            extra = next((s.overhead_s for s in res.summaries if s.contender == dropin), None)
            if ratios and extra is not None:
                lines.append(
                    f"Drop-in, the surface alone: {dropin} took {statistics.median(ratios):.3f}x "
                    f"the time of {direct} (paired median, min {min(ratios):.3f}, max "
                    f"{max(ratios):.3f}), "
                    f"{statistics.median(paired_differences(res.rows, dropin, direct)) * 1e3:+.1f} "
                    f"ms per iteration (median); its step spent {extra.median * 1e3:.2f} ms "
                    f"(median, {extra.low * 1e3:.2f}..{extra.high * 1e3:.2f}) outside the "
                    "executor's iteration and plan."
                )
        for s in res.summaries:
            if s.plan_s is not None:
                when = (
                    "planned when its step started (ScheduleReady has no prepare)"
                    if s.overhead_s is not None
                    else "planned one ahead in a thread while the previous ran"
                )
                lines.append(
                    f"{s.contender}: each iteration {when}: "
                    f"median {s.plan_s * 1e3:.2f} ms of planning, "
                    f"{s.plan_waited_s * 1e3:.2f} ms waited at the iteration's start."
                )
        if res.computes:
            lines += ["", *compute_lines(res.computes), ""]
        if res.paths:
            lines += ["", *critical_path_lines(res.paths), ""]
        if res.hosts:
            lines += ["", *host_lines(res.hosts), ""]
        if not any(s.contender == BASELINE for s in res.summaries):
            lines.append(f"No speedups: {BASELINE} did not run.")
        for name, why in res.skipped.items():
            lines.append(f"Not run: {name}: {why}.")
        lines += [
            "Peak in-flight: the most microbatches one stage (rank) held activations for, the "
            "memory a speedup was bought with (fixed 1F1B holds PP; torch's ZB-V counts its two "
            "half stages as halves). Speedups are medians of per-iteration ratios. "
            + (
                "Efficiency and vs replay: see above."
                if spec.real
                else "Efficiency: the lower bound of the iteration's realized durations (busiest "
                "stage, or longest microbatch chain) over the measured time. vs simulator: "
                "measured over the simulator's time for the same durations, minus one (rrfp "
                "contenders only); well above zero, real compute (sharing this machine's CPUs) "
                "outlasted the emulated durations, and a larger --unit-ms separates the schedules "
                "from the CPU load."
            ),
            "",
        ]
    return "\n".join(lines)


ROLES = ("loop", "lane", "channels", "gloo", "heartbeat", "store", "planner", "other")


def compute_lines(computes: list[ComputeSummary]) -> list[str]:
    """Each row's compute per rank and iteration, and its backward against the unsplit one's: what
    the split backward costs, beside the bubbles it fills."""
    ref = next(
        (c for c in computes if c.contender == BASELINE and c.backward_s),
        next((c for c in computes if not c.split and c.backward_s), None),
    )
    lines = [
        "Compute (real, medians over iterations): the tasks' compute per rank and iteration, the "
        "backward (B + W, or the unsplit B) per microbatch and rank, and that backward over "
        + (
            f"{ref.contender}'s (unsplit)"
            if ref
            else "an unsplit row's (none ran: add fixed-1f1b or torch-1f1b)"
        )
        + ".",
        "",
        "| contender | split | compute ms per rank and iteration | backward ms per microbatch "
        "and rank | B + W over the unsplit backward |",
        "|---|---|---:|---:|---:|",
    ]
    for c in computes:
        ratio = c.backward_s / ref.backward_s if ref and c.backward_s else None
        lines.append(
            f"| {c.contender} | {'B, W' if c.split else 'unsplit'} | {c.per_rank_s * 1e3:.1f} | "
            f"{_fmt(c.backward_s and c.backward_s * 1e3, '.2f')} | {_fmt(ratio, '.3f', 'x')} |"
        )
    return lines


def critical_path_lines(paths: list[CriticalPath]) -> list[str]:
    """Each row's critical path: the compute on it, and the gaps between its tasks on one rank
    and across ranks, so that what the runtime costs shows beside what torch's schedules cost."""
    lines = [
        "Critical path (real compute; medians over iterations): walking back from each "
        "iteration's last task to whichever came last of the task before it on its rank and the "
        "task whose output it needed: the compute of the tasks on it, the gaps after a task on the "
        "same rank (hand-off, decision, the next task starting) and after a task on another rank "
        "(the message: posting, transport, delivery, the next task starting), and their share of "
        "the iteration (first task's start to last task's end). torch's task times are its calls, "
        "so its host time inside a call counts as compute: its gaps are a lower bound.",
        "",
        "| contender | compute ms | same-rank gaps ms | hops | µs each | message gaps ms | hops "
        "| µs each | gaps over the iteration |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in paths:
        each = [
            _fmt(gaps / hops * 1e6 if hops else None, ".0f")
            for gaps, hops in ((p.rank_gaps_s, p.rank_hops), (p.message_gaps_s, p.message_hops))
        ]
        share = (p.rank_gaps_s + p.message_gaps_s) / p.iteration_s if p.iteration_s else None
        lines.append(
            f"| {p.contender} | {p.tasks_s * 1e3:.1f} | {p.rank_gaps_s * 1e3:.2f} | "
            f"{p.rank_hops:g} | {each[0]} | {p.message_gaps_s * 1e3:.2f} | {p.message_hops:g} | "
            f"{each[1]} | {_fmt(share and share * 100, '.1f', '%')} |"
        )
    return lines


def host_lines(hosts: list[HostSummary]) -> list[str]:
    """rrfp's host time around each task on real compute, and what its threads did."""
    lines = [
        "Host time around each task (rrfp rows; medians over tasks, µs): decide (the decisions "
        "that picked it), to lane (inputs taken, handed to the lane thread, the lane starting it), "
        "from lane (the lane's end to the loop having the result), after (posting its messages, "
        "the loop's turn for the senders). Per rank and iteration (ms, medians over iterations of "
        "the mean over ranks): compute, host (those four, summed), waits for a message, other "
        "(the loop between tasks). Wake-ups per task, and CPU ms and ms queued for a core "
        "(runnable, not running) per rank and iteration, by thread (loop, lane, channels' "
        "waiter threads, gloo's transport loop, heartbeat, "
        "the store's threads, planner, other).",
        "",
        "| contender | compute ms/task | decide | to lane | from lane | after "
        "| compute ms | host ms | wait ms | other ms | wake-ups/task "
        f"{'/'.join(ROLES)} | CPU ms {'/'.join(ROLES)} | queued ms loop/lane |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h in hosts:
        t, it = h.per_task, h.per_iteration
        wakes = "/".join(_fmt(h.wakes_per_task.get(r), ".1f") for r in ROLES)
        cpu = "/".join(_fmt(h.cpu_s.get(r) and h.cpu_s[r] * 1e3, ".0f") for r in ROLES)
        lines.append(
            f"| {h.contender} | {t['compute'] * 1e3:.2f} | "
            + " | ".join(f"{t[k] * 1e6:.0f}" for k in HOST_PARTS)
            + " | "
            + " | ".join(
                f"{it.get(k, 0.0) * 1e3:.1f}" for k in ("compute", "host", "wait", "other")
            )
            + f" | {wakes} | {cpu} | "
            + "/".join(_fmt(h.queued_s.get(r) and h.queued_s[r] * 1e3, ".0f") for r in ROLES[:2])
            + " |"
        )
    return lines


def memory_lines(summaries: list[Summary]) -> list[str]:
    """Each speedup beside the memory it was bought with: its peak in-flight microbatches against
    fixed 1F1B's, so a run holding twice the activations never reads as a free gain."""
    base = next((s.peak_inflight for s in summaries if s.contender == BASELINE), None)
    out = []
    for s in summaries:
        if s.contender == BASELINE or s.speedup is None or s.peak_inflight is None or not base:
            continue
        out.append(
            f"{s.contender}: {s.speedup.median:.3f}x over {BASELINE} with {s.peak_inflight:g} "
            f"microbatches in flight against its {base:g} "
            f"({s.peak_inflight / base:.2g}x its memory)."
        )
    return out + ([""] if out else [])


def _iteration_spans(spans: list[Span], contender: str, iteration: int) -> list[Span]:
    """One contender's tasks of one iteration, from its first task's start."""
    mine = [
        sp
        for sp in spans
        if sp.process == contender and sp.args.get("iteration") == iteration and sp.name != "wait"
    ]
    t0 = min((sp.start for sp in mine), default=0.0)
    return [Span(sp.process, sp.stage, sp.name, sp.start - t0, sp.end - t0, sp.args) for sp in mine]


def write_results(out: Path, spec: BenchSpec, results: list[CaseResult], machine: dict) -> str:
    """Every file of the folder; returns the markdown."""
    text = markdown(spec, results, machine)
    doc = {
        "config": spec.as_dict(),
        "machine": machine,
        "emulated_device_time": None if spec.real else EMULATED,
        "real_compute": REAL if spec.real else None,
        "workloads": [],
    }
    for res in results:
        doc["workloads"].append(
            {
                "name": res.case.name,
                "config": res.case.config,
                "preset": res.case.preset,
                "cost_model": res.cost_model,
                "skipped": res.skipped,
                "host": [h.as_dict() for h in res.hosts],
                "compute": [c.as_dict() for c in res.computes],
                "critical_path": [p.as_dict() for p in res.paths],
                "threads": res.threads,
                "summary": [s.as_dict() for s in res.summaries],
                "rows": res.rows,
                "iterations": res.iterations,
            }
        )
        write_json(out / f"trace-{res.case.name}.json", chrome_trace(res.spans))
        shown = spec.reps  # the last measured iteration, the same for every contender
        runs = []
        for s in res.summaries:
            row = next(
                r for r in res.rows if r["contender"] == s.contender and r["iteration"] == shown
            )
            title = (
                f"{res.case.name}: {s.contender}, iteration {shown}: {row['wall_s'] * 1e3:.0f} ms"
            )
            spans = _iteration_spans(res.spans, s.contender, shown)
            runs.append((title, spans))
            plot_timelines(
                out / f"timeline-{res.case.name}-{file_slug(s.contender)}.png",
                [(title, spans)],
                unit="ms from the iteration's first task",
                scale=1000.0,
            )
        if runs:  # every contender on one time axis
            plot_timelines(
                out / f"timelines-{res.case.name}.png",
                runs,
                unit="ms from each iteration's first task",
                scale=1000.0,
            )
    write_json(out / "results.json", doc)
    write_atomic(out / "results.md", text + "\n")
    return text
