"""Ctrl-C under torchrun stops a run as SIGTERM does: torchrun's agent forwards the SIGINT to
every rank (each in a session of its own, so the terminal's reaches the agent alone); each
rank stops at a step boundary, saves, writes the trace and says what is saved, without
"interrupted" or C++ teardown noise. Twice at once (a wrapper such as ``timeout`` forwards the
terminal's Ctrl-C too): the agent then sends SIGINT and, from its ``finally``, SIGTERM; that is
still one request. The agent starts from the preloaded forkserver and its ranks are forks of it,
as ``rrfp train --nproc-per-node`` has them (tests/harness/train_rows.py's ``forked_rrfp``): the
agent's forwarding is the point, not an interpreter's start."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from harness import ROOT
from harness.checkpoint_run import SMALL
from harness.forked_python import run_python
from harness.launch import child_env
from harness.train_rows import forked_rrfp, python_m

from rrfp.app.train.checkpoint_dir import CheckpointDir

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(120)
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_to_torchrun_saves_the_last_step_and_writes_the_trace(tmp_path, presses):
    ckdir, trace = tmp_path / "ck", tmp_path / "t.json"
    proc = python_m(
        "torch.distributed.run",
        *[
            "--standalone",
            "--nproc-per-node=2",
            *forked_rrfp(
                "train",
                *SMALL,
                "--set",
                "steps=100000",
                "--set",
                "unit_ms=20",
                "--set",
                f"checkpoint.dir={ckdir}",
                "--set",
                "checkpoint.every=3",
                "--set",
                f"trace={trace}",
                "--set",
                f"log_dir={tmp_path / 'logs'}",
            ),
        ],
        out=tmp_path / "out",
        err=tmp_path / "err",
    )
    try:
        t0 = time.monotonic()
        while sum(ln.startswith("step") for ln in (tmp_path / "out").read_text().splitlines()) < 4:
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() - t0 < 60, (
                "no steps within 60 s\n" + (tmp_path / "err").read_text()[-3000:]
            )
            time.sleep(0.05)
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.02)
        t_sig = time.monotonic()
        proc.wait(30)
        elapsed = time.monotonic() - t_sig
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "err").read_text()
    print(f"torchrun ended {elapsed:.2f} s after {presses} SIGINT(s)")
    assert "terminate called" not in text and "rrfp: interrupted" not in text, text[-3000:]
    lines = sorted(ln for ln in text.splitlines() if ln.startswith("rrfp: "))
    assert len(lines) == 1, text[-3000:]  # one line for the job, rank 0's
    (line,) = lines
    assert line.startswith("rrfp: stopped: rank 0: SIGINT on this rank; "), line
    assert "is saved; continue with --resume" in line, line
    step = int(line.split(" is saved;")[0].rsplit("(step ", 1)[1].rstrip(")"))
    assert CheckpointDir(ckdir).latest().step == step
    assert json.loads(trace.read_text())["traceEvents"], "the trace has no events"


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_before_the_run_handles_it_is_one_line_per_job_and_exit_130(rank, tmp_path):
    """A SIGINT before `rrfp train` installs its handler (while it loads the config) is Python's
    KeyboardInterrupt: rank 0 alone says so (the agent sent it to every rank), and the rank leaves
    through exit_now, not the interpreter's teardown."""
    code = (
        "import rrfp.app.cli.train_command as t, rrfp.app.cli.main as cli, sys\n"
        "def interrupted(args): raise KeyboardInterrupt\n"
        "t.train_command = interrupted\n"
        "import atexit; atexit.register(lambda: print('teardown ran', flush=True))\n"
        "sys.exit(cli.main(['train', '--config', 'configs/gpt-tiny.toml']))\n"
    )
    # from the preloaded forkserver, which leaves through the code's exit handlers as an
    # interpreter's teardown does (tests/harness/forked_python.py)
    env = child_env(RANK=str(rank), WORLD_SIZE="2")
    res = run_python(["-c", code], env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 130, (res.returncode, res.stderr)
    assert res.stderr.splitlines() == (["rrfp: interrupted"] if rank == 0 else []), res.stderr
    assert "teardown ran" not in res.stdout, "left through the interpreter's teardown"
