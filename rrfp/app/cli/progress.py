"""Progress bars for long commands: tqdm on stderr, and nothing when stderr is not a terminal
(CI logs, pipes), so only the commands' own lines reach files; and ``rrfp train``'s step lines."""

from __future__ import annotations

from tqdm import tqdm


def progress(
    jobs=None, *, total: int | None = None, desc: str, unit: str = "run", leave: bool = True
) -> tqdm:
    """A bar over ``jobs`` (an iterable), or one advanced by hand up to ``total``."""
    import sys

    return tqdm(
        jobs,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=leave,
        dynamic_ncols=True,
    )


def step_line(r) -> str:
    """A training step's report (rrfp.app.train.training.StepReport) as the line ``rrfp train``
    prints."""
    eta = (r.steps - r.step - 1) * r.wall_s
    skipped = "  skipped: NaN/Inf, no update" if r.skipped else ""
    norm = f"  grad norm {r.grad_norm:.4g}" if r.grad_norm is not None else ""
    lr = f"  lr {r.lr:.3g}" if r.lr is not None else ""
    mfu = f"  mfu {r.mfu:.2%}" if r.mfu is not None else ""
    evaluated = getattr(r, "eval_loss", None)  # a report of a step that evaluated carries it
    ev = f"  eval loss {evaluated:.4f}" if evaluated is not None else ""
    memory = getattr(r, "memory", None)
    mem = (
        f"  mem {per_rank([m / 2**20 for m in memory], '.0f', ' MiB')} ({r.memory_measure})"
        if memory
        else ""
    )
    in_flight = getattr(r, "in_flight", None)
    held = f"  in flight {per_rank(in_flight, 'd')}" if in_flight else ""
    aux_loss = getattr(r, "aux_loss", None)  # a model with MoE layers: its router statistics
    router = (
        f"  aux loss {aux_loss:.4g}  expert load max/mean {r.expert_load_max_over_mean:.2f}"
        if aux_loss is not None
        else ""
    )
    return (
        f"step {r.step + 1:>4}/{r.steps}  loss {r.loss:.4f}{router}{ev}{norm}{lr}  "
        f"{r.tokens_per_s:,.0f} tok/s{mfu}  bubble {r.bubble:5.1%}  {r.wall_s * 1000:.0f} ms/step"
        f"{mem}{held}  eta {eta:.0f}s{skipped}"
    )


PER_RANK_SHOWN = 8  # a step line lists each rank's value up to this many ranks, else the largest


def per_rank(values, fmt: str, unit: str = "") -> str:
    """Each rank's value, in rank order and separated by "/" (a comma would read as a thousands
    separator); with more than PER_RANK_SHOWN ranks, the largest and its rank."""
    if len(values) <= PER_RANK_SHOWN:
        return "/".join(format(v, fmt) for v in values) + unit
    rank = max(range(len(values)), key=values.__getitem__)
    return f"max {format(values[rank], fmt)}{unit} (rank {rank} of {len(values)})"


class StepProgress:
    """``rrfp train``'s step lines: plain lines on stdout when it is not a terminal (a log); on a
    terminal a bar on stderr whose tail is the current step's numbers, each line kept above it.
    tqdm draws the bar (it is already here for the other commands and keeps printed lines above
    itself); rich would add a dependency for nothing this needs."""

    def __init__(self, steps: int, first: int = 0, tty: bool | None = None) -> None:
        import sys

        self.tty = sys.stdout.isatty() and sys.stderr.isatty() if tty is None else tty
        self.bar = (
            tqdm(total=steps, initial=first, unit="step", file=sys.stderr, dynamic_ncols=True)
            if self.tty
            else None
        )

    def __call__(self, report) -> None:
        line = step_line(report)
        if self.bar is None:
            print(line, flush=True)
            return
        self.bar.write(line)
        self.bar.n = report.step + 1
        self.bar.set_postfix_str(f"loss {report.loss:.4f}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
