"""`rrfp train`: run stage_main on this rank; print on rank 0; one line on error
(rrfp/app/failure.py), the traceback in run.log_dir (and on stderr with --debug)."""
from __future__ import annotations

import logging
import os
import signal
import statistics
import sys
import traceback

from rrfp.app.checkpoints import plan_resume
from rrfp.app.config import RunConfig, TrainConfig
from rrfp.app.errors import UsageError, exit_now, root_cause
from rrfp.app.failure import SECONDARY, Failure, write_traceback
from rrfp.app.failure_board import FailureBoard
from rrfp.app.job_lines import rank_and_world, refuse_once, say
from rrfp.app.train import StepReport, stage_main
from rrfp.loop import run as run_loop


def _print_step(r: StepReport) -> None:
    eta = (r.steps - r.step - 1) * r.wall_s
    skipped = "  skipped: NaN/Inf, no update" if r.skipped else ""
    print(f"step {r.step + 1:>4}/{r.steps}  loss {r.loss:.4f}  {r.tokens_per_s:,.0f} tok/s  "
          f"bubble {r.bubble:5.1%}  {r.wall_s * 1000:.0f} ms/step  eta {eta:.0f}s{skipped}", flush=True)


STOPPED_EXIT = 128 + signal.SIGTERM  # 143, what a shell reports for a run ended by SIGTERM


class StopOnSigterm:
    """The first SIGTERM asks the run to stop after the current step (every rank
    learns of it in that step's all-reduce, saves, and exits 143); a second one
    leaves at once, keeping the last committed checkpoint."""

    def __init__(self, kept: str = "the last committed checkpoint stays") -> None:
        self.requested = False
        self._last_words = f"rrfp: second SIGTERM: leaving now; {kept}\n".encode()

    def install(self) -> "StopOnSigterm":
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            os.write(2, self._last_words)
            os._exit(STOPPED_EXIT)
        self.requested = True


def train_command(args) -> int:
    logging.basicConfig(level=os.environ.get("RRFP_LOG", "WARNING"), format="%(name)s: %(message)s")
    if not args.dry_run and "WORLD_SIZE" not in os.environ:
        raise UsageError("no RANK/WORLD_SIZE in the environment: start the ranks with torchrun "
                         "(torchrun --nproc-per-node N -m rrfp train ...)")
    rank, _ = rank_and_world()
    try:
        # the layout and model checks run here, before any process group: bad input exits 2 on every rank
        cfg = TrainConfig.load(args.config, [*args.set, *(["resume=required"] if args.resume else [])])
        resume = plan_resume(cfg)  # a missing, corrupt or mismatched checkpoint exits 2 here, before any group
    except UsageError:
        raise
    except Exception as e:  # a bug in a check: one line per job, the traceback to the log
        path = write_traceback(e, RunConfig.log_dir, rank)
        text = f"internal error, please report it: {type(e).__name__}: {' '.join(str(e).split())}"
        refuse_once(text, f"rrfp: error: rank {rank}: {text} (traceback in {path})")
        exit_now(1)
    start = resume.start
    if rank == 0 and resume.fallback_line():
        say(f"rrfp: warning: {resume.fallback_line()}")
    if rank == 0 and cfg.run.resume != "off":
        print(f"resume: from {start.path} (step {start.step} of {cfg.run.steps})" if start else
              f"resume: no checkpoint in {cfg.run.checkpoint_dir}, starting at step 0", flush=True)
    if args.dry_run:
        if rank == 0:
            print(cfg.layout.describe())
            if cfg.run.virtual > 1:
                print(f"stages: {cfg.stages.describe()}")
            print(cfg.as_dict())
        return 0
    sigterm = StopOnSigterm(*([] if cfg.run.checkpoint_dir else
                              ["no checkpoint is kept (run.checkpoint_dir is not set)"])).install()
    try:
        summary = run_loop(stage_main(cfg, _print_step, stop=lambda: sigterm.requested, resume=resume))
    except Exception as e:
        _fail(e, cfg, rank, getattr(args, "debug", False))
    if summary.stopped_at is not None:
        saved = (f"checkpoint {summary.checkpoint} saved; continue with --resume" if summary.checkpoint else
                 "no checkpoint saved (run.checkpoint_dir is not set)")
        say(f"rrfp: stopped: rank {rank}: SIGTERM on {summary.stop_requests} rank(s), the run stopped after "
            f"step {summary.stopped_at} of {cfg.run.steps}; {saved}")
        exit_now(STOPPED_EXIT)
    if rank == 0:
        resumed = f" after step {summary.first_step}" if summary.first_step else ""
        skipped = f" ({len(summary.skipped)} skipped: NaN/Inf)" if summary.skipped else ""
        print(f"done: {len(summary.losses)} steps{resumed}{skipped}, loss {summary.losses[0]:.4f} -> "
              f"{summary.losses[-1]:.4f}, "
              f"decision cost {summary.statistics.decision_us:.1f} us", flush=True)
        if summary.plan_s:
            waits = summary.plan_waited_s[1:] or [0.0]  # step 1's plan cannot be made ahead
            print(f"plan: {1e3 * statistics.median_high(summary.plan_s):.1f} ms per step (median, "
                  f"in a thread, one step ahead); steps after the first waited for it "
                  f"{1e3 * statistics.median_high(waits):.2f} ms (median), {1e3 * max(waits):.2f} ms at most", flush=True)
    exit_now(0)


def _fail(e: BaseException, cfg: TrainConfig, rank: int, debug: bool) -> None:
    """One line on stderr (rrfp/app/failure.py says which), the traceback to the log, then leave."""
    # torchrun's agent SIGTERMs the other ranks as soon as one exits: finish this line first (a second
    # or two at most, then exit_now below; the agent waits far longer before its SIGKILL)
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
    line = f"rrfp: error: {failure.line(rank, stage, path, debug, origin)}"
    if isinstance(root_cause(e), UsageError):  # e.g. the ranks found different checkpoints: alike on every rank
        refuse_once(" ".join(str(root_cause(e)).split()), line, board)
    else:
        say(line)
    exit_now(2 if isinstance(root_cause(e), UsageError) else 1)  # e.g. a checkpoint that does not load: 2
