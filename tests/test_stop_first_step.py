"""A stop during step 1, before any step completed, saves nothing: the state to
keep is the initial one, which a fresh run rebuilds exactly, while a checkpoint
of it would hold the optimizer state DCP makes up for a fresh AdamW (step 1,
zero moments) and resume differently from step 2 on. The run after the stop
(``resume = auto``) starts at step 0 and ends in the state, bit for bit, of a
run that was never stopped."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from checkpoint_state import differing, final_state
from test_stop import torchrun, workers

pytestmark = pytest.mark.e2e

STEPS = 3


@pytest.mark.timeout(300)
def test_a_stop_in_step_1_saves_nothing_and_the_next_run_is_exact(tmp_path):
    whole = torchrun(tmp_path / "whole", tmp_path / "whole" / "ck", f"steps={STEPS}")
    assert whole.returncode == 0, (tmp_path / "whole" / "err").read_text()[-3000:]
    run = tmp_path / "stopped"
    job = torchrun(
        run,
        run / "ck",
        f"steps={STEPS}",
        "fault=slow:step=1:stage=0:task=W1:seconds=60",
        wait=False,
    )
    err = run / "err"
    try:
        t0 = time.monotonic()
        while "injecting fault slow" not in err.read_text():
            assert job.poll() is None and time.monotonic() - t0 < 90, err.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1.0)
        for pid in workers(job.pid):
            os.kill(pid, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = err.read_text()
    lines = re.findall(r"^rrfp: stopped: .*$", text, re.M)
    assert lines and all(
        f"step 1 of {STEPS} abandoned midway, not applied; no checkpoint saved (no step was "
        "completed" in ln
        for ln in lines
    ), text[-3000:]
    assert [p.name for p in (run / "ck").iterdir() if not p.name.startswith(".")] == [], (
        "a checkpoint was saved"
    )
    again = torchrun(
        run / "again", run / "ck", f"steps={STEPS}"
    )  # resume = auto: nothing to resume, step 0
    assert again.returncode == 0, (run / "again" / "err").read_text()[-3000:]
    a, b = final_state(tmp_path / "whole" / "ck", STEPS), final_state(run / "ck", STEPS)
    assert a.keys() == b.keys() and any(".optim.state." in k for k in a)
    differ = differing(a, b)
    assert not differ, (
        f"the run after the stop ends in another state than one never stopped: {differ[:5]}"
    )
