"""The bench's results folder: results.json (every measured iteration, the
config and the machine), results.md (one table per workload), one timeline
PNG per contender for the same iteration, and a Chrome trace per workload.
Every file is written atomically.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rrfp.app.bench.analysis import Spread, Summary, paired_differences, paired_ratios
from rrfp.app.bench.suite import BASELINE, BenchSpec, Case, file_slug
from rrfp.observe.plot import plot_timelines
from rrfp.observe.trace import Span, chrome_trace, write_atomic, write_json

EMULATED = (
    "Device time is emulated on CPU: each task holds its stage's compute lane for its emulated "
    "duration (units x unit_ms; the tiny model's real compute runs inside that time), so the "
    "figures compare schedules and dispatch, not hardware."
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
    ("ready plan", "fixed plan", "the plan's predicted run replayed as a fixed order"),
)
# (ours, torch's): rrfp's best against torch.distributed.pipelining's schedules, paired like the
# rest
AGAINST_TORCH = (
    ("ready plan", "torch 1f1b"),
    ("ready plan", "torch zb"),
    ("ready bfw", "torch zb"),
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


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{format(v, spec)}{suffix}"


def _range(s: Spread | None, spec: str, scale: float = 1.0) -> str:
    return "—" if s is None else f"{format(s.low * scale, spec)}..{format(s.high * scale, spec)}"


def markdown(spec: BenchSpec, results: list[CaseResult], machine: dict) -> str:
    lines = ["# rrfp bench", ""]
    if spec.reps < MIN_REPS:
        lines += [SMOKE.format(reps=spec.reps, min=MIN_REPS), ""]
    lines += [
        f"PP={spec.pp} TP={spec.tp} M={spec.mb}, {spec.reps} measured iteration(s) per contender "
        f"after one warm-up, contenders rotated each iteration; {spec.unit_ms:g} ms of emulated "
        f"device time per unit (one average forward); ready budget {spec.budget}. "
        f"{machine['cpus']} CPUs, torch {machine['torch']}, {machine['hostname']}, "
        f"{machine['date']}.",
        "",
        EMULATED,
        "",
    ]
    for res in results:
        c = res.case
        source = (
            f"task times from its data (cost model calibrated here: {res.cost_model}) x the "
            f"{c.preset} preset's noise"
            if res.cost_model
            else f"task times from the {c.preset} preset"
        )
        sets = f" with {', '.join(c.overrides)}" if c.overrides else ""
        lines += [
            f"## {c.name}",
            "",
            f"{Path(c.config).name}{sets}: {source}.",
            "",
            "| contender | ms/iteration (median) | min..max | speedup vs fixed 1F1B | min..max "
            "| peak in-flight | efficiency | vs simulator | decision µs | plan ms |",
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
                f"| {_fmt(s.peak_inflight, 'g')}{mark} | {s.efficiency.median:.3f} | "
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
            (ours, theirs, f"Against torch: {ours} vs {theirs}") for ours, theirs in AGAINST_TORCH
        ]
        for headline, other, title in pairs:
            ratios = paired_ratios(res.rows, other, headline)
            if ratios:
                lines.append(
                    f"{title}: median {statistics.median(ratios):.3f}x (min {min(ratios):.3f}, "
                    f"max {max(ratios):.3f})."
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
        if not any(s.contender == BASELINE for s in res.summaries):
            lines.append(f"No speedups: {BASELINE} did not run.")
        for name, why in res.skipped.items():
            lines.append(f"Not run: {name}: {why}.")
        lines += [
            "Peak in-flight: the most microbatches one stage (rank) held activations for, the "
            "memory a speedup was bought with (fixed 1F1B holds PP; torch's ZB-V counts its two "
            "half stages as halves). Efficiency: the lower bound of the iteration's realized "
            "durations (busiest stage, or longest microbatch chain) over the measured time. vs "
            "simulator: measured over the simulator's time for the same durations, minus one (rrfp "
            "contenders only); well above zero, real compute (sharing this machine's CPUs) "
            "outlasted the emulated durations, and a larger --unit-ms separates the schedules from "
            "the CPU load. Speedups are medians of per-iteration ratios.",
            "",
        ]
    return "\n".join(lines)


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
        "emulated_device_time": EMULATED,
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
