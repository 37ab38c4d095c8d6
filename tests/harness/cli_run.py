"""`rrfp ARGS` run in the test process through ``rrfp.app.cli.main.main``: what it prints and its
exit code, as a subprocess would give them, without starting an interpreter and importing torch for
each refusal a test checks. Each command keeps one subprocess smoke test of its own elsewhere,
which covers what only a real process shows (the entry point, the exit status).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from unittest import mock

from harness import ROOT
from harness.launch import DROPPED_PREFIXES, LAUNCHER_VARS, rank_vars
from rrfp.app.config.train_config import ConfigError, TrainConfig


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """os.environ as a child's (launcher and rrfp variables dropped) plus ``env``, until the
    block ends."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k in LAUNCHER_VARS or k.startswith(DROPPED_PREFIXES):
            del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _leave(code: int):
    raise SystemExit(code)


def rrfp_in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``rrfp ARGS`` with ``env`` over a child's environment: its exit code, stdout and stderr."""
    from rrfp.app.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with (
        environment(env or {}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        # a rank leaves through os._exit (rrfp.app.errors.exit_now): here it ends the call
        mock.patch("os._exit", side_effect=_leave),
    ):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's --help, a command that exits
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
    return subprocess.CompletedProcess(
        ["rrfp", *args], code, stdout=out.getvalue(), stderr=err.getvalue()
    )


CONFIG = "configs/gpt-tiny.toml"


def rrfp(*args: str, world: int | None = None, rank: int = 0) -> subprocess.CompletedProcess:
    """`rrfp train ARGS` in this process; with ``world``, under a torchrun-like environment whose
    rendezvous nobody serves: joining a process group would fail or hang, so a pass proves none
    was joined."""
    env = {} if world is None else rank_vars(rank, world, port=9)
    return rrfp_in_process("train", *args, env=env)


def assert_usage_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, stderr exactly one `rrfp: error:` line containing every needle."""
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp: error: "), (
        f"exit {res.returncode}:\n{res.stderr}"
    )
    assert res.returncode == 2, f"exit {res.returncode}: {lines[0]}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    assert res.stdout == "", res.stdout
    return lines[0]


def config_error(sets: list[str], *needles: str, world: int | None = None) -> str:
    """The one-line ConfigError that ``TrainConfig.load`` raises for ``sets``, with every needle."""
    import pytest  # here: a rank that imports this module needs no pytest (about 0.1 CPU-s)

    with pytest.raises(ConfigError) as info:
        TrainConfig.load(ROOT / CONFIG, sets, world_size=world)
    line = str(info.value)
    assert "\n" not in line, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in: {line}"
    return line


def sets_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]
