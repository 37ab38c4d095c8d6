"""Where the time between "a task could run" and "its compute started" goes, per task, on real
compute: read from a bench run's traces (``rrfp bench --real``), nothing rerun.

A benchmark reading, not a test:
    .venv/bin/python benchmarks/task_gaps.py results/bench-YYYYmmdd-HHMMSS

A task could run once the rank's lane was free (the previous task's compute ended) and its
inputs existed (the producing task's compute ended, on this rank or the peer). What the
simulator's replay charges for a task is its compute from there; everything between that moment
and the task's compute start is the runtime's, and this splits it along the chain of events that
came last:

- the lane was the last to free (the previous task ended after the input existed):
  ``from lane`` (the lane's end to the loop having the result), ``after`` (its messages posted,
  the loop's turn for the senders), ``loop`` (the loop's other work until the decision),
  ``decide`` (the decision that picked the task, the task started in the tracker), ``to task``
  (the task's bound armed, its span begun), ``to lane`` (inputs taken, handed to the lane
  thread, the lane starting it);
- a peer's message came last: on the sender ``sender from lane``, ``sender post`` (from the
  loop having the result to the message queued) and ``to channel thread`` (queued to its channel
  thread beginning the transport operation), then ``transport`` (the sender's operation began to
  the receiver's channel thread having it whole), ``to loop`` (that thread to the loop delivering
  it), then ``loop``, ``decide``, ``to task`` and ``to lane`` as above.

Each part is clipped to the window, so a message that was on its way while the lane still
computed counts only from the lane's end. Per contender: per part, the median and p90 over the
tasks whose chain has it (µs), how many tasks that is, and the part's sum per rank and iteration
(ms, median over iterations of the mean over ranks) beside the iteration's time over its replay.
Times come from ``time.time()`` on one machine, so the ranks' clocks are one clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench_bound import task_events  # benchmarks/, beside this script

LOCAL = ("from lane", "after")
REMOTE = ("sender from lane", "sender post", "to channel thread", "transport", "to loop")
PARTS = (*LOCAL, *REMOTE, "loop", "decide", "to task", "to lane")


def _tasks(trace: Path) -> dict[str, list[dict]]:
    """Per contender, its rrfp task events that carry the lane's times and the stamps."""
    out = defaultdict(list)
    for contender, events in task_events(trace).items():
        for ev in events:
            a = ev["args"]
            if "compute" not in a or "returned" not in a or "decided" not in a:
                continue  # torch's rows, or a trace without the stamps
            out[contender].append(
                {
                    "kind": ev["name"][0],
                    "mb": int(ev["name"][1:]),
                    "stage": ev["tid"],
                    "rank": a.get("rank", ev["tid"]),
                    "it": a.get("iteration", 0),
                    "start": ev["ts"] / 1e6,
                    "end": (ev["ts"] + ev["dur"]) / 1e6,
                    **a,
                }
            )
    return out


def _chain(points: list[tuple[str, float]], ready: float, end: float) -> dict[str, float]:
    """The parts between consecutive points (``points[i]`` names the part that ends there),
    clipped to [ready, end]."""
    parts: dict[str, float] = {}
    prev = points[0][1]
    for name, t in points[1:]:
        lo, hi = max(prev, ready), min(t, end)
        if hi > lo:
            parts[name] = parts.get(name, 0.0) + hi - lo
        prev = max(prev, t)
    return parts


def task_gaps(tasks: list[dict], stages: int) -> list[tuple[dict, dict[str, float], float]]:
    """Per task (but a rank's first of an iteration): (the task, its parts in seconds, its gap)."""
    by_name = {(t["it"], t["stage"], t["kind"], t["mb"]): t for t in tasks}
    lanes = defaultdict(list)
    for t in tasks:
        if not t.get("beside"):
            lanes[(t["it"], t["rank"])].append(t)
    out = []
    for run in lanes.values():
        run.sort(key=lambda t: t["compute"][0])
        for prev, t in zip(run, run[1:], strict=False):
            s, c0 = t["stage"], t["compute"][0]
            producer = None
            if t["kind"] == "F" and s > 0:
                producer = by_name.get((t["it"], s - 1, "F", t["mb"]))
            elif t["kind"] == "B" and s < stages - 1:
                producer = by_name.get((t["it"], s + 1, "B", t["mb"]))
            remote = producer is not None and producer["rank"] != t["rank"] and "arrived" in t
            lane_free = prev["compute"][1]
            ready = max(lane_free, producer["compute"][1]) if remote else lane_free
            began, picked = t["decided"]
            tail = [("loop", began), ("decide", picked), ("to task", t["start"]), ("to lane", c0)]
            if remote and t["arrived"]["delivered"] > prev["end"]:
                sent, got = producer.get("sent", {}), t["arrived"]
                points = [("", producer["compute"][1]), ("sender from lane", producer["returned"])]
                if "posted" in sent:
                    points += [("sender post", sent["posted"]), ("to channel thread", sent["sent"])]
                points += [("transport", got["received"]), ("to loop", got["delivered"])]
            else:
                points = [("", lane_free), ("from lane", prev["returned"]), ("after", prev["end"])]
            out.append((t, _chain(points + tail, ready, c0), c0 - ready))
    return out


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(run: Path) -> list[str]:
    results = json.loads((run / "results.json").read_text())
    lines = [f"# Task gaps: {run}", ""]
    for w in results["workloads"]:
        trace = run / f"trace-{w['name']}.json"
        if not trace.exists():
            continue
        per = _tasks(trace)
        rows = defaultdict(list)
        for r in w["rows"]:
            rows[r["contender"]].append(r)
        lines += [
            f"## {w['name']}",
            "",
            "Per task (µs, median / p90 over the tasks whose chain has the part, and how many "
            "tasks that is of all); per rank and iteration (ms, the part summed, median over "
            "iterations of the mean over ranks).",
            "",
        ]
        for c, tasks in per.items():
            stages = 1 + max(t["stage"] for t in tasks)
            gaps = task_gaps(tasks, stages)
            its = sorted({t["it"] for t, _, _ in gaps})
            n_ranks = len({t["rank"] for t, _, _ in gaps})
            mine = rows.get(c, [])
            over = [r["wall_s"] - r["simulated_s"] for r in mine if r.get("simulated_s")]
            wall = [r["wall_s"] for r in mine]
            lines += [
                f"### {c} ({len(gaps)} tasks, {len(its)} iterations, {n_ranks} ranks; iteration "
                f"{1e3 * statistics.median(wall):.1f} ms, over its replay "
                f"{1e3 * statistics.median(over):.1f} ms)"
                if over
                else f"### {c}",
                "",
                "| part | median µs | p90 µs | tasks | ms per rank and iteration |",
                "|---|---:|---:|---:|---:|",
            ]
            for part in (*PARTS, "gap"):
                xs = [
                    g if part == "gap" else p[part]
                    for _, p, g in gaps
                    if part == "gap" or part in p
                ]
                if not xs:
                    continue
                sums = defaultdict(float)
                for t, p, g in gaps:
                    sums[t["it"]] += (g if part == "gap" else p.get(part, 0.0)) / n_ranks
                lines.append(
                    f"| {part} | {1e6 * statistics.median(xs):.0f} | {1e6 * _p(xs, 0.9):.0f} | "
                    f"{len(xs)}/{len(gaps)} | {1e3 * statistics.median(sums.values()):.2f} |"
                )
            lines.append("")
    return lines


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("run", type=Path, help="a bench run's folder (results.json, trace-*.json)")
    print("\n".join(report(a.parse_args().run)))


if __name__ == "__main__":
    main()
