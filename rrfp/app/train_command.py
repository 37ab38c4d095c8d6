"""`rrfp train`: run stage_main on this rank; print on rank 0; one line on error
(rrfp/app/failure.py), the traceback in run.log_dir (and on stderr with --debug)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from rrfp.app.config import TrainConfig
from rrfp.app.errors import UsageError
from rrfp.app.failure import SECONDARY, Failure, write_traceback
from rrfp.app.failure_board import FailureBoard
from rrfp.app.train import StepReport, stage_main
from rrfp.loop import run as run_loop


def _print_step(r: StepReport) -> None:
    eta = (r.steps - r.step - 1) * r.wall_s
    skipped = "  skipped: NaN/Inf, no update" if r.skipped else ""
    print(f"step {r.step + 1:>4}/{r.steps}  loss {r.loss:.4f}  {r.tokens_per_s:,.0f} tok/s  "
          f"bubble {r.bubble:5.1%}  {r.wall_s * 1000:.0f} ms/step  eta {eta:.0f}s{skipped}", flush=True)


def train_command(args) -> int:
    logging.basicConfig(level=os.environ.get("RRFP_LOG", "WARNING"), format="%(name)s: %(message)s")
    if not args.dry_run and "WORLD_SIZE" not in os.environ:
        raise UsageError("no RANK/WORLD_SIZE in the environment: start the ranks with torchrun "
                         "(torchrun --nproc-per-node N -m rrfp train ...)")
    # the layout and model checks run here, before any process group: bad input exits 2 on every rank
    cfg = TrainConfig.load(args.config, args.set)
    rank = int(os.environ.get("RANK", "0"))
    if args.dry_run:
        if rank == 0:
            print(cfg.layout.describe())
            print(cfg.as_dict())
        return 0
    try:
        summary = run_loop(stage_main(cfg, _print_step))
    except Exception as e:
        _fail(e, cfg, rank, getattr(args, "debug", False))
    if rank == 0:
        skipped = f" ({len(summary.skipped)} skipped: NaN/Inf)" if summary.skipped else ""
        print(f"done: {len(summary.losses)} steps{skipped}, loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}, "
              f"decision cost {summary.statistics.decision_us:.1f} us", flush=True)
        if summary.plan_s:
            waits = sorted(summary.plan_waited_s[1:]) or [0.0]  # step 1's plan cannot be made ahead
            print(f"plan: {1e3 * sorted(summary.plan_s)[len(summary.plan_s) // 2]:.1f} ms per step (median, "
                  f"in a thread, one step ahead); steps after the first waited for it {1e3 * waits[len(waits) // 2]:.2f} "
                  f"ms (median), {1e3 * waits[-1]:.2f} ms at most", flush=True)
    # Everything is written and every group is down. Leave now: letting the interpreter tear down
    # torch's C++ state after gloo async collectives sometimes aborts ("terminate called without an
    # active exception", about 1 run in 7 on 4 CPU ranks), which would turn a finished run into exit 134.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fail(e: BaseException, cfg: TrainConfig, rank: int, debug: bool) -> None:
    """One line on stderr (rrfp/app/failure.py says which), the traceback to the log, then leave."""
    # torchrun's agent SIGTERMs the other ranks as soon as one exits: finish this line first (a second
    # or two at most, then os._exit below; the agent waits far longer before its SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failure = Failure.of(e)
    board = FailureBoard.connect()  # best effort: tells the others how this rank failed
    origin = None
    if board is not None:
        board.post(rank, failure.note)
        if failure.kind == SECONDARY:
            origin = board.origin(rank, getattr(failure.cause, "peer", None))
    path = write_traceback(e, cfg.run.log_dir, rank)
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    stage = cfg.layout.coords(rank).pp
    print(f"rrfp: error: {failure.line(rank, stage, path, debug, origin)}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    # A peer may be dead and gloo threads blocked in it: leave at once, not through teardown.
    os._exit(1)
