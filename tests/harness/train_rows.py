"""`rrfp train` (or a script) on two ranks, each rank a child of the test session's forkserver
(torch and rrfp already imported) that runs ``rrfp.app.cli.main.main`` as ``python -m rrfp``
would (or the script as ``python SCRIPT`` would): its own stdout and stderr files, its own
signal handlers, its exit status. A rank starts in milliseconds instead of the seconds an
interpreter takes to import torch, so a table of faults costs what its faults do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from harness import ROOT
from harness.distributed import _context, free_port, freeze_inherited_heap
from harness.launch import DROPPED_PREFIXES, LAUNCHER_VARS, rank_vars
from rrfp.app.job import forked_rank


def _as_started(out: str, err: str, env: dict[str, str], sigint, cwd: str | None = None) -> None:
    """This forkserver child as a process a test started: a child's environment (launcher and
    rrfp variables dropped, one thread, unbuffered) and ``env``, ``cwd`` (the repository unless
    given) as its folder, a process group of its own, stdout and stderr in the files ``out`` and
    ``err``, SIGINT's handler ``sigint``."""
    freeze_inherited_heap()
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(DROPPED_PREFIXES):
            del os.environ[k]
    os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    os.environ.update(env)
    os.chdir(cwd or ROOT)
    # a process group of its own, as a launched rank's: a fault's signal is its own. Not a session
    # of its own: where the kernel groups CPU time by session (autogroup, on in CI's machine), each
    # such process would get as much CPU as the whole test session besides, whose other ranks,
    # bound by the same few seconds, then starve
    os.setpgid(0, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    # a forkserver child inherits the server's handlers
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _as_rank(rank: int, world: int, port: int, tmp: str, env: dict[str, str], sigint) -> None:
    """This process as a launched rank: the environment a launcher gives it (and ``env``), stdout
    and stderr in TMP/outRANK and TMP/errRANK."""
    _as_started(
        str(Path(tmp) / f"out{rank}"),
        str(Path(tmp) / f"err{rank}"),
        {**rank_vars(rank, world, port), **env},
        sigint,
    )


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


def _as_main(run) -> None:
    """``run()`` as an interpreter's __main__, then leave with its exit status: SystemExit's
    code, 1 after the traceback of any other exception, else 0."""
    import traceback

    try:
        run()
    except SystemExit as e:
        _leave(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        _leave(1)
    _leave(0)


def _script_main(
    rank: int, world: int, port: int, argv: list[str], tmp: str, env: dict[str, str]
) -> None:
    """One rank of ``python SCRIPT ARGS`` (``argv``: the script and its arguments), as torchrun
    starts it: the script is ``__main__``, its folder first on sys.path."""
    import runpy

    _as_rank(rank, world, port, tmp, env, signal.SIG_DFL)
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).parent))
    _as_main(lambda: runpy.run_path(argv[0], run_name="__main__"))


def script_rank(
    script: Path, rank: int, world: int, port: int, tmp: Path, env: dict[str, str]
) -> AsPopen:
    """Rank ``rank`` of ``python SCRIPT`` alone, started now from the preloaded forkserver (its
    output in TMP/outRANK and TMP/errRANK): a peer beside ranks a test starts otherwise, such as
    a fresh interpreter whose own exit is the point."""
    p = _context().Process(
        target=_script_main, args=(rank, world, port, [str(script)], str(tmp), env)
    )
    p.start()
    return AsPopen(p)


def _cpp_log_level_as_rrfp_sets_it() -> None:
    """torch's C++ log level as in an ``rrfp`` process: its entry sets TORCH_CPP_LOG_LEVEL before
    torch loads (rrfp/app/cli/main.py), and the ranks its launcher forks keep the level torch read
    then; the forkserver loaded torch before, so torch's C++ side reads the variable again."""
    import ctypes

    import torch

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))._ZN3c1011initLoggingEv()


FORKED_RANK = forked_rank.__file__


def forked_rrfp(*argv: str) -> list[str]:
    """torchrun's arguments that run ``python -m rrfp ARGV`` in each rank as a fork of its agent
    (rrfp/app/job/forked_rank.py), as ``rrfp train --nproc-per-node`` has its ranks, instead of
    ``-m rrfp ARGV``'s fresh interpreter per rank: an agent started by ``python_m`` has imported
    torch and rrfp, so a rank starts without about 4 CPU-s of imports. For tests whose point is
    the agent's handling of its ranks (signals, restarts), not an interpreter's start. Its
    failure summary names the first failed rank alone."""
    return [*forked_rank.torchrun_args("rrfp"), *argv]


def _module_main(
    module: str,
    argv: list[str],
    out: str,
    err: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> None:
    """``python -m MODULE ARGV`` in a child's environment and ``env``."""
    _as_started(out, err, env or {}, signal.default_int_handler, cwd)
    _as_main(module_run(module, argv))


def module_run(module: str, argv: list[str]) -> Callable[[], object]:
    """What ``python -m MODULE ARGV`` runs, in this process set up as the child: the module as
    ``__main__``, the current folder first on sys.path. rrfp's launcher imported torchrun's agent
    as rrfp runs it already: that one's main runs as its ``__main__`` block would run it."""
    import runpy

    if module == "rrfp" or FORKED_RANK in argv:  # the ranks run rrfp in this process's torch
        _cpp_log_level_as_rrfp_sets_it()
    sys.argv = [module, *argv]
    if module == "rrfp.app.job.launch_agent":
        from rrfp.app.job.launch_agent import main

        return lambda: sys.exit(main(argv))
    sys.path.insert(0, os.getcwd())
    return partial(runpy.run_module, module, run_name="__main__", alter_sys=True)


class AsPopen:
    """A forkserver child as the tests read a ``Popen``: pid, returncode, poll, send_signal,
    wait."""

    def __init__(self, process) -> None:
        self.process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.process.name), timeout)
        return self.process.exitcode


def python_m(
    module: str,
    *argv: str,
    out: Path,
    err: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> AsPopen:
    """``python -m MODULE ARGV`` (``rrfp``, ``torch.distributed.run``, rrfp's agent...), started
    now as a child of the preloaded forkserver instead of an interpreter that imports torch: a
    child's environment and ``env``, ``cwd`` (else the repository) as its folder, a session of its
    own, stdout and stderr in the files ``out`` and ``err``. The ranks torchrun's agent starts are
    fresh interpreters; those of ``rrfp train --nproc-per-node`` are forks of its launcher."""
    for path in (out, err):  # readable from the start, as a Popen's files are
        path.write_text("")
    p = _context().Process(
        target=_module_main,
        args=(module, list(argv), str(out), str(err), env, None if cwd is None else str(cwd)),
    )
    p.start()
    deadline = time.monotonic() + 30
    while p.exitcode is None and time.monotonic() < deadline:  # its session, as Popen's is once
        try:  # started: killpg reaches it
            if os.getpgid(p.pid) == p.pid:
                break
        except ProcessLookupError:
            break
        time.sleep(0.005)
    return AsPopen(p)


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
