"""A rank of ``rrfp train --nproc-per-node``: a fork of the launcher, which has imported torch and
rrfp already, set up as the ``python -u -m rrfp train ARGS`` that torchrun would otherwise start.

A fresh interpreter per rank imports torch, torch._dynamo and rrfp again: about 4 CPU-s a rank
before its first step, on every launch. torchrun's agent can run a script in a fork of itself
(``--start-method fork --run-path``, its ``run_script_path``); this is that script. It undoes what
the fork carries over that a fresh interpreter would not have: the agent's handlers of the stop
signals, torch.multiprocessing's parent-death signal (a rank outlives a killed agent and says so,
as a torchrun rank does), buffered output, the launcher's ``sys.argv`` and ``sys.path``.

torch's multiprocessing ends a forked rank when its function returns, and its agent counts a
rank done only by the value it returns: ``exit_now(0)``, which leaves a rank at once without it,
leaves by ``SystemExit(0)`` here (rrfp/app/errors.py ``FORKED``); a failure's exit code is the
process's, as for a fresh rank.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import sys

# what a fresh interpreter has for the signals torchrun's agent handles (Ctrl-C, SIGTERM, and
# SIGHUP and SIGQUIT, which it passes on): the launcher's own, saved before the agent started
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_LAUNCHERS: dict[int, object] = {}

PR_SET_PDEATHSIG = 1  # prctl(2)


def save_launcher_signals() -> None:
    """Remember the launcher's handlers of STOP_SIGNALS, which its ranks start with: before
    torchrun's agent installs its own."""
    _LAUNCHERS.update({int(s): signal.getsignal(s) for s in STOP_SIGNALS})


def _as_fresh_interpreter(argv: list[str]) -> None:
    for sig, handler in _LAUNCHERS.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    for name in ("stdout", "stderr"):  # python -u: each write reaches the file as it is made
        stream = getattr(sys, name)
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(
            sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors, write_through=True)
        )
    import rrfp

    sys.argv = [os.path.join(os.path.dirname(rrfp.__file__), "__main__.py"), *argv]
    sys.path.insert(0, os.getcwd())  # python -m: the current folder first


def main() -> None:
    """``rrfp ARGS`` for torchrun's ``run_script_path``, which set ``sys.argv`` to this file and
    the arguments it was given."""
    from rrfp.app import errors

    argv = sys.argv[1:]
    _as_fresh_interpreter(argv)
    errors.FORKED = True
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from rrfp.app.cli.main import main as rrfp_main

    sys.exit(rrfp_main(argv))


if __name__ == "__main__":  # run by path: the module's own main, with the launcher's handlers
    from rrfp.app.job.forked_rank import main as forked_main

    forked_main()
