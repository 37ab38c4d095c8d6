"""A rank forked by torchrun's agent from a process that has imported torch already, set up as the
``python -u -m MODULE ARGS`` that torchrun would otherwise start: ``rrfp train`` under
``rrfp train --nproc-per-node`` (the launcher is the agent, rrfp imported too), the bench's ranks.

A fresh interpreter per rank imports torch, torch._dynamo and rrfp again: about 4 CPU-s a rank
before its first step, on every launch. torchrun's agent can run a script in a fork of itself
(``--start-method fork --run-path SCRIPT``, its ``run_script_path``); this is that script, with
the module and its arguments as the script's. It undoes what the fork carries over that a fresh
interpreter would not have: the agent's handlers of the stop signals (a launcher's own come back,
saved before its agent started; else the defaults), torch.multiprocessing's parent-death signal
(a rank outlives a killed agent and says so, as a torchrun rank does), buffered output, the
agent's ``sys.argv`` and ``sys.path`` (python -m: the current folder first).

torch's multiprocessing ends a forked rank when its function returns, and its agent counts a
rank done only by the value it returns: ``exit_now(0)``, which leaves a fresh rank at once, leaves
a forked one by ``SystemExit(0)`` (``done``); a failure's exit code is the process's, as for a
fresh rank.
"""

from __future__ import annotations

import ctypes
import io
import os
import runpy
import signal
import sys

# the signals torchrun's agent handles (Ctrl-C, SIGTERM, and SIGHUP and SIGQUIT, which it passes
# on), and what a fresh interpreter has for them unless its parent ignored them
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_DEFAULTS = {int(s): signal.SIG_DFL for s in STOP_SIGNALS} | {
    int(signal.SIGINT): signal.default_int_handler
}
_LAUNCHERS: dict[int, object] = {}

PR_SET_PDEATHSIG = 1  # prctl(2)
_AGENT: list[int] = []  # the pid of the agent that forked this rank


def torchrun_args(module: str) -> list[str]:
    """torchrun's arguments that run ``python -u -m MODULE`` (the arguments that follow) in each
    rank as a fork of its agent: this file as the script."""
    return ["--start-method", "fork", "--run-path", __file__, module]


def save_launcher_signals() -> None:
    """Remember this process's handlers of STOP_SIGNALS, which the ranks its agent forks start
    with: before torchrun's agent installs its own."""
    _LAUNCHERS.update({int(s): signal.getsignal(s) for s in STOP_SIGNALS})


def _parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def done() -> None:
    """Leave a finished rank by returning to torch's multiprocessing, whose rank then waits for
    the agent to read that it is done: SIGKILL if the agent dies meanwhile, and at once if it has
    died already, so that no rank waits for an agent that is gone."""
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != _AGENT[0]:
        os._exit(0)
    raise SystemExit(0)


def as_fresh_interpreter(module_path: str, argv: list[str]) -> None:
    """Undo in this fork what a fresh ``python -u -m MODULE_PATH ARGV`` would not have: the stop
    signals' handlers, the parent-death signal, buffered output on fds 1 and 2, ``sys.argv``."""
    for sig, handler in (_LAUNCHERS or _DEFAULTS).items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    _parent_death_signal(0)
    # python -u: each write reaches the file as it is made; the files are fds 1 and 2 as the parent
    # left them, whatever object its sys.stdout was
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        encoding = getattr(getattr(sys, name), "encoding", None) or "utf-8"
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding, errors, write_through=True))
    sys.argv = [module_path, *argv]
    sys.path.insert(0, os.getcwd())  # python -m: the current folder first


def main() -> None:
    """``python -u -m MODULE ARGS`` for torchrun's ``run_script_path``, which set ``sys.argv`` to
    this file, MODULE and ARGS."""
    from rrfp.app import errors

    module, *argv = sys.argv[1:]
    _AGENT.append(os.getppid())
    as_fresh_interpreter(module, argv)
    errors.forked_done = done
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # run by path: the module's own main, with the launcher's handlers
    from rrfp.app.job.forked_rank import main as forked_main

    forked_main()
