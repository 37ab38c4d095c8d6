"""`rrfp train` (or a script) on two ranks, each rank a child of the test session's forkserver
(torch and rrfp already imported) that runs ``rrfp.app.cli.main.main`` as ``python -m rrfp``
would (or the script as ``python SCRIPT`` would): its own stdout and stderr files, its own
signal handlers, its exit status. A rank starts in milliseconds instead of the seconds an
interpreter takes to import torch, so a table of faults costs what its faults do."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT
from harness.distributed import _context, free_port
from harness.launch import DROPPED_PREFIXES, LAUNCHER_VARS, rank_vars


def _as_rank(rank: int, world: int, port: int, tmp: str, env: dict[str, str], sigint) -> None:
    """This process as a launched rank: the environment a launcher gives it (and ``env``), stdout
    and stderr in files, a process group of its own, SIGINT's handler ``sigint``."""
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(DROPPED_PREFIXES):
            del os.environ[k]
    os.environ.update(rank_vars(rank, world, port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    os.environ.update(env)
    os.chdir(ROOT)
    os.setsid()  # a group of its own, as a launched rank's: a fault's signal is its own
    for fd, name in ((1, f"out{rank}"), (2, f"err{rank}")):
        os.dup2(os.open(Path(tmp) / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # a forkserver child inherits the server's handlers
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    argv: list[str],
    tmp: str,
    env: dict[str, str] | None = None,
    sigint=signal.SIG_DFL,
) -> None:
    """One rank of `rrfp ARGV`; SIGINT's handler is ``sigint`` until rrfp sets its own."""
    _as_rank(rank, world, port, tmp, env or {}, sigint)
    from rrfp.app.cli.main import main

    _leave(main(argv))


def _script_main(
    rank: int, world: int, port: int, argv: list[str], tmp: str, env: dict[str, str]
) -> None:
    """One rank of ``python SCRIPT ARGS`` (``argv``: the script and its arguments), as torchrun
    starts it: the script is ``__main__``, its folder first on sys.path."""
    import runpy
    import traceback

    _as_rank(rank, world, port, tmp, env, signal.SIG_DFL)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        _leave(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        _leave(1)
    _leave(0)


# what torchrun's agent adds to a rank's environment when it serves the job's store
AGENT_STORE_VARS = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


@dataclass
class TrainJob:
    """Two (or ``world``) ranks of ``rrfp train ARGV``, started now; ``tmp`` holds their output.
    ``agent_store``: the job's store is served by this test process, as torchrun's agent serves
    it, not by rank 0: what a rank says once for the whole job under torchrun (a refusal) it
    says once here too. ``script``: the ranks run ``python SCRIPT ARGV`` instead, as torchrun
    runs a script."""

    tmp: Path
    argv: list[str]
    world: int = 2
    agent_store: bool = False
    script: Path | None = None

    def __post_init__(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        ctx, port = _context(), free_port()
        self.store, env = None, {}
        if self.agent_store:
            import datetime

            import torch.distributed as dist

            self.store = dist.TCPStore(
                "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=60)
            )
            env = AGENT_STORE_VARS
        self.started = time.monotonic()
        target, argv = (
            (_rank_main, ["train", *self.argv])
            if self.script is None
            else (_script_main, [str(self.script), *self.argv])
        )
        self.procs = [
            ctx.Process(target=target, args=(r, self.world, port, argv, str(self.tmp), env))
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self.ended: dict[int, float] = {}  # rank -> monotonic time its process ended

    def poll(self) -> None:
        for r, p in enumerate(self.procs):
            if r not in self.ended and p.exitcode is not None:
                self.ended[r] = time.monotonic()

    def wait(self, ranks, until: float) -> bool:
        """Until every rank of ``ranks`` ended or the monotonic time ``until``; True if they did."""
        while True:
            self.poll()
            if all(r in self.ended for r in ranks):
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(0.02)

    def finish(self, limit_s: float) -> TrainJob:
        """Wait until every rank ended, at most ``limit_s`` from the start, then end whatever is
        left of the job; fails with the ranks' output if one was still running."""
        try:
            ended = self.wait(range(self.world), self.started + limit_s)
            assert ended, f"still running {limit_s} s after the start\n" + self.tails()
        finally:
            self.kill()
        return self

    def code(self, rank: int) -> int | None:
        return self.procs[rank].exitcode

    def codes(self) -> list[int | None]:
        """Every rank's exit status (None: still running; -N: ended by signal N)."""
        return [p.exitcode for p in self.procs]

    def tails(self) -> str:
        """The end of what each rank printed, for an assertion's message."""
        return "\n".join(
            f"--- rank {r}:\n{self.out(r)[-800:]}\n{self.err(r)[-1500:]}" for r in range(self.world)
        )

    def out(self, rank: int) -> str:
        return self._read(f"out{rank}")

    def err(self, rank: int) -> str:
        return self._read(f"err{rank}")

    def _read(self, name: str) -> str:
        """A file the rank writes; "" before the rank has opened it."""
        try:
            return (self.tmp / name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def lines(self, rank: int) -> list[str]:
        """What the rank said to its user: its lines that start with ``rrfp:``."""
        return [ln for ln in self.err(rank).splitlines() if ln.startswith("rrfp:")]

    def kill(self) -> None:
        """Whatever is left of the job (a stopped rank, its beater, a `sh` that would continue
        it), by process group."""
        for p in self.procs:
            if p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(5)
        self.store = None  # its server ends with it


def losses(stdout: str) -> dict[int, str]:
    """{step: printed loss} of rank 0's step lines."""
    return {int(m[1]): m[2] for m in re.finditer(r"^step\s+(\d+)/\d+\s+loss (\S+)", stdout, re.M)}
