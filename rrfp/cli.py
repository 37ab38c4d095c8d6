"""The `rrfp` command. The library logs; this module is the one that prints."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from .budget import DEFAULT_BUDGET, Budget
from .hints import BUILTIN, HintError, resolve
from .policy import Executor
from .variability import PRESETS, Variability


class UsageError(Exception):
    """Bad input from the user: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        raise UsageError(message)


def _positive(name: str):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return conv


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rrfp", description="Readiness-driven pipeline-parallel training.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sim = sub.add_parser("sim", help="simulate executors x hints under a variability preset")
    sim.add_argument("--pp", type=_positive("--pp"), default=8, help="pipeline stages (default 8)")
    sim.add_argument("--mb", type=_positive("--mb"), default=32, help="microbatches per iteration (default 32)")
    sim.add_argument("--preset", default="lang", choices=PRESETS, help="variability preset (default lang)")
    sim.add_argument("--seeds", type=_positive("--seeds"), default=20, help="seeds to run (default 20)")
    sim.add_argument("--budget", default=DEFAULT_BUDGET,
                     help="ready executor's in-flight budget: N, Nx (N times 1F1B's) or bytes like 512MiB (default 2x)")
    sim.add_argument("--executors", type=_csv_list, default=["fixed", "ready"])
    sim.add_argument("--hints", type=_csv_list, default=list(BUILTIN),
                     help="comma list: builtin names, .csv files or module:function")
    sim.add_argument("--comm", type=float, default=None, help="latency per message (default 0.05)")
    sim.add_argument("--comm-jitter", type=float, default=None, help="lognormal sigma on message latency")
    sim.add_argument("--slow-stage", type=int, default=None, help="stage that runs slower")
    sim.add_argument("--slow-factor", type=float, default=2.0, help="how much slower (default 2)")
    sim.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    sim.add_argument("--trace", metavar="FILE", help="Chrome trace of seed 0, one process per executor x hint")
    sim.add_argument("--plot", metavar="FILE", help="PNG timeline of seed 0: fixed 1F1B and the best row")

    train = sub.add_parser("train", help="train a model on this rank (run under torchrun)")
    train.add_argument("--config", required=True, help="TOML run config")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set executor=fixed")
    train.add_argument("--dry-run", action="store_true", help="print the layout and config, then exit")
    return p


def _sim(args) -> int:
    from .sim import SimConfig, simulate
    from .sim.sweep import BASELINE, sweep
    from .trace import chrome_trace, write_json

    try:
        budget = Budget.parse(args.budget)
        for h in args.hints:
            resolve(h)
        for e in args.executors:
            Executor(e)
    except HintError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        msg = str(e)
        if "is not a valid Executor" in msg:
            msg = f"unknown executor in {','.join(args.executors)} (choose from ready, fixed)"
        raise UsageError(msg) from None
    over = {k: v for k, v in {"comm": args.comm, "comm_jitter": args.comm_jitter}.items() if v is not None}
    if args.slow_stage is not None:
        if not 0 <= args.slow_stage < args.pp:
            raise UsageError(f"--slow-stage {args.slow_stage} is not a stage of --pp {args.pp}")
        over.update(slow_stage=args.slow_stage, slow_factor=args.slow_factor)
    try:
        var = Variability.preset(args.preset, **over)
    except ValueError as e:
        raise UsageError(str(e)) from None
    base = SimConfig(args.pp, args.mb, budget=budget, variability=var)

    def progress(jobs):
        try:
            from tqdm import tqdm
        except ImportError:
            return jobs
        return tqdm(jobs, desc="simulating", unit="run", disable=not sys.stderr.isatty(), leave=False)

    try:
        rows = sweep(base, args.executors, args.hints, args.seeds, progress)
    except HintError as e:
        raise UsageError(str(e)) from None
    rows.sort(key=lambda r: -r.median)
    print(f"rrfp sim: S={args.pp} M={args.mb} preset={args.preset} budget={budget} (ready only) "
          f"seeds={args.seeds}; time in average-forward units, comm {var.comm}/message")
    print(f"{'executor':<8} {'hint':<12} {'speedup vs fixed 1f1b':>22} {'p10..p90':>13} {'efficiency':>10} "
          f"{'peak in-flight':>14} {'bubble':>7}")
    for r in rows:
        lo, hi = r.spread
        print(f"{r.executor:<8} {r.hint:<12} {r.median:>21.3f}x {lo:>6.2f}..{hi:<5.2f} "
              f"{r.median_efficiency:>10.3f} {r.peak_inflight:>14d} {r.bubble:>7.1%}")
    if args.json:
        doc = {"pp": args.pp, "mb": args.mb, "preset": args.preset, "budget": str(budget), "seeds": args.seeds,
               "variability": var.__dict__, "rows": [r.as_dict() for r in rows]}
        if args.json == "-":
            json.dump(doc, sys.stdout, indent=1)
            print()
        else:
            write_json(args.json, doc)
    if args.trace or args.plot:
        runs = []
        for r in ([rr for rr in rows if (rr.executor, rr.hint) == BASELINE]
                  + [rr for rr in rows if (rr.executor, rr.hint) != BASELINE]):
            res = simulate(replace(base, executor=r.executor, hint=r.hint, seed=0, record=True))
            runs.append((f"{r.executor} {r.hint}: makespan {res.makespan:.1f}, efficiency {res.efficiency:.2f}", res))
        if args.trace:
            spans = [sp for title, res in runs for sp in res.spans(title.split(":")[0])]
            write_json(args.trace, chrome_trace(spans))
        if args.plot:
            from .plot import plot_timelines

            picked = runs[:2]  # fixed 1F1B and the best-ranked row
            plot_timelines(args.plot, [(t, res.spans(t)) for t, res in picked], unit="average forwards")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "sim":
            return _sim(args)
        from .train import train_command

        return train_command(args)
    except UsageError as e:
        print(f"rrfp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rrfp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `rrfp sim | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> None:
    sys.exit(main())
