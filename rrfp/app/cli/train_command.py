"""`rrfp train`: run stage_main on this rank; print on rank 0; one line on error
(rrfp/app/job/failure.py), the traceback in output.log_dir (and on stderr with --debug)."""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from rrfp.app.cli.progress import StepProgress
from rrfp.app.config.fields import toml_text
from rrfp.app.config.job_identity import identity
from rrfp.app.config.sections import OutputSection
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import UsageError, exit_now, root_cause
from rrfp.app.job.environment import check_launcher, configure_logging
from rrfp.app.job.failure import Failure, user_text, write_traceback
from rrfp.app.job.failure_board import FailureBoard
from rrfp.app.job.job_agreement import agree
from rrfp.app.job.job_lines import rank_and_world, refuse_once, say, tell_torchrun
from rrfp.app.job.launcher import LAUNCHED, check_launch, start_ranks
from rrfp.app.job.run_outputs import check_end_files
from rrfp.app.job.stop_relay import StopRelay
from rrfp.app.train.checkpoint_dir import CheckpointDir
from rrfp.app.train.checkpoints import choose_resume
from rrfp.app.train.run_summary import run_summary, summary_lines
from rrfp.app.train.start_checks import (
    Footprint,
    check_byte_budget,
    check_memory,
    check_timeout,
    footprints,
)
from rrfp.app.train.training import stage_main
from rrfp.loop import run as run_loop
from rrfp.pipeline.user_code import user_code

STOPPED_EXIT = 128 + signal.SIGTERM  # 143, what a shell reports for a run ended by SIGTERM
# SIGINT: Ctrl-C, which torchrun's agent forwards to every rank; SIGHUP (a closed terminal or SSH
# session) and SIGQUIT, which torchrun's agent also passes on to its ranks, stop a run as SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
SAME_REQUEST_S = (
    0.5  # a second stop signal this soon after the first is the same request, not "leave now"
)


def ignore_stop_signals() -> None:
    """From now on the stop signals change nothing: this rank is writing its last line, and
    torchrun's agent signals the ranks still running once one has exited (Ctrl-C's SIGINT reaches
    every rank too)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_exit(name: str) -> int:
    """The exit code of a run ended by the stop signal ``name``: 143 (SIGTERM), 130 (SIGINT),
    129 (SIGHUP), 131 (SIGQUIT)."""
    return 128 + signal.Signals[name]


class StopOnSignal:
    """The first stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) asks the run to stop without
    waiting for its step: every
    rank learns of it through the store (``stop_relay.py``), abandons the step, saves the last
    completed one and exits 128 + the signal. A second one leaves at once; its line says which
    checkpoint is left, read when it comes (``kept()``). A second one within ``SAME_REQUEST_S``
    is the same request: torchrun's agent, signalled twice at once (a wrapper such as
    ``timeout`` forwards the terminal's Ctrl-C that reached it too), sends SIGINT and then,
    from its ``finally``, SIGTERM (docs/design.md, "Ctrl-C")."""

    def __init__(
        self,
        kept: Callable[[], str] = lambda: kept_checkpoint(""),
        relay: StopRelay | None = None,
        leave_in_startup: bool = False,
    ) -> None:
        # rrfp train: before the process group exists no peer waits for this rank and nothing is to
        # save, so a signal then ends the rank at once (a rank waiting in the rendezvous included)
        self.leave_in_startup = leave_in_startup
        self.signalled = False  # a stop signal reached this rank
        self.signal = ""  # ... its name (SIGTERM, SIGINT, SIGHUP, SIGQUIT)
        # the run asked whether to stop (``asked``): past start-up for good, even once its process
        # group is gone again at the end
        self.stepping = False
        self._at = 0.0
        self._kept = kept
        self.relay = relay

    @property
    def requested(self) -> bool:
        """A stop signal reached this rank, or another one (through the relay)."""
        return self.signalled or (self.relay is not None and self.relay.seen.is_set())

    def asked(self) -> bool:
        """``requested``, as the run polls it from its first step on: a signal from then on is
        never one of start-up, whatever state the process group is in."""
        self.stepping = True
        return self.requested

    @property
    def name(self) -> str:
        """The signal that asked for the stop: this rank's, else the one another rank relayed."""
        return self.signal or (self.relay.signal if self.relay is not None else "") or "SIGTERM"

    def install(self) -> StopOnSignal:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if (
            self.leave_in_startup
            and not (self.signalled or self.stepping)
            and not dist.is_initialized()
        ):  # still in start-up
            os.write(
                2,
                f"rrfp: stopped: rank {rank_and_world()[0]}: {name} during start-up, before any "
                f"step; {self._kept()}\n".encode(),
            )
            os._exit(128 + signum)
        if self.signalled:
            if time.monotonic() - self._at < SAME_REQUEST_S:
                return
            os.write(2, f"rrfp: second {name}: leaving now; {self._kept()}\n".encode())
            os._exit(128 + signum)
        self.signalled, self.signal, self._at = True, name, time.monotonic()
        if self.relay is not None:
            self.relay.post(name)


StopOnSigterm = StopOnSignal  # the name before SIGINT stopped a run too


def kept_checkpoint(checkpoint_dir: str) -> str:
    """What a run that ends now leaves behind, as the second stop signal's line says it."""
    if not checkpoint_dir:
        return "no checkpoint is kept (checkpoint.dir is not set)"
    try:
        latest = CheckpointDir(checkpoint_dir).latest()
    except OSError as e:
        return f"cannot list {checkpoint_dir}: {e.strerror or e}"
    if latest is None:
        return f"no checkpoint has been committed in {checkpoint_dir}: nothing of this run is kept"
    return f"the last committed checkpoint, {latest.path} (step {latest.step}), stays"


def train_command(args) -> int:
    configure_logging()
    check_launcher()
    launching = getattr(args, "nproc_per_node", None) is not None
    if launching:
        check_launch(args)
    # without torchrun the config is still checked first (in the world its layout implies), so a
    # bad key is not hidden behind the launcher's error
    standalone = "WORLD_SIZE" not in os.environ
    rank, world = rank_and_world()
    cfg = None
    try:
        # the layout and model checks run here, before any process group: bad input exits 2 on
        # every rank (or once, in the launcher, for the world it is about to start)
        cfg = _load(args, implied_world=standalone and not launching, launching=launching)
        if standalone and not args.dry_run and not launching:
            raise UsageError(
                "no RANK/WORLD_SIZE in the environment: give --nproc-per-node N to start N "
                "ranks here, or start them with torchrun (torchrun --nproc-per-node N -m rrfp "
                "train ...)"
            )
        if not launching and not args.dry_run:
            # every rank runs the same config, model and data: a difference exits 2 on every rank
            # here, before any process group (compared through torchrun's store)
            agree(identity(cfg), rank, world, cfg.waits.process_group_s)
        # rank 0 writes output.trace and output.sizes at the end, but every rank probes their
        # folders now: a refusal on rank 0 alone would leave the others waiting for it in the
        # rendezvous
        check_end_files(cfg.output)
        # a missing, corrupt or mismatched checkpoint exits 2 here, before any group
        resume = choose_resume(cfg)
        # exits 2 when the config cannot fit this machine (a dry run shows the estimate instead);
        # a warning when a byte budget holds no microbatch
        prints = footprints(cfg) if args.dry_run else check_memory(cfg)
        small_budget = check_byte_budget(cfg, prints)
        slow_timeout = check_timeout(cfg)  # a warning: the prediction is a lower bound
    except UsageError:
        raise
    except Exception as e:  # the user's code or a bug in a check: one line per job, the traceback
        # to the log
        user = user_code(e) is not None  # the same on every rank: said once, as bad input is
        text = (
            user_text(e)
            if user
            else f"internal error, please report it: {type(e).__name__}: {' '.join(str(e).split())}"
        )
        try:
            path = write_traceback(e, (cfg.output if cfg else OutputSection).log_dir, rank)
            who = "" if user else f"rank {rank}: "
            refuse_once(text, f"rrfp: error: {who}{text} (traceback in {path})")
        except BaseException:  # noqa: BLE001 - the report of a bug must not itself end in a traceback
            os.write(2, f"rrfp: error: rank {rank}: {text}\n".encode(errors="replace"))
        exit_now(1)
    start = resume.start
    # the launcher (--nproc-per-node) checked the same config for the same world and said these
    # before it started the ranks; a restarted attempt checks anew, and says what it finds
    tell = rank == 0 and not (
        os.environ.get(LAUNCHED) == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    )
    for warning in (resume.fallback_line(), slow_timeout, small_budget):
        if tell and warning:
            say(f"rrfp: warning: {warning}")
    if tell and cfg.checkpoint.resume != "off":
        print(
            f"resume: from {start.path} (step {start.step} of {cfg.run.steps})"
            if start
            else f"resume: no checkpoint in {cfg.checkpoint.dir}, starting at step 0",
            flush=True,
        )
    if args.dry_run:
        if rank == 0:
            print(dry_run_text(cfg, prints), end="")
        return 0
    if launching:
        start_ranks(args)
    relay = StopRelay().start()
    stop = StopOnSignal(
        lambda: kept_checkpoint(cfg.checkpoint.dir), relay, leave_in_startup=True
    ).install()
    try:
        about = run_summary(cfg, prints) if rank == 0 else None  # asks the workload of its data
        if about is not None:  # what the run is, before its first step (and in run.json)
            print("\n".join(summary_lines(about)), flush=True)
        lines = StepProgress(cfg.run.steps, start.step if start else 0) if rank == 0 else None
        summary = run_loop(stage_main(cfg, lines, stop=stop.asked, resume=resume, about=about))
    except Exception as e:
        relay.close()
        _fail(e, cfg, rank, getattr(args, "debug", False))
    relay.close()
    if lines is not None:
        lines.close()
    if summary.stopped_at is not None:
        # saved and committed on every rank: torchrun's agent SIGTERMs the ranks still running once
        # one has exited, and that is no second stop signal to leave on before this rank's line is
        # out
        ignore_stop_signals()
        saved = (
            f"checkpoint {summary.checkpoint} (step {summary.stopped_at}) is saved; continue with "
            "--resume"
            if summary.checkpoint
            else "no checkpoint saved (checkpoint.dir is not set)"
            if not cfg.checkpoint.dir
            else "no checkpoint saved (no step was completed: a run starts at step 0 again)"
        )
        where = "on this rank" if stop.signalled else "on another rank"
        ended = (
            f"step {summary.stopped_at + 1} of {cfg.run.steps} abandoned midway, not applied"
            if summary.abandoned
            else f"the run stopped after step {summary.stopped_at} of {cfg.run.steps}"
        )
        if rank == 0:  # every rank stopped after the same agreed step: rank 0 says it for the job
            say(f"rrfp: stopped: rank {rank}: {stop.name} {where}; {ended}; {saved}")
        exit_now(stopped_exit(stop.name))
    if rank == 0:
        resumed = f" after step {summary.first_step}" if summary.first_step else ""
        skipped = f" ({len(summary.skipped)} skipped: NaN/Inf)" if summary.skipped else ""
        print(
            f"done: {len(summary.losses)} steps{resumed}{skipped}, loss {summary.losses[0]:.4f} -> "
            f"{summary.losses[-1]:.4f}, "
            f"decision cost {summary.statistics.decision_us:.1f} us",
            flush=True,
        )
        if summary.metrics:
            print(f"metrics: {summary.metrics}{_mfu_note(cfg)}", flush=True)
        if summary.plan_s:
            waits = summary.plan_waited_s[1:] or [0.0]  # step 1's plan cannot be made ahead
            print(
                f"plan: {1e3 * statistics.median_high(summary.plan_s):.1f} ms per step (median, "
                f"in a thread, one step ahead); steps after the first waited for it "
                f"{1e3 * statistics.median_high(waits):.2f} ms (median), {1e3 * max(waits):.2f} ms "
                "at most",
                flush=True,
            )
    exit_now(0)


def _load(args, implied_world: bool, launching: bool = False) -> TrainConfig:
    """The config of the command line (``--resume`` is ``checkpoint.resume=required``)."""
    sets = [*args.set, *(["checkpoint.resume=required"] if args.resume else [])]
    world = args.nproc_per_node if launching else None
    return TrainConfig.load(args.config, sets, world_size=world, implied_world=implied_world)


def dry_run_text(cfg: TrainConfig, prints: list[Footprint] | None) -> str:
    """What ``--dry-run`` prints: the stage layout, the memory estimate, the resolved config."""
    lines = [cfg.layout.describe(), f"backend: {cfg.compute.backend} ({cfg.backend_choice})"]
    if cfg.parallel.virtual > 1:
        lines.append(f"stages: {cfg.virtual_layout.describe()}")
    if prints is None:
        lines.append("memory: not estimated (the model does not build on the meta device)")
    for r, fp in enumerate(prints or []):
        stages = ", ".join(map(str, cfg.virtual_layout.stages_of(r)))
        lines.append(
            f"memory: pipeline rank {r} (stage {stages}): at least {_gib(fp.total)} "
            f"({_gib(fp.state)} parameters, gradients and optimizer state; {_gib(fp.activations)} "
            f"activations, {fp.in_flight} in flight; {_gib(fp.batches)} input batches)"
        )
    waits = ", ".join(f"{k} = {v:g}" for k, v in dataclasses.asdict(cfg.waits).items())
    lines += ["", "# the resolved config", toml_text(cfg.as_toml()), f"# waits: {waits}", ""]
    return "\n".join(lines)


def _mfu_note(cfg: TrainConfig) -> str:
    """What the MFU column is against, said once at the end of a run."""
    from rrfp.app.train.metrics_mfu import device_peak

    device = torch.device(cfg.compute.device_type, 0 if cfg.compute.device_type == "cuda" else None)
    peak = device_peak(device, cfg.compute.autocast, cfg.compute.threads, cfg.output.peak_tflops)
    if peak is None:
        return "; no MFU: no known peak for this device (set output.peak_tflops)"
    return f"; MFU against {peak.tflops:g} TFLOPS per rank ({peak.source})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _fail(e: BaseException, cfg: TrainConfig, rank: int, debug: bool) -> None:
    """One line on stderr (rrfp/app/job/failure.py says which), the traceback to the log, then
    leave."""
    # torchrun's agent SIGTERMs the other ranks as soon as one exits: finish this line first (a
    # second or two at most, then exit_now below; the agent waits far longer before its SIGKILL)
    ignore_stop_signals()
    failure = Failure.of(e)
    # rrfp train --nproc-per-node: the job's one line is the first failed rank's, or the
    # launcher's for a rank that a signal ended (rrfp/app/job/launch_agent.py); this one is silent
    silent = failure.follows_peer and os.environ.get(LAUNCHED) == "1"
    board = FailureBoard.connect()  # best effort: tells the others how this rank failed
    origin = None
    if board is not None:
        board.post(rank, failure.note)
        if failure.follows_peer and not silent:
            origin = board.origin(rank, getattr(failure.cause, "peer", None))
    path = write_traceback(e, cfg.output.log_dir, rank)
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    stage = cfg.virtual_layout.stages_of(cfg.layout.coords(rank).pp)
    line = f"rrfp: error: {failure.line(rank, stage, path, debug, origin, cfg.run.model)}"
    if isinstance(
        root_cause(e), UsageError
    ):  # e.g. the ranks found different checkpoints: alike on every rank
        refuse_once(" ".join(str(root_cause(e)).split()), line, board)
    elif not silent:
        if not failure.follows_peer:  # torchrun's summary shows it in place of its own text
            tell_torchrun(line)
        say(line)
    exit_now(
        2 if isinstance(root_cause(e), UsageError) else 1
    )  # e.g. a checkpoint that does not load: 2
