"""SIGHUP (a closed terminal or SSH session) and SIGQUIT stop a run as SIGTERM does: the step in
progress abandoned, the last completed one saved, one "stopped" line for the job, every rank
exiting 128 + the signal. Two SIGTERMs 0.1 s apart are one request: the first one's line and
saved step, no "during start-up" line and no "second SIGTERM" line on any rank, also when the
second comes once the run has taken its process group down."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness.train_rows import TrainJob

from rrfp.app.cli import train_command
from rrfp.app.cli.train_command import StopOnSignal

SETS = [
    "steps=3",
    "timeout_s=30",
    "n_microbatches=4",
    "model.n_layer=2",
    "model.n_embd=16",
    "model.block_size=32",
    "data.min_seq_len=8",
    "data.max_seq_len=32",
    "checkpoint.every=1",
    # step 2 holds stage 0's W1 for 60 s: the signal comes inside it, after step 1 was saved
    "fault=slow:step=2:stage=0:task=W1:seconds=60",
]


def _job(tmp: Path) -> TrainJob:
    sets = [*SETS, f"checkpoint.dir={tmp / 'ck'}", f"log_dir={tmp / 'logs'}"]
    return TrainJob(
        tmp, ["--config", "configs/gpt-tiny.toml", *(a for s in sets for a in ("--set", s))]
    )


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("sig", "times"),
    [(signal.SIGHUP, 1), (signal.SIGQUIT, 1), (signal.SIGTERM, 2)],
    ids=["SIGHUP", "SIGQUIT", "SIGTERM-twice"],
)
def test_a_stop_signal_saves_the_last_step_with_one_line(tmp_path, sig, times):
    job = _job(tmp_path)
    try:
        t0 = time.monotonic()
        while "injecting fault slow" not in job.err(0):
            job.poll()
            assert not job.ended and time.monotonic() - t0 < 90, job.tails()
            time.sleep(0.05)
        time.sleep(1.0)  # inside the 60 s task
        for n in range(times):
            for p in job.procs:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:  # the second: this rank saved and left already
                    assert n > 0, job.tails()
            if n + 1 < times:
                time.sleep(0.1)
        assert job.wait(range(2), time.monotonic() + 30), job.tails()
    finally:
        job.kill()
    name = signal.Signals(sig).name
    assert job.codes() == [128 + sig] * 2, job.tails()
    ck = tmp_path / "ck" / "step-00000001"
    assert job.lines(0) == [
        f"rrfp: stopped: rank 0: {name} on this rank; step 2 of 3 abandoned midway, not applied; "
        f"checkpoint {ck} (step 1) is saved; continue with --resume"
    ], job.tails()
    assert job.lines(1) == [], job.tails()
    assert (ck / "COMMITTED").exists(), sorted(p.name for p in (tmp_path / "ck").iterdir())


@pytest.mark.unit
def test_a_signal_once_the_run_has_stepped_is_never_one_of_start_up(monkeypatch):
    """The run polled ``asked`` and has taken its process group down again (the end of a stopped
    run): a first signal then asks for a stop, and a second within the same-request window is
    the same request; neither leaves as a start-up signal would."""
    left: list[int] = []
    monkeypatch.setattr(train_command.os, "_exit", left.append)
    monkeypatch.setattr(train_command.dist, "is_initialized", lambda: False)
    stop = StopOnSignal(lambda: "kept", leave_in_startup=True)
    stop.asked()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)
    assert left == [] and stop.requested and stop.name == "SIGTERM"
    fresh = StopOnSignal(lambda: "kept", leave_in_startup=True)  # never stepped: start-up
    fresh._handle(signal.SIGHUP, None)
    assert left == [128 + signal.SIGHUP]
