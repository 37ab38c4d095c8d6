"""The `rrfp` command. The library logs; this module is the one that prints."""

from __future__ import annotations

import argparse
import os
import sys

from rrfp.app.errors import UsageError
from rrfp.app.job.job_lines import rank_and_world, refuse_once, say
from rrfp.core.budget import DEFAULT_BUDGET
from rrfp.core.hints import BUILTIN
from rrfp.core.variability import PRESETS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + traceback
        raise UsageError(message)


def _number(name: str, kind: type, what: str, ok, rule: str):
    """An argparse type: ``kind(text)`` that ``ok`` accepts, else one line naming the flag."""

    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{name} must be {rule}, got {text}")
        return v

    return conv


def _positive(name: str):
    return _number(name, int, "an integer", lambda v: v >= 1, ">= 1")


def _seconds(name: str):
    return _number(name, float, "a number of seconds", lambda v: v > 0, "> 0 seconds")


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rrfp", description="Readiness-driven pipeline-parallel training.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_sim, _add_plot, _add_calibrate, _add_train, _add_config, _add_bench):
        add(sub)
    return p


def _add_sim(sub) -> None:
    sim = sub.add_parser("sim", help="simulate dispatch modes x hints under a variability preset")
    sim.add_argument(
        "--pp",
        type=_positive("--pp"),
        default=8,
        help="pipeline ranks (default 8); each holds --virtual stages",
    )
    sim.add_argument(
        "--n-microbatches",
        type=_positive("--n-microbatches"),
        default=32,
        help="microbatches per iteration (default 32)",
    )
    sim.add_argument(
        "--preset", default="lang", choices=PRESETS, help="variability preset (default lang)"
    )
    sim.add_argument(
        "--seeds", type=_positive("--seeds"), default=20, help="seeds to run (default 20)"
    )
    sim.add_argument(
        "--budget",
        default=None,
        help="in-flight budgets of the ready rows and plans, a comma list of N, Nx (N times "
        "1F1B's) or bytes like 512MiB (default 2x,1x: the headline's and 1F1B's memory)",
    )
    sim.add_argument(
        "--dispatch",
        type=_csv_list,
        default=["fixed", "ready"],
        help="dispatch modes, a comma list of fixed (the hint's order, run as a list) and ready "
        "(the best-ranked ready task) (default fixed,ready)",
    )
    sim.add_argument(
        "--hints",
        type=_csv_list,
        default=None,
        help="comma list: builtin names, plan (planned per seed from known costs), zbv, .csv files "
        f"or module:function (default {','.join(BUILTIN)},plan, and zbv with --placement v)",
    )
    sim.add_argument(
        "--virtual",
        type=_csv_list,
        default=["1"],
        metavar="V",
        help="stages per rank, a comma list (default 1); the model splits into pp x V stages",
    )
    sim.add_argument(
        "--placement",
        type=_csv_list,
        default=["interleaved"],
        help="where a rank's stages sit, a comma list of interleaved (r, r+S, ...) and v "
        "(r and 2S-1-r, V = 2 only) (default interleaved)",
    )
    sim.add_argument("--comm", type=float, default=None, help="latency per message (default 0.05)")
    sim.add_argument(
        "--comm-jitter", type=float, default=None, help="lognormal sigma on message latency"
    )
    sim.add_argument(
        "--jitter",
        type=float,
        default=None,
        help="lognormal sigma on each task's time, in place of the preset's (e.g. 0.01 with "
        "--preset none: how a real machine's noise moves a schedule made without variability)",
    )
    sim.add_argument(
        "--slow-stage", type=int, default=None, help="rank that runs slower (all its stages)"
    )
    sim.add_argument("--slow-factor", type=float, default=2.0, help="how much slower (default 2)")
    sim.add_argument(
        "--oracle",
        action="store_true",
        help="also solve each seed's clairvoyant optimum (CP-SAT; pip install 'rrfp[oracle]') for "
        "every layout among the rows, and show each row's distance to its layout's",
    )
    sim.add_argument(
        "--oracle-time-limit",
        type=_seconds("--oracle-time-limit"),
        default=10.0,
        metavar="SECONDS",
        help="CP-SAT time per seed and layout (default 10); a seed that hits it is compared with "
        "its proven bound",
    )
    sim.add_argument(
        "--replay", metavar="SIZES", help="simulate the steps a run recorded (output.sizes) instead"
    )
    sim.add_argument(
        "--cost", metavar="FILE", help="the cost model that run used (rrfp calibrate), for --replay"
    )
    sim.add_argument(
        "--routing",
        metavar="FILE",
        help="task times from a run's recorded routing (output.routing) under the moe preset's "
        "shares, each recorded step a seed; the record's stages and microbatches set --pp and "
        "--n-microbatches",
    )
    sim.add_argument(
        "--ep",
        type=_positive("--ep"),
        default=None,
        help="with --routing: the expert-parallel ranks the experts are spread over (default the "
        "run's parallel.ep); it must divide the number of experts",
    )
    sim.add_argument(
        "--json",
        metavar="FILE",
        help="write results as JSON ('-': JSON alone on stdout, the table on stderr)",
    )
    sim.add_argument(
        "--trace",
        metavar="FILE",
        help="Chrome trace of seed 0, one process per row (dispatch x hint)",
    )
    sim.add_argument(
        "--plot", metavar="FILE", help="PNG timeline of seed 0: fixed 1F1B and the best row"
    )


def _add_plot(sub) -> None:
    plot = sub.add_parser(
        "plot", help="draw a timeline PNG from an rrfp Chrome trace (real or simulated)"
    )
    plot.add_argument(
        "trace", help="a trace from rrfp sim --trace or rrfp train --set output.trace=..."
    )
    plot.add_argument("--out", help="PNG to write (default: the trace's name with .png)")
    plot.add_argument("--iteration", type=int, help="draw this iteration (default: the last one)")
    plot.add_argument("--from", dest="start", type=float, help="window start (ms, or sim units)")
    plot.add_argument("--to", dest="end", type=float, help="window end (ms, or sim units)")
    plot.add_argument("--timelines", help="comma list of timelines to draw (default: the first 6)")


def _add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure each stage's F/B/W on sample data and fit the cost model"
    )
    cal.add_argument("--config", required=True, help="TOML run config (its model and data)")
    cal.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value"
    )
    cal.add_argument(
        "--pp", type=_positive("--pp"), default=4, help="pipeline stages to split into (default 4)"
    )
    cal.add_argument(
        "--samples",
        type=_positive("--samples"),
        default=16,
        help="microbatches to fit on; as many more are held out to judge the fit (default 16)",
    )
    cal.add_argument("--out", help="where to write the model (default runs/cost-MODEL-ppN.json)")


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="train a model on this rank (run under torchrun)")
    train.add_argument("--config", required=True, help="TOML run config")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N ranks on this machine (torchrun's agent) once the config and layout check "
        "out; without it, run under torchrun",
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set schedule.dispatch=fixed (rrfp config lists "
        "every key)",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config as TOML, the stage layout and the memory estimate, then "
        "exit",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last complete checkpoint in checkpoint.dir (error if none)",
    )
    train.add_argument(
        "--debug",
        action="store_true",
        help="on a failure, print the full traceback to stderr too (it always goes to "
        "output.log_dir)",
    )
    train.add_argument(
        "--help-config",
        action=_ConfigHelp,
        help="print every config key with its type, default and meaning, then exit",
    )


class _ConfigHelp(argparse.Action):
    """``--help-config``: like ``--help``, it answers at once, whatever else the line lacks."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from rrfp.app.config.reference import reference_text

        print(reference_text(), end="")
        parser.exit(0)


def _add_config(sub) -> None:
    cfg = sub.add_parser(
        "config", help="print every config key: its section, type, default and meaning"
    )
    cfg.add_argument(
        "--markdown", action="store_true", help="as the Markdown page docs/configuration.md"
    )
    cfg.add_argument(
        "--config",
        metavar="FILE",
        help="also list the [model] and [data] keys of the workload this TOML config names, with "
        "their types, defaults and the values the file gives",
    )


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="every contender (rrfp's dispatch modes and hints, torch's schedules) side by side "
        "on real gloo ranks, into a results folder",
        description="Run the benchmark suite: each workload's iterations on every contender, "
        "alternating, on PP local gloo ranks in one torchrun job. Device time is "
        "emulated on CPU by the compute lane, or real with --real.",
    )
    bench.add_argument(
        "--workloads",
        type=_csv_list,
        default=None,
        help="comma list of gpt, vlm or .toml configs (default gpt,vlm); moe, the mixture of "
        "experts on pp 2 x ep 2 ranks (--ep), runs alone (its contenders: fixed and ready 1f1b, "
        "zbh1, bfw and plan, torch's 1f1b, zb and dualpipev)",
    )
    bench.add_argument(
        "--contenders",
        type=_csv_list,
        default=None,
        help="the rows compared, a comma list: fixed-HINT or ready-HINT with any rrfp hint (1f1b, "
        "zbh1, bf, bfw, plan, gpipe; zbv with -v2), e.g. ready-plan, fixed-bfw; "
        "torch-SCHEDULE for torch.distributed.pipelining's 1f1b, zb (= zbv), "
        "interleaved-1f1b, interleaved-zb or dualpipev; drop-in-ready-HINT runs ready "
        "dispatch behind torch's schedule surface. A -v2 suffix on an rrfp one runs it on "
        "two virtual stages per rank in the v shape (ready-plan-v2, fixed-zbv-v2), -i2 "
        "interleaved; an -overlap suffix on a ready one (moe) runs a W beside each EP task's "
        "all-to-alls (ready-bfw-overlap); a -last-unsplit suffix on a split one (--real) "
        "leaves its last stage's backward whole (ready-plan-last-unsplit) (default: fixed-1f1b, "
        "fixed-zbh1, fixed-bfw, ready-bfw, fixed-plan, ready-plan, torch-1f1b, torch-zb, "
        "drop-in-ready-bfw, drop-in-ready-plan, "
        "ready-bfw-v2, ready-plan-v2, torch-dualpipev: those this build runs)",
    )
    bench.add_argument(
        "--pp", type=_positive("--pp"), default=None, help="pipeline stages = ranks (default 4)"
    )
    bench.add_argument(
        "--ep",
        type=_positive("--ep"),
        default=None,
        help="with --workloads moe: the expert-parallel group, each pipeline rank's ep replicas "
        "sharding its experts (default 2; with --real on CPU, 1 where pp x 2 ranks exceed the "
        "cores: one replica per pipeline rank, its experts local, no all-to-all)",
    )
    bench.add_argument(
        "--tp",
        type=_positive("--tp"),
        default=1,
        help="tensor-parallel ranks per stage (default 1)",
    )
    bench.add_argument(
        "--n-microbatches",
        type=_positive("--n-microbatches"),
        default=None,
        help="microbatches per iteration (default 16)",
    )
    bench.add_argument(
        "--reps",
        type=_positive("--reps"),
        default=None,
        help="measured iterations per contender, after one warm-up (default 5)",
    )
    bench.add_argument(
        "--unit-ms",
        type=float,
        default=None,
        help="ms of emulated device time per unit, one average forward (default 40: it must stay "
        "well above the real compute of a task, about 9 ms for the vlm on 2 shared cores); 0: "
        "real compute, as --real",
    )
    bench.add_argument(
        "--real",
        action="store_true",
        help="real compute, no emulated device time (as --unit-ms 0): each task takes what the "
        "model's compute takes on the run's device, one thread per rank on CPU (--pp at most the "
        "cores), and the tables add the host time rrfp spends around each task",
    )
    bench.add_argument(
        "--pin",
        action="store_true",
        help="with --real on CPU: each rank's threads on a core of its own (rank r on the r-th "
        "core it may use), so that a process pinned to one core slows that rank alone",
    )
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --real: cuda computes on the GPUs over NCCL (default --pp 1: two local "
        "stages on one GPU; rrfp's rows only)",
    )
    bench.add_argument(
        "--budget",
        default=DEFAULT_BUDGET,
        help=f"in-flight budget of ready dispatch (default {DEFAULT_BUDGET})",
    )
    bench.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="variability preset for every workload (default: gpt lang, vlm jitter)",
    )
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a value of every workload's config, e.g. --set model.n_layer=16",
    )
    bench.add_argument(
        "--torch-sends",
        choices=("delayed", "native"),
        default="delayed",
        help="torch anchors' sends: delayed (after the emulated link latency, from sender threads, "
        "as rrfp's senders; the default) or native (torch issues and waits its own, no latency)",
    )
    bench.add_argument("--out", help="results folder (default results/bench-<timestamp>)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of seconds: gpt, pp 2, 4 microbatches, 1 iteration, 2 ms units",
    )
    bench.add_argument(
        "--timeout",
        type=_positive("--timeout"),
        default=3600,
        help="seconds before the job is stopped (default 3600); a dead rank fails it sooner",
    )


def _plot(args) -> int:
    from rrfp.app.cli.plot_command import plot_command

    return plot_command(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "sim":
            from rrfp.app.cli.sim_command import sim_command

            return sim_command(args)
        if args.command == "plot":
            return _plot(args)
        if args.command == "config":
            from rrfp.app.config.reference import reference_markdown, reference_text

            show = reference_markdown if args.markdown else reference_text
            print(show(args.config), end="")
            return 0
        if args.command == "calibrate":
            from rrfp.app.cli.calibrate_command import calibrate_command

            return calibrate_command(args)
        if args.command == "bench":
            from rrfp.app.cli.bench_command import bench_command

            return bench_command(args)
        from rrfp.app.cli.train_command import train_command

        return train_command(args)
    except UsageError as e:  # every rank of a job checks its input alike: one line per job
        text = " ".join(str(e).split())
        rank, world = rank_and_world()
        refuse_once(
            text,
            f"rrfp: error: {text}"
            if rank == 0 or world <= 1
            else f"rrfp: error: rank {rank}: {text}",
        )
        return 2
    except (
        KeyboardInterrupt
    ):  # before `rrfp train` handles SIGINT (train_command.py), or another command
        rank, world = rank_and_world()
        if (
            rank == 0 or world <= 1
        ):  # torchrun's agent forwards Ctrl-C to every rank: one line per job
            say("rrfp: interrupted")
        if "WORLD_SIZE" in os.environ:  # a rank: torch's C++ teardown may abort (exit_now says why)
            from rrfp.app.errors import exit_now

            exit_now(130)
        return 130
    except BrokenPipeError:  # e.g. `rrfp sim | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (
        OSError
    ) as e:  # a file the commands' own checks did not foresee: one line, not a traceback
        say(f"rrfp: error: {e.filename or type(e).__name__}: {e.strerror or e}")
        return 1


def entry() -> None:
    # torch's C++ side logs each failed store call as a warning with its whole native stack
    # (about 20 lines: a killed torchrun agent made some 110); rrfp says in one line what failed.
    # Read when torch loads, so set before it does here and in every process started from here;
    # TORCH_CPP_LOG_LEVEL=WARNING (or INFO) brings them back
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # OpenMP's thread count, also read once when torch loads: the ranks `--nproc-per-node` forks
    # from this process keep it, and torch.set_num_threads(compute.threads) in a rank does not
    # undo a larger one (2 ranks of examples/my_model.toml, 100 steps, 2 cores: 39 CPU-s with
    # the machine's count, 6 with one). compute.threads raises it where asked
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
