"""`rrfp sim`: dispatch modes x hints on many seeds, as a table, JSON, a trace or a plot.

Flags are resolved here, once, into a Budget, Dispatch modes and Hints; the
simulator only sees those objects.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

from rrfp.app.cli.progress import progress
from rrfp.app.errors import UsageError
from rrfp.app.job.run_outputs import check_output
from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.hints import BUILTIN, HintError, resolve
from rrfp.core.placement import Placement, VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.observe.trace import chrome_trace, write_json
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import planned_config
from rrfp.sim.sweep import BASELINE, Row, sweep

DEFAULT_BUDGETS = (
    "2x,1x"  # the headline's memory, and 1F1B's: every speedup is shown at equal memory too
)


def _budgets(args) -> list[Budget]:
    """``--budget`` as a list, without repeats. Without it: 2x and 1x (2x alone with --oracle,
    which solves one budget)."""
    text = args.budget or (DEFAULT_BUDGET if args.oracle else DEFAULT_BUDGETS)
    budgets = list(dict.fromkeys(Budget.parse(b) for b in text.split(",") if b.strip()))
    if not budgets:
        raise ValueError(f"--budget: no budget given in {text!r}")
    if args.oracle and len(budgets) > 1:
        raise ValueError(f"--oracle solves one budget at a time; give --budget once, not {text}")
    return budgets


MAX_STAGE_MICROBATCHES = (
    1 << 22
)  # minutes per simulation; far larger looks like a hang that eats memory


def _layouts(args) -> list[VirtualLayout]:
    """``--virtual`` x ``--placement``: V = 1 once (placement means nothing there), v only with
    V = 2. A pair that cannot be is refused when it is the only one asked for, else left out."""
    try:
        virtuals = [int(v) for v in args.virtual]
    except ValueError:
        raise ValueError(f"--virtual: not a list of integers: {','.join(args.virtual)}") from None
    placements = [Placement.parse(p) for p in args.placement]
    if not virtuals or not placements:
        raise ValueError("--virtual and --placement need at least one value each")
    out, errors = [], []
    for v in dict.fromkeys(virtuals):
        for p in placements if v > 1 else [Placement.INTERLEAVED]:
            try:
                out.append(VirtualLayout(args.pp, v, p))
            except ValueError as e:
                errors.append(f"--virtual {v} --placement {p}: {e}")
    if not out:
        raise ValueError("; ".join(errors))
    return list(dict.fromkeys(out))


def _resolve(args) -> tuple[list[Budget], list[Dispatch], list, Variability, list[VirtualLayout]]:
    try:
        budgets = _budgets(args)
        layouts = _layouts(args)
        dispatches = [Dispatch.parse(d) for d in args.dispatch]
        names = args.hints or [*BUILTIN, "plan"] + (
            ["zbv"] if any(lay.placement is Placement.V for lay in layouts) else []
        )
        hints = [resolve(h) for h in names]
    except ValueError as e:  # HintError included
        raise UsageError(str(e)) from None
    size = args.pp * max(lay.virtual for lay in layouts) * args.n_microbatches
    if size > MAX_STAGE_MICROBATCHES:
        raise UsageError(
            f"--pp {args.pp} x --virtual x --n-microbatches {args.n_microbatches} is {size:,} "
            f"stage-microbatches per simulation; rrfp sim takes at most "
            f"{MAX_STAGE_MICROBATCHES:,} (64 x 4096 takes about 12 s on one core, and time and "
            "memory grow with it)"
        )
    flags = {"comm": args.comm, "comm_jitter": args.comm_jitter, "jitter": args.jitter}
    over = {k: v for k, v in flags.items() if v is not None}
    if args.slow_stage is not None:
        if not 0 <= args.slow_stage < args.pp:
            raise UsageError(f"--slow-stage {args.slow_stage} is not a stage of --pp {args.pp}")
        over.update(slow_stage=args.slow_stage, slow_factor=args.slow_factor)
    try:
        var = Variability.preset(args.preset, **over)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return budgets, dispatches, hints, var, layouts


def _progress(jobs, desc: str = "simulating", unit: str = "run"):
    return progress(jobs, desc=desc, unit=unit, leave=False)


def _label(row: Row, budgets: list[Budget]) -> str:
    """A row's name where several budgets or layouts share a table, a trace or a plot."""
    return (
        f"{row.dispatch} {row.hint}"
        + (f" {row.budget}" if row.budget and len(budgets) > 1 else "")
        + (f" {row.layout}" if row.layout else "")
    )


def _table(
    args,
    budgets: list[Budget],
    var: Variability,
    rows: list[Row],
    out,
    oracle=None,
    skipped: list[str] = (),
) -> None:
    virtual = any(r.virtual > 1 for r in rows)
    print(
        f"rrfp sim: S={args.pp} M={args.n_microbatches} preset={args.preset} "
        f"budget={','.join(map(str, budgets))} (ready rows and plans) seeds={args.seeds}; time in "
        f"average-forward units, comm {var.comm}/message; peak in-flight: the most microbatches a "
        "rank held (fixed 1F1B's is the 1x memory)"
        + (
            "; with V stages per rank a local stage holds 1/V of a microbatch, and Nx gives the "
            "fullest rank N times 1F1B's peak, the others by need (docs/design.md §4b)"
            if virtual
            else ""
        ),
        file=out,
    )
    print(
        f"{'dispatch':<8} {'hint':<12} {'budget':>6}"
        + (f" {'layout':<15}" if virtual else "")
        + f" {'speedup vs fixed 1f1b':>22} {'p10..p90':>13} "
        f"{'peak in-flight':>14} {'efficiency':>10} {'bubble':>7}"
        + (f" {'vs optimum':>11}" if oracle else ""),
        file=out,
    )
    for r in rows:
        lo, hi = r.spread
        planned = (
            f"  plan {1e3 * float(np.median(r.plan_s)):.1f} ms (wall, median)" if r.plan_s else ""
        )
        print(
            f"{r.dispatch:<8} {r.hint:<12} {r.budget or 'order':>6}"
            + (f" {r.layout or 'V1':<15}" if virtual else "")
            + f" {r.median:>21.3f}x {lo:>6.2f}..{hi:<5.2f} "
            f"{r.peak_inflight:>14g} {r.median_efficiency:>10.3f} {r.bubble:>7.1%}"
            + (f" {oracle.cell(r):>11}" if oracle else "")
            + planned,
            file=out,
        )
    for why in skipped:
        print(f"not run: {why}", file=out)
    for line in oracle.summary(budgets[0]) if oracle else ():
        print(line, file=out)


def replay_command(args) -> int:
    """`rrfp sim --replay SIZES --cost COST`: each recorded step simulated on its microbatches."""
    import statistics
    from pathlib import Path

    from rrfp.core.cost import CostModel
    from rrfp.sim.replay import replay

    if not args.cost:
        raise UsageError("--replay needs --cost: the cost model the run used (rrfp calibrate)")
    try:
        doc = json.loads(Path(args.replay).read_text())
        cost = CostModel.from_json(Path(args.cost).read_text())
    except OSError as e:
        raise UsageError(f"cannot read {e.filename}: {e.strerror}") from None
    except (ValueError, KeyError) as e:
        raise UsageError(f"--replay/--cost: not a sizes file and a cost model: {e}") from None
    if not doc.get("unit_ms"):
        raise UsageError(
            f"{args.replay}: the run had unit_ms = 0 (no emulated time to compare with)"
        )
    try:
        rows = replay(doc, cost)
    except (ValueError, KeyError) as e:  # a layout the cost model does not fit, a missing field
        raise UsageError(f"--replay {args.replay}: {e}") from None
    stages = (
        f"{doc['pp']} stages"
        if int(doc.get("virtual", 1)) == 1
        else f"{doc['pp']} ranks x {doc['virtual']} stages ({doc.get('placement', 'interleaved')})"
    )
    print(
        f"rrfp sim --replay: {doc['dispatch']} {doc['hint']} at {doc['budget']}, {stages}, "
        f"{doc['n_microbatches']} microbatches, {doc['unit_ms']:g} ms per unit "
        "(emulated device time)"
    )
    print(f"{'step':>4} {'simulated ms':>13} {'measured ms':>12} {'error':>7}")
    errs = []
    for step, sim_ms, meas_ms in rows:
        err = meas_ms / sim_ms - 1
        if step > 0:  # step 1 warms up
            errs.append(err)
        print(f"{step + 1:>4} {sim_ms:>13.1f} {meas_ms:>12.1f} {err:>+7.1%}")
    if errs:
        print(
            f"measured vs simulated after step 1: median {statistics.median(errs):+.1%} "
            f"(range {min(errs):+.1%} .. {max(errs):+.1%})"
        )
    return 0


def _routing(args):
    """``--routing FILE``: the record, with --pp, --n-microbatches, --seeds and --preset set from
    it."""
    from pathlib import Path

    from rrfp.sim.routing_replay import Routing

    for flag, given in (
        ("--oracle", args.oracle),
        ("--trace", args.trace),
        ("--plot", args.plot),
        ("--replay", args.replay),
    ):
        if given:
            raise UsageError(f"--routing replays recorded task times; {flag} does not take them")
    if args.virtual != ["1"]:
        raise UsageError("--routing replays the record's stages one per rank: leave out --virtual")
    try:
        with open(args.routing) as f:
            rec = Routing.parse(f, args.routing)
    except OSError as e:
        raise UsageError(f"--routing: cannot read {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--routing: {e}") from None
    args.pp, args.n_microbatches, args.seeds = rec.stages, rec.microbatches, len(rec.steps)
    args.preset = "moe"
    print(
        f"rrfp sim --routing: {Path(args.routing).name}: {len(rec.steps)} step(s) x "
        f"{rec.stages} stage(s) x {rec.microbatches} microbatch(es), {rec.experts} experts "
        f"on {args.ep or rec.ep} EP rank(s); each step is one seed",
        file=sys.stderr,
    )
    return rec


def sim_command(args) -> int:
    if args.replay and not args.routing:
        return replay_command(args)
    if args.cost:
        raise UsageError("--cost is the cost model a recorded run used: it goes with --replay FILE")
    if args.ep and not args.routing:
        raise UsageError("--ep spreads a recorded run's experts: it goes with --routing FILE")
    routing = _routing(args) if args.routing else None
    budgets, dispatches, hints, var, layouts = _resolve(args)
    try:
        durations = routing.durations(var, args.ep) if routing else []
    except ValueError as e:
        raise UsageError(f"--routing {args.routing}: {e}") from None
    for flag, path in (("--json", args.json), ("--trace", args.trace), ("--plot", args.plot)):
        if path and path != "-":
            check_output(flag, path)
    if args.oracle:
        from rrfp.app.cli import sim_oracle

        sim_oracle.check(args, layouts)
    base = SimConfig(args.pp, args.n_microbatches, budget=budgets[0], variability=var)
    skipped: list[str] = []
    try:
        runs = {} if args.oracle else None  # the oracle starts from the schedules the sweep ran
        rows = sweep(
            base,
            dispatches,
            hints,
            args.seeds,
            _progress,
            runs,
            budgets,
            layouts,
            skipped,
            durations,
        )
    except HintError as e:
        raise UsageError(str(e)) from None
    if skipped and not {h.name for h in hints} & {
        r.hint for r in rows
    }:  # nothing asked for could run
        raise UsageError("; ".join(skipped))
    rows.sort(key=lambda r: -r.median)
    oracle = None
    if args.oracle:
        print(
            f"rrfp sim: solving the optimum of {args.seeds} seed(s), up to "
            f"{args.oracle_time_limit:g} s each",
            file=sys.stderr,
        )
        oracle = sim_oracle.oracle_column(args, base, runs, rows, _progress)
    json_to_stdout = args.json == "-"
    _table(args, budgets, var, rows, sys.stderr if json_to_stdout else sys.stdout, oracle, skipped)
    if args.json:
        doc = {
            "pp": args.pp,
            "n_microbatches": args.n_microbatches,
            "preset": args.preset,
            "budget": ",".join(map(str, budgets)),
            "layouts": [
                {"virtual": lay.virtual, "placement": str(lay.placement)} for lay in layouts
            ],
            "not_run": skipped,
            "budgets": [str(b) for b in budgets],
            "seeds": args.seeds,
            "variability": var.__dict__,
            "rows": [r.as_dict() for r in rows],
        }
        if oracle:
            doc["oracle"] = oracle.as_dict()
            for r, d in zip(rows, doc["rows"]):
                d["vs_optimum"] = oracle.rows[r.key].as_dict()
        if json_to_stdout:
            json.dump(doc, sys.stdout, indent=1)
            print()
        else:
            write_json(args.json, doc)
    if args.trace or args.plot:
        _timelines(args, base, {h.name: h for h in [BASELINE[1], *hints]}, rows, budgets)
    return 0


def _timelines(args, base: SimConfig, hints: dict, rows: list[Row], budgets: list[Budget]) -> None:
    """Seed 0 of every row (fixed 1F1B first) as a Chrome trace, and the first two as a PNG."""
    baseline = (str(BASELINE[0]), BASELINE[1].name)
    runs = []
    for r in sorted(rows, key=lambda r: (r.dispatch, r.hint) != baseline):
        cfg = replace(
            base,
            dispatch=r.dispatch,
            hint=hints[r.hint],
            budget=r.budget or base.budget,
            seed=0,
            record=True,
            virtual=r.virtual,
            placement=r.placement,
        )
        if cfg.hint.planned:  # the plan it ran, not the unplanned BFW it starts from
            cfg = planned_config(cfg)[0]
        res = simulate(cfg)
        runs.append(
            (
                f"{_label(r, budgets)}: makespan {res.makespan:.1f}, efficiency "
                f"{res.efficiency:.2f}",
                res,
            )
        )
    if args.trace:
        spans = [sp for title, res in runs for sp in res.spans(title.split(":")[0])]
        write_json(args.trace, chrome_trace(spans))
    if args.plot:
        from rrfp.observe.plot import plot_timelines

        picked = runs[:2]  # fixed 1F1B and the best-ranked row
        plot_timelines(args.plot, [(t, res.spans(t)) for t, res in picked], unit="average forwards")
