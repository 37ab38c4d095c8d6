"""`rrfp plot`: a timeline PNG from an rrfp Chrome trace, real or simulated.

A measured trace holds every iteration of a run, far too many tasks for one picture, so it draws
one iteration (the last, unless ``--iteration`` picks another) or a window (``--from``/``--to``),
in milliseconds; a simulated trace is one iteration, drawn in average forwards.
"""

from __future__ import annotations

import json
from pathlib import Path

from rrfp.app.errors import UsageError
from rrfp.app.job.run_outputs import check_output
from rrfp.observe.plot import iterations, plot_timelines, select, spans_from_chrome

MAX_TIMELINES = 6  # timelines drawn when --timelines does not pick


def plot_command(args) -> int:
    try:
        text = Path(args.trace).read_text()
    except OSError as e:
        raise UsageError(f"cannot read trace {args.trace}: {e.strerror}") from None
    try:
        doc = json.loads(text)
    except ValueError:
        raise UsageError(
            f"{args.trace}: not a Chrome trace (not JSON): give a trace from --set output.trace=, "
            f"rrfp sim --trace or rrfp bench"
        ) from None
    try:
        runs = spans_from_chrome(doc)
    except ValueError as e:
        raise UsageError(f"{args.trace}: {e}") from None
    if args.start is not None and args.end is not None and args.start >= args.end:
        raise UsageError(f"--from {args.start:g} must be below --to {args.end:g}")
    held = iterations([sp for _, spans in runs for sp in spans])
    measured = bool(held)
    scale = 1000.0 if measured else 1.0  # a measured trace's seconds drawn as ms
    iteration = args.iteration
    if iteration is None and len(held) > 1 and args.start is None and args.end is None:
        iteration = held[-1]
    lo = None if args.start is None else args.start / scale
    hi = None if args.end is None else args.end / scale
    try:
        picked = [(title, select(spans, iteration, lo, hi)) for title, spans in runs]
    except ValueError as e:
        raise UsageError(f"--iteration: {e}") from None
    picked = [(title, spans) for title, spans in picked if spans]
    picked, left = pick_timelines(picked, args.timelines)
    if not picked:
        raise UsageError(
            f"--from/--to: no task in [{args.start}, {args.end}] "
            f"({'ms' if measured else 'average forwards'} from the first task)"
        )
    out = args.out or str(Path(args.trace).with_suffix(".png"))
    check_output("--out", out)
    if measured:
        where = f"iteration {iteration}" if iteration is not None else "all iterations"
        unit = f"ms from the first task of {where}"
    else:
        unit = "average forwards from the first task"
    titles = [
        (f"{title}, iteration {iteration}" if iteration is not None else title, spans)
        for title, spans in picked
    ]
    plot_timelines(out, titles, unit=unit, scale=scale)
    shown = f"iteration {iteration} of {held[0]}..{held[-1]}, " if iteration is not None else ""
    print(f"wrote {out}: {len(picked)} timeline(s), {shown}{sum(len(s) for _, s in picked)} tasks")
    if left:
        print(f"left out {len(left)} timeline(s) (--timelines picks): {', '.join(left)}")
    return 0


def pick_timelines(runs: list, names: str | None) -> tuple[list, list[str]]:
    """The timelines named in ``names`` (a comma list, each an exact title), else the first
    ``MAX_TIMELINES``: a simulated trace holds one per table row, too many for one picture."""
    if names is None:
        return runs[:MAX_TIMELINES], [title for title, _ in runs[MAX_TIMELINES:]]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    titles = [title for title, _ in runs]
    unknown = [n for n in wanted if n not in titles]
    if unknown or not wanted:
        raise UsageError(
            f"--timelines: no timeline {', '.join(unknown) or '(none given)'} in the trace "
            f"(timelines: {', '.join(titles)})"
        )
    return [r for r in runs if r[0] in wanted], [t for t in titles if t not in wanted]
