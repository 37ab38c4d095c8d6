"""Where a real-compute bench run's time went, per contender, and how far an rrfp row could
get at its own compute: read from the run's results.json and traces, nothing rerun.

A benchmark reading, not a test:
    .venv/bin/python benchmarks/bench_bound.py results/bench-YYYYmmdd-HHMMSS [--against torch-zb]

Per contender, medians over iterations of the mean over ranks (ms): the iteration's time, the
compute (the tasks' own time: the lane's call for rrfp, the schedule's call for torch), the rest
of the time (host work and waits), the lower bound at the row's own task times (the busiest rank
or the longest microbatch chain, what the bench's efficiency divides), for rrfp the replay (the
simulator running the row's schedule on its task times with no host time and no latency), and
CPU time by thread role (each thread's own, which a loaded machine inflates far less than wall
time). Per stage the median F, B, W of a microbatch.

Then, paired by iteration, for every rrfp row against ``--against``: the measured ratio, and two
ceilings: the other row's time over this row's replay (this schedule with no host time) and over
this row's lower bound (any schedule at this row's compute). A ceiling under a goal says the goal
is out of reach at this compute, whatever the runtime does.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

KINDS = "FBW"


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{1e3 * x:.1f}"


def _task_s(ev: dict) -> float:
    compute = ev["args"].get("compute")
    return compute[1] - compute[0] if compute else ev["dur"] / 1e6


def task_events(trace: Path) -> dict[str, list[dict]]:
    """Per contender (the trace's process name), its task events."""
    doc = json.loads(trace.read_text())
    names, out = {}, defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            names[ev["pid"]] = ev["args"]["name"]
    for ev in doc["traceEvents"]:
        name = ev.get("name", "")
        if ev.get("ph") == "X" and name[:1] in KINDS and name[1:].isdigit():
            out[names.get(ev["pid"], str(ev["pid"]))].append(ev)
    return out


def _stage(ev: dict) -> int:
    return ev["args"].get("torch_stage", ev["tid"])


def _rank(ev: dict) -> int:
    return ev["args"].get("rank", ev["tid"])


def workload_report(w: dict, trace: Path, against: str) -> list[str]:
    spans = task_events(trace)
    rows = defaultdict(dict)  # contender -> iteration -> row
    for r in w["rows"]:
        rows[r["contender"]][r["iteration"]] = r
    cpu = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))  # c -> it -> role -> s
    ranks = defaultdict(set)
    for t in w["threads"]:
        ranks[t["contender"]].add(t["rank"])
        for role, got in t["roles"].items():
            cpu[t["contender"]][t["iteration"]][role] += got[0]
    lines = [
        f"## {w['name']}",
        "",
        "| contender | iteration | compute | rest | lower bound | replay | CPU by thread "
        "(loop/lane/channels/gloo) | CPU, all threads |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    per_stage = []
    for c, its in rows.items():
        evs = spans.get(c, [])
        n_ranks = max(1, len(ranks[c]) or len({_rank(e) for e in evs}))
        compute = defaultdict(float)
        kinds = defaultdict(list)
        for e in evs:
            compute[e["args"].get("iteration", 0)] += _task_s(e) / n_ranks
            kinds[(_stage(e), e["name"][0])].append(_task_s(e))
        wall = _med(r["wall_s"] for r in its.values())
        comp = _med(compute[i] for i in its)
        rest = _med(its[i]["wall_s"] - compute[i] for i in its if i in compute)
        roles = ("loop", "lane", "channels", "gloo")
        by_role = "/".join(
            _ms(_med(cpu[c][i][role] / n_ranks for i in its if i in cpu[c])) for role in roles
        )
        total = _med(sum(cpu[c][i].values()) / n_ranks for i in its if i in cpu[c])
        lines.append(
            f"| {c} | {_ms(wall)} | {_ms(comp)} | {_ms(rest)} | "
            f"{_ms(_med(r.get('lower_bound_s') for r in its.values()))} | "
            f"{_ms(_med(r.get('simulated_s') for r in its.values()))} | {by_role} | {_ms(total)} |"
        )
        stages = sorted({s for s, _ in kinds})
        per_stage.append(
            f"| {c} | "
            + " | ".join("/".join(_ms(_med(kinds.get((s, k), []))) for k in KINDS) for s in stages)
            + " |"
        )
    lines += [
        "",
        "Median task time per stage (ms, F/B/W; torch's ZB-V: its four chunks, two per rank):",
        "",
        "| contender | stage 0 | stage 1 | stage 2 | stage 3 |",
        "|---|---|---|---|---|",
        *per_stage,
        "",
    ]
    other = rows.get(against)
    if other:
        lines += [
            f"Paired by iteration, against {against} (median, min..max):",
            "",
            f"| rrfp row | measured ({against} / row) | ceiling: / replay | ceiling: / bound |",
            "|---|---:|---:|---:|",
        ]
        for c, its in rows.items():
            if c.startswith("torch") or c == against:
                continue
            cols = []
            for key in ("wall_s", "simulated_s", "lower_bound_s"):
                ratios = [
                    other[i]["wall_s"] / its[i][key] for i in its if i in other and its[i].get(key)
                ]
                cols.append(
                    f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}..{max(ratios):.3f})"
                    if ratios
                    else "—"
                )
            lines.append(f"| {c} | " + " | ".join(cols) + " |")
        lines.append("")
    return lines


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("results", type=Path, help="a bench run's folder (results.json, trace-*.json)")
    a.add_argument("--against", default="torch zb", help="the row the ceilings are taken against")
    args = a.parse_args()
    doc = json.loads((args.results / "results.json").read_text())
    m = doc["machine"]
    print(f"{args.results}: {m['cpus']} CPUs, load {m['load']}, {m['date']}")
    print()
    for w in doc["workloads"]:
        trace = args.results / f"trace-{w['name']}.json"
        print("\n".join(workload_report(w, trace, args.against.replace("-", " "))))


if __name__ == "__main__":
    main()
