"""Fault injection, a testing aid (in the spirit of torchft's failure injector):
make one rank fail at a chosen (step, stage, task) or phase to check how the others end.

A fault is written ``KIND[:step=N][:stage=S][:rank=R][:task=T|:during=P][:attempt=A][:seconds=X]``,
in ``debug.fault`` or the ``RRFP_FAULT`` environment variable. ``step`` counts from 1, as
``rrfp train`` prints it; ``stage`` and ``rank`` pick the ranks that fail (every rank of the stage
when only ``stage`` is given); ``task`` (e.g. ``B2``) fires right after that task finishes;
``during`` names a phase; otherwise it fires at the end of the step's iteration. ``attempt`` fires
only in that attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT``, 0 for the first), so a job
restarted with ``--max-restarts`` runs on after it.

Phases (``during=P``), each where a rank waits for its peers in its own way:
``startup`` (before this rank joins the rendezvous; no step: once per run), ``sync`` (as this rank
starts step N's gradient sync, after its backward), ``save`` (as it starts writing the checkpoint
saved after step N), ``commit`` (once its part is written, as the checkpoint is committed: rank 0
commits, inside the commit's write, which its peers count as progress, and the others wait for
it) and ``barrier`` (as it reaches the final barrier after its last
step; no step).

Kinds: ``kill`` (SIGKILL itself: a crashed host), ``stop`` (SIGSTOP itself: alive but silent; with
``seconds=X`` it is continued after X seconds, a stop shorter or longer than the timeout),
``term`` (SIGTERM itself: what torchrun's agent or a scheduler sends to stop a job), ``raise`` (an
``InjectedFault``: a failure the run reports), ``bug`` (a plain RuntimeError: what an internal
error looks like), ``nan`` (the stage's gradients become NaN at the end of the step's backward; no
task), ``busy`` (the main thread computes for ``seconds=X``, holding the GIL in turns as Python
code does: alive but slow, e.g. longer than run.timeout_s), ``slow`` (task T holds its compute lane
``seconds`` longer, as a long kernel would: a step longer than any grace period, to test a stop
that does not wait; with ``during``, the rank sleeps ``seconds`` there, as a slow file system
would), ``hang`` (with ``during=P`` or ``task=T``: the rank sleeps there for good, alive and
beating but never arriving, as a rank stuck in a user's code would; with ``task=T`` inside the
task, on its compute lane, before T computes, so never reaching T's TP collectives: its peers wait
``timeouts.progress_s`` for it at their next collective) and ``full`` (a disk that takes no more:
with ``during=save``, the rank's file size limit drops to ``FULL_BYTES``, as ``ulimit -f`` would set
it, so torch's writer fails on the checkpoint's real file with EFBIG; elsewhere an OSError ENOSPC
raised where it fires, e.g. with ``during=commit`` on rank 0, in the commit's own write).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from rrfp.comm.job_store import attempt
from rrfp.core.errors import InjectedFault
from rrfp.core.tasks import Task

log = logging.getLogger("rrfp.app.faults")

KINDS = ("kill", "stop", "term", "raise", "bug", "nan", "busy", "slow", "hang", "full")
PHASES = ("startup", "sync", "save", "commit", "barrier")  # during=P
RUN_PHASES = ("startup", "barrier")  # once per run, not of a step: they take no step
# full during=save: this rank's file size limit (RLIMIT_FSIZE) from then on, under a checkpoint
# file's size and over what a rank logs (Python ignores SIGXFSZ, so a write past it fails: EFBIG)
FULL_BYTES = 16 << 10
TIMED = ("busy", "slow")  # kinds that need seconds=X (stop takes it optionally)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # 1-based, as printed; 0 for a phase of the run (RUN_PHASES)
    stage: int | None = None
    rank: int | None = None
    task: Task | None = None
    attempt: int | None = None  # torchrun's restart count in which it fires; None: every attempt
    seconds: float | None = None  # busy: how long; slow: how much longer; stop: until continued
    during: str | None = None  # a PHASES entry: the phase it fires in

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """``kill:step=3:stage=1:task=B2``; ValueError names what is wrong."""
        kind, *fields = [p.strip() for p in spec.strip().split(":")]
        if kind not in KINDS:
            raise ValueError(
                f"fault {spec!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}"
            )
        values: dict = {}
        for f in fields:
            key, sep, raw = f.partition("=")
            if (
                not sep
                or key not in ("step", "stage", "rank", "task", "attempt", "seconds", "during")
                or key in values
            ):
                raise ValueError(
                    f"fault {spec!r}: {f!r} is not one of step=N, stage=S, rank=R, task=T, "
                    "attempt=A, seconds=X, during=P (once each)"
                )
            if key == "task":
                values[key] = Task.parse(raw)
                continue
            if key == "during":
                if raw not in PHASES:
                    raise ValueError(
                        f"fault {spec!r}: during must be one of {', '.join(PHASES)}, got {raw!r}"
                    )
                values[key] = raw
                continue
            if key == "seconds":
                try:
                    values[key] = float(raw)
                except ValueError:
                    raise ValueError(
                        f"fault {spec!r}: seconds must be a number, got {raw!r}"
                    ) from None
                if not 0 < values[key] <= 3600:
                    raise ValueError(f"fault {spec!r}: seconds={raw} is out of range (0, 3600]")
                continue
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"fault {spec!r}: {key} must be an integer, got {raw!r}") from None
            if values[key] < (1 if key == "step" else 0):
                raise ValueError(f"fault {spec!r}: {key}={values[key]} is out of range")
        if values.get("during") in RUN_PHASES:
            if "step" in values:
                raise ValueError(
                    f"fault {spec!r}: during={values['during']} happens once per run: it takes "
                    "no step"
                )
            values["step"] = 0
        if "step" not in values:
            raise ValueError(f"fault {spec!r}: step=N is required")
        if "stage" not in values and "rank" not in values:
            raise ValueError(f"fault {spec!r}: say where: stage=S or rank=R")
        if kind == "slow" and (
            ("task" in values) == ("during" in values) or "seconds" not in values
        ):
            raise ValueError(
                f"fault {spec!r}: slow takes task=T or during=P, and seconds=X (how much longer T "
                "holds its lane, or the rank sleeps in P)"
            )
        if (
            kind in TIMED
            and "seconds" not in values
            or (kind not in (*TIMED, "stop") and "seconds" in values)
        ):
            raise ValueError(
                f"fault {spec!r}: seconds=X goes with busy and slow (and stop, to continue it); "
                "other kinds take no seconds"
            )
        if kind == "hang" and "during" not in values and "task" not in values:
            raise ValueError(
                f"fault {spec!r}: hang takes during=P or task=T (the phase or task it sleeps in)"
            )
        if "during" in values and ("task" in values or kind == "nan"):
            raise ValueError(f"fault {spec!r}: during=P takes no task, and no nan")
        if kind == "nan" and "task" in values:
            raise ValueError(f"fault {spec!r}: nan poisons the step's gradients; it takes no task")
        return cls(kind, **values)

    def __str__(self) -> str:
        fields = (
            ("step", self.step or None),
            ("stage", self.stage),
            ("rank", self.rank),
            ("task", self.task),
            ("attempt", self.attempt),
            ("seconds", self.seconds),
            ("during", self.during),
        )
        where = [
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields if v is not None
        ]
        return ":".join([self.kind, *where])

    def hits(self, rank: int, stage: int) -> bool:
        return (
            (self.stage is None or self.stage == stage)
            and (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == int(attempt() or 0))
        )


_PAUSER = (
    "import os, signal, sys, time; pid, s = int(sys.argv[1]), float(sys.argv[2]); "
    "os.kill(pid, signal.SIGSTOP); time.sleep(s); os.kill(pid, signal.SIGCONT)"
)


def pause(seconds: float) -> None:
    """SIGSTOP this process for ``seconds``, as a user's Ctrl-Z and ``fg`` would: a process of
    its own, started first, stops it, sleeps and continues it, so that the stop lasts
    ``seconds`` however late a loaded machine starts that process."""
    pauser = subprocess.Popen(
        [sys.executable, "-S", "-c", _PAUSER, str(os.getpid()), repr(seconds)],
        start_new_session=True,
    )
    pauser.wait()


# how a fault's line says where it fired, by phase (rank, stage, step)
PHASE_WORDS = {
    "startup": lambda r, s, n: f"rank {r} stage {s}: during start-up",
    "sync": lambda r, s, n: f"rank {r} stage {s}: step {n} during the gradient sync",
    "save": lambda r, s, n: f"rank {r} stage {s}: step {n} during the checkpoint write",
    "commit": lambda r, s, n: f"rank {r} stage {s}: step {n} during the checkpoint commit",
    "barrier": lambda r, s, n: f"rank {r} stage {s}: at the final barrier",
}


class FaultInjector:
    """Fires ``fault`` on this rank; ``train`` calls ``begin_step`` before each step,
    the executor calls ``hold_s`` before each task, ``task_begins`` on the lane as the task begins
    and ``task_done`` after it, ``train`` calls
    ``iteration_done`` between the backward and the gradient sync, and ``phase`` as this rank
    enters each phase of PHASES."""

    def __init__(self, fault: Fault, rank: int, stage: int) -> None:
        self.fault, self.rank, self.stage = fault, rank, stage
        self.step = 0  # 1-based step now running

    @classmethod
    def for_rank(cls, spec: Fault | None, rank: int, stage: int) -> FaultInjector | None:
        return cls(spec, rank, stage) if spec is not None and spec.hits(rank, stage) else None

    def begin_step(self, step: int) -> None:
        self.step = step + 1

    def hold_s(self, task: Task) -> float:
        """Extra seconds ``task`` holds the lane; the executor asks before it runs the task."""
        if self.fault.kind == "slow" and task == self.fault.task and self.step == self.fault.step:
            log.warning(
                "rank %d stage %d: step %d task %s: injecting fault %s",
                self.rank,
                self.stage,
                self.step,
                task,
                self.fault,
            )
            return float(self.fault.seconds)
        return 0.0

    def task_begins(self, task: Task) -> None:
        """On the lane's thread, as ``task`` begins: a hang inside it."""
        if self.fault.kind == "hang" and task == self.fault.task and self.step == self.fault.step:
            self._fire()

    def task_done(self, task: Task) -> None:
        if (
            self.fault.kind not in ("slow", "hang")
            and self.fault.task is not None
            and task == self.fault.task
            and self.step == self.fault.step
        ):
            self._fire()

    def iteration_done(self, module: torch.nn.Module) -> None:
        if (
            self.fault.kind != "slow"
            and self.fault.task is None
            and self.fault.during is None
            and self.step == self.fault.step
        ):
            self._fire(module)

    def phase(self, phase: str, step: int = 0) -> None:
        """As this rank enters ``phase`` of (1-based) ``step`` (0: a phase of the run)."""
        if phase not in PHASES:
            raise ValueError(f"no phase {phase!r} (one of {', '.join(PHASES)})")
        if self.fault.during == phase and step == self.fault.step:
            self._fire()

    def checkpoint_write(self, done: int, phase: str = "save") -> None:
        """Before this rank writes its part of the checkpoint saved after ``done`` steps (``save``),
        and once it has, before the commit (``commit``)."""
        self.phase(phase, done)

    def _fire(self, module: torch.nn.Module | None = None) -> None:
        where = f"rank {self.rank} stage {self.stage}: step {self.step}"
        if self.fault.task is not None:
            where += f" task {self.fault.task}"
        if self.fault.during is not None:
            where = PHASE_WORDS[self.fault.during](self.rank, self.stage, self.fault.step)
        log.warning("%s: injecting fault %s", where, self.fault)
        kind = self.fault.kind
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop" and self.fault.seconds is not None:
            pause(self.fault.seconds)
            log.warning("%s: continued after %g s", where, self.fault.seconds)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "raise":
            raise InjectedFault(f"{where}: injected fault ({self.fault})")
        elif kind == "full" and self.fault.during == "save":
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_BYTES, hard))
        elif kind == "full":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: {where})")
        elif kind == "bug":
            raise RuntimeError(f"{where}: injected internal error ({self.fault})")
        elif kind == "busy":
            end = time.monotonic() + self.fault.seconds
            while (
                time.monotonic() < end
            ):  # pure Python: the heartbeat thread gets the GIL only in turns
                pass
            log.warning("%s: busy for %g s, done", where, self.fault.seconds)
        elif kind == "slow":  # during=P: the heartbeat thread beats on, as in a slow write
            time.sleep(self.fault.seconds)
            log.warning("%s: slow for %g s, done", where, self.fault.seconds)
        elif kind == "hang":  # the heartbeat beats on: alive, and never arriving
            while True:
                time.sleep(3600)
        elif kind == "nan" and module is not None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            if grads:
                grads[0].view(-1)[0] = math.nan
