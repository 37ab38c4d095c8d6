"""``subprocess.run([sys.executable, ARGS...])`` as a child of the test session's preloaded
forkserver (torch, dynamo and rrfp already imported): the same exit code, stdout and stderr for
``python -c CODE ARGS``, ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``, without the seconds
of CPU an interpreter takes to import torch. For code whose own runs start ``python`` (a
script's checks), where the interpreter's start is not what the test is about."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from harness.distributed import _context
from harness.train_rows import _as_main, _as_started, module_run


def _python_main(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    out: str,
    err: str,
    path: list[str] | None = None,
) -> None:
    """This forkserver child as ``python ARGV`` started with ``env`` in ``cwd`` (a session of its
    own, stdout and stderr in the files ``out`` and ``err``), leaving as an interpreter does:
    through the exit handlers the run registered (atexit), unless it leaves at once (os._exit, a
    signal). The server's own exit handlers are not the run's. ``path``: sys.path after its first
    entry (which ARGV decides), as an interpreter started with ``env`` has it."""
    os.environ.clear()
    _as_started(out, err, env, signal.default_int_handler, cwd)
    if path is not None:
        sys.path[:] = path
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        code = compile(argv[1], "<string>", "exec")
        run = partial(exec, code, {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv[0] == "-m":
        run = module_run(argv[1], argv[2:])
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        run = partial(runpy.run_path, argv[0], run_name="__main__")
    atexit._clear()

    def as_interpreter() -> None:
        try:
            run()
        finally:
            atexit._run_exitfuncs()

    _as_main(as_interpreter)


def interpreter_path(env: dict[str, str], cwd: str | Path) -> list[str]:
    """sys.path after its first entry in an interpreter started with ``env`` in ``cwd``
    (PYTHONPATH, the standard library, site-packages and what their .pth files add), read from
    one that imports nothing else: milliseconds, not torch's seconds."""
    res = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(res.stdout)


def run_python(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path,
    timeout: float,
    own_path: bool = False,
) -> subprocess.CompletedProcess:
    """``python ARGV`` to its end in a forkserver child, as ``subprocess.run(capture_output=True,
    text=True)`` gives it; one still running after ``timeout`` seconds is killed, with all it
    started, and raises TimeoutExpired. ``own_path``: the child's sys.path is the one an
    interpreter started with ``env`` has (interpreter_path), not the test session's (the
    repository, tests/): for what looks a module up from where it runs."""
    env = dict(os.environ if env is None else env)
    path = interpreter_path(env, cwd) if own_path else None
    with tempfile.TemporaryDirectory(prefix="forked-python-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        p = _context().Process(
            target=_python_main,
            args=(list(argv), env, str(cwd), str(out), str(err), path),
        )
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        return subprocess.CompletedProcess(
            [sys.executable, *argv],
            p.exitcode,
            out.read_text(errors="replace") if out.exists() else "",
            err.read_text(errors="replace") if err.exists() else "",
        )


def forked_subprocess_run(real_run):
    """A stand-in for ``subprocess.run`` that runs ``[sys.executable, ...]`` commands through
    ``run_python`` (capturing text, as the callers here ask) and hands any other to
    ``real_run``."""

    def run(cmd, *args, **kwargs):
        if args or not isinstance(cmd, list) or cmd[0] != sys.executable:
            return real_run(cmd, *args, **kwargs)
        assert kwargs.get("capture_output") and kwargs.get("text"), kwargs
        return run_python(
            [str(a) for a in cmd[1:]],
            env=kwargs.get("env"),
            cwd=kwargs.get("cwd") or os.getcwd(),
            timeout=kwargs.get("timeout") or 300,
        )

    return run
