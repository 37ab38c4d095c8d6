"""PNG timelines of one or more runs, one row per stage, coloured by task kind.

matplotlib with the Agg backend: it draws without a display, and
broken_barh turns spans into a Gantt chart in a few lines.
"""
from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from rrfp.observe.trace import Span, write_atomic

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_timelines(path: str | Path, runs: Sequence[tuple[str, Sequence[Span]]], unit: str = "units") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = max((sp.stage for _, spans in runs for sp in spans), default=0) + 1
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.2 + 0.35 * stages * len(runs)),
                             squeeze=False, sharex=True)
    for ax, (title, spans) in zip(axes[:, 0], runs):
        rows: dict[tuple[int, str], list] = defaultdict(list)
        for sp in spans:
            rows[(sp.stage, sp.name[:1])].append((sp.start, sp.end - sp.start))
        for (stage, kind), bars in rows.items():
            ax.broken_barh(bars, (stage - 0.4, 0.8), facecolors=COLORS.get(kind, "grey"), edgecolor="none")
        n = max((sp.stage for sp in spans), default=0) + 1
        ax.set_yticks(range(n), [f"s{i}" for i in range(n)])
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
