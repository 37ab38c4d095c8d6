"""PNG timelines of one or more runs, one row per stage, coloured by task kind.

matplotlib with the Agg backend: it draws without a display, and
broken_barh turns spans into a Gantt chart in a few lines.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rrfp.observe.trace import Span, write_atomic

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_timelines(
    path: str | Path, runs: Sequence[tuple[str, Sequence[Span]]], unit: str = "units"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = max((sp.stage for _, spans in runs for sp in spans), default=0) + 1
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12, 1.2 + 0.35 * stages * len(runs)), squeeze=False, sharex=True
    )
    for ax, (title, spans) in zip(axes[:, 0], runs):
        rows: dict[tuple[int, str], list] = defaultdict(list)
        for sp in spans:
            rows[(sp.stage, sp.name[:1])].append((sp.start, sp.end - sp.start))
        for (stage, kind), bars in rows.items():  # a border keeps adjacent tasks apart
            ax.broken_barh(
                bars,
                (stage - 0.4, 0.8),
                facecolors=COLORS.get(kind, "grey"),
                edgecolor="black",
                linewidth=0.4,
            )
        span_all = max((sp.end for sp in spans), default=1.0) - min(
            (sp.start for sp in spans), default=0.0
        )
        for sp in spans:  # the microbatch number, where the bar is wide enough to hold it
            if (sp.end - sp.start) > span_all / 150 and sp.name[1:].isdigit():
                ax.text(
                    (sp.start + sp.end) / 2,
                    sp.stage,
                    sp.name[1:],
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                    clip_on=True,
                )
        n = max((sp.stage for sp in spans), default=0) + 1
        ranks = {sp.stage: sp.args["rank"] for sp in spans if "rank" in sp.args}  # virtual stages
        ax.set_yticks(
            range(n), [f"s{i}" + (f" r{ranks[i]}" if i in ranks else "") for i in range(n)]
        )
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", ncol=3, fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def spans_from_chrome(doc: dict) -> list[tuple[str, list[Span]]]:
    """A Chrome trace written by rrfp (``chrome_trace``), back as (process name, spans), in process order.
    ValueError names what is missing."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace: no traceEvents list")
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    runs: dict[int, list[Span]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            try:
                start = e["ts"] / 1e6
                runs[e["pid"]].append(
                    Span(
                        names.get(e["pid"], str(e["pid"])),
                        int(e["tid"]),
                        str(e["name"]),
                        start,
                        start + e["dur"] / 1e6,
                        dict(e.get("args") or {}),
                    )
                )
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"trace event {e!r} lacks a usable {err}") from None
    if not runs:
        raise ValueError("the trace has no task spans (ph = X)")
    # A measured run has one process per rank on one clock: one timeline, every stage in it.
    # A simulated trace has one process per executor x hint: one timeline each.
    groups: dict[str, list[Span]] = defaultdict(list)
    for pid in sorted(runs):
        name = names.get(pid, str(pid))
        groups["measured (all ranks)" if name.startswith("rank ") else name] += runs[pid]
    out = []
    for title, spans in groups.items():
        tasks = [sp for sp in spans if sp.name != "wait"]
        t0 = min((sp.start for sp in tasks), default=0.0)
        out.append(
            (
                title,
                [
                    Span(sp.process, sp.stage, sp.name, sp.start - t0, sp.end - t0, sp.args)
                    for sp in tasks
                ],
            )
        )
    return out
