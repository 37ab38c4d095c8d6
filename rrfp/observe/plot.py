"""PNG timelines of one or more runs, one row per device (rank), coloured by task kind.

matplotlib with the Agg backend: it draws without a display, and
broken_barh turns spans into a Gantt chart in a few lines.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from rrfp.observe.trace import Span, write_atomic

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
KINDS = {"F": "F forward", "B": "B backward", "W": "W weight gradients"}
DPI = 110
WIDTH_IN = 12.0
LABEL_PT = 6.0
TICK_PT = 7.0
# the frame around the timelines, in inches: the legend above, each title's band, the time axis
# below, the right edge; the left one holds the longest row name
TOP_IN, TITLE_IN, BOTTOM_IN, RIGHT_IN = 0.3, 0.45, 0.6, 0.15
ROW_IN = 0.3  # each row's height


def _text_in(text: str, points: float) -> float:
    """About how wide ``text`` is in inches at ``points`` (DejaVu Sans averages 0.6 em a
    character)."""
    return len(text) * 0.6 * points / 72


def row_of(span: Span) -> int:
    """The device a task ran on: its rank when the span names one (a rank holding several stages),
    else its stage (one stage per rank; torch's rows are ranks already)."""
    return int(span.args.get("rank", span.stage))


def iterations(spans: Sequence[Span]) -> list[int]:
    """The iteration numbers the spans carry (measured traces); empty for a simulated trace."""
    return sorted({int(sp.args["iteration"]) for sp in spans if "iteration" in sp.args})


def select(
    spans: Sequence[Span],
    iteration: int | None = None,
    start: float | None = None,
    end: float | None = None,
) -> list[Span]:
    """The spans of one iteration (``iteration``), re-timed from its first task, then those that
    overlap [start, end], cut to it. ValueError names an iteration the spans do not hold."""
    if iteration is not None:
        held = iterations(spans)
        if iteration not in held:
            have = f"{held[0]}..{held[-1]}" if held else "none (a simulated trace is one iteration)"
            raise ValueError(f"no iteration {iteration} in the trace (iterations: {have})")
        spans = [sp for sp in spans if sp.args.get("iteration") == iteration]
        t0 = min(sp.start for sp in spans)
        spans = [replace(sp, start=sp.start - t0, end=sp.end - t0) for sp in spans]
    lo = -math.inf if start is None else start
    hi = math.inf if end is None else end
    return [
        replace(sp, start=max(sp.start, lo), end=min(sp.end, hi))
        for sp in spans
        if sp.end > lo and sp.start < hi
    ]


def kinds_present(runs: Sequence[tuple[str, Sequence[Span]]]) -> list[str]:
    """The task kinds the runs hold, F, B, W first: the legend lists these and no others (1F1B has
    no W)."""
    seen = list(dict.fromkeys(sp.name[:1] for _, spans in runs for sp in spans))
    return [k for k in COLORS if k in seen] + [k for k in seen if k not in COLORS]


def _label(span: Span, shared: bool, width_px: float) -> str | None:
    """The longest label that fits inside the bar, or None: the task and, on a row several stages
    share, its stage; else the microbatch alone."""
    options = [f"{span.name} s{span.stage}", span.name] if shared else [span.name]
    if span.name[1:].isdigit():
        options.append(span.name[1:])
    return next((t for t in options if _text_in(t, LABEL_PT) * DPI + 4 <= width_px), None)


def _stages_on(spans: Sequence[Span]) -> dict[int, list[int]]:
    """Each row's stages, in stage order."""
    stages_on: dict[int, list[int]] = defaultdict(list)
    for sp in sorted(spans, key=lambda sp: sp.stage):
        if sp.stage not in stages_on[row_of(sp)]:
            stages_on[row_of(sp)].append(sp.stage)
    return stages_on


def _row_names(spans: Sequence[Span]) -> dict[int, str]:
    """Each row's name on the axis: its rank and the stages it holds."""
    return {
        r: f"rank {r}: " + ",".join(f"s{s}" for s in stages)
        for r, stages in _stages_on(spans).items()
    }


def plot_timelines(
    path: str | Path,
    runs: Sequence[tuple[str, Sequence[Span]]],
    unit: str = "units",
    scale: float = 1.0,
) -> None:
    """One timeline per run, one row per device (rank), so idle time compares across runs at a
    glance; times multiplied by ``scale`` (1000: seconds drawn as ms). Stages that share a rank
    share its row: the later ones lighter, every bar labelled where the label fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(1, len({row_of(sp) for sp in spans})) for _, spans in runs]
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(WIDTH_IN, TOP_IN + BOTTOM_IN + sum(ROW_IN * h + TITLE_IN for h in heights)),
        squeeze=False,
        sharex=True,
        gridspec_kw={"height_ratios": heights},
    )
    t_lo = min((sp.start for _, spans in runs for sp in spans), default=0.0) * scale
    t_hi = max((sp.end for _, spans in runs for sp in spans), default=1.0) * scale
    names = [_row_names(spans) for _, spans in runs]
    left_in = 0.35 + max((_text_in(n, TICK_PT) for ns in names for n in ns.values()), default=0)
    px_per_t = (WIDTH_IN - left_in - RIGHT_IN) * DPI / max(t_hi - t_lo, 1e-12)
    for ax, (title, spans), row_names in zip(axes[:, 0], runs, names):
        # the limits before the bars: each bar added to an axes that scales itself would scale
        # every axes that shares its x again (a quarter of the calls of a plot of a dozen runs)
        rows = sorted(row_names)
        ax.set_xlim(t_lo, t_hi)
        ax.set_ylim(max(rows, default=0) + 0.6, min(rows, default=0) - 0.6)
        stages_on = _stages_on(spans)
        bars: dict[tuple[int, str, bool], list] = defaultdict(list)
        for sp in spans:
            row, kind = row_of(sp), sp.name[:1]
            later = stages_on[row].index(sp.stage) > 0
            bars[(row, kind, later)].append((sp.start * scale, (sp.end - sp.start) * scale))
        for (row, kind, later), xs in bars.items():  # white borders keep adjacent tasks apart
            ax.broken_barh(
                xs,
                (row - 0.4, 0.8),
                facecolors=COLORS.get(kind, "grey"),
                edgecolor="white",
                linewidth=0.3,
                alpha=0.55 if later else 1.0,
            )
        for sp in spans:
            shared = len(stages_on[row_of(sp)]) > 1
            text = _label(sp, shared, (sp.end - sp.start) * scale * px_per_t)
            if text is not None:
                ax.text(
                    (sp.start + sp.end) / 2 * scale,
                    row_of(sp),
                    text,
                    ha="center",
                    va="center",
                    fontsize=LABEL_PT,
                    color="white",
                    clip_on=True,
                )
        ax.set_yticks(rows, [row_names[r] for r in rows], fontsize=TICK_PT)
        # at the axes' top: no tick labels there for matplotlib to lay the title out above
        ax.set_title(title, fontsize=9, loc="left", y=1.0)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    order = kinds_present(runs)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS.get(k, "grey")) for k in order]
    labels = [KINDS.get(k, k) for k in order]
    if any(
        len(set(sp.stage for sp in spans if row_of(sp) == r)) > 1
        for _, spans in runs
        for r in {row_of(sp) for sp in spans}
    ):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.55))
        labels.append("lighter: the rank's later stage")
    fig.legend(handles, labels, loc="upper right", ncol=len(labels), fontsize=8)
    # a fixed frame in inches, the bands the figure's size was chosen for (tight_layout would lay
    # every text out once more before the figure is drawn, a third of a plot's CPU)
    width, height = fig.get_size_inches()
    inner = ROW_IN * sum(heights)
    fig.subplots_adjust(
        left=left_in / width,
        right=1 - RIGHT_IN / width,
        top=1 - (TOP_IN + TITLE_IN) / height,
        bottom=BOTTOM_IN / height,
        hspace=TITLE_IN / (inner / len(runs)),
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def spans_from_chrome(doc: dict) -> list[tuple[str, list[Span]]]:
    """A Chrome trace written by rrfp (``chrome_trace``), back as (process name, spans), in process
    order. ValueError names what is missing."""
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
