"""A stop that does not wait for the step: under torchrun, SIGTERM 1.5 s into a step that would
last 60 s more (an injected slow task, ``fault = slow:...``, on stage 0 once some of its gradients
are in, while the last stage already waits in the step's all-reduce) saves the last completed step
within 5 s on every rank, and both ranks exit 143. Resumed, the run's losses and final state
(model, AdamW state, RNG) equal those of a run that was never stopped, bit for bit: the abandoned
step's gradients were not applied or saved, and its RNG state at the start was what the checkpoint
kept (dropout draws from it).

A stop during step 1, before any step completed, saves nothing: the state to keep is the initial
one, which a fresh run rebuilds exactly, while a checkpoint of it would hold the optimizer state
DCP makes up for a fresh AdamW (step 1, zero moments) and resume differently from step 2 on. The
run after the stop (``resume = auto``) starts at step 0 and ends in the state, bit for bit, of a
run that was never stopped.

Both compare with one run never stopped, made once for the file. Only the stopped runs are
torchrun jobs, the signal's path being the point; the run never stopped and the runs after a stop
start their ranks as plain processes (tests/harness/train_rows.py), with the same command and
config.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from harness import ROOT
from harness.checkpoint_state import differing, final_state
from harness.train_rows import TrainJob, forked_rrfp, losses, python_m

sys.path.insert(0, str(ROOT))
from benchmarks.sigterm_stop import workers  # noqa: E402  (the measurement's own, the same job shape)

pytestmark = pytest.mark.e2e

STEPS, SLOW_STEP, SLOW_S, SAVED_WITHIN_S = 3, 2, 60, 5.0
SETS = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.block_size=64",
    "data.min_seq_len=16",
    "data.max_seq_len=64",
    "n_microbatches=4",
    "model.dropout=0.1",
    f"steps={STEPS}",
    "timeout_s=200",
]


def _train_args(tmp: Path, ck: Path, *extra: str) -> list[str]:
    """The arguments after ``rrfp train``: the config, ``SETS`` and ``extra``."""
    sets = [*SETS, f"checkpoint.dir={ck}", f"log_dir={tmp / 'logs'}", *extra]
    return ["--config", "configs/gpt-tiny.toml", *[a for s in sets for a in ("--set", s)]]


def torchrun(tmp: Path, ck: Path, *extra: str, forked: bool = False):
    """``rrfp train`` on 2 ranks under torchrun, started (the agent from the preloaded
    forkserver, tests/harness/train_rows.py; its ranks fresh interpreters, whose every exit code
    torchrun's failure summary lists, or with ``forked`` forks of the agent, as ``rrfp train
    --nproc-per-node`` has them, whose summary names the first alone). --monitor-interval 3:
    once a rank has exited, the agent SIGTERMs the other only after 3 s, so each rank's own line
    is what this test reads."""
    tmp.mkdir(parents=True, exist_ok=True)
    args = _train_args(tmp, ck, *extra)
    ranks = forked_rrfp("train", *args) if forked else ["-m", "rrfp", "train", *args]
    return python_m(
        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--monitor-interval", "3",
        *ranks, out=tmp / "out", err=tmp / "err",
    )  # fmt: skip


def train(tmp: Path, ck: Path, *extra: str) -> TrainJob:
    """``rrfp train`` on 2 ranks, each a plain process, run to its end: both exit 0."""
    job = TrainJob(tmp, _train_args(tmp, ck, *extra)).finish(150)
    assert job.codes() == [0, 0], job.tails()
    return job


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[str, Path]:
    """The run never stopped, that each stopped run must end equal to: rank 0's output and the
    checkpoint directory."""
    tmp = tmp_path_factory.mktemp("whole")
    return train(tmp, tmp / "ck").out(0), tmp / "ck"


def _wait_for_the_slow_task(job, err: Path) -> None:
    t0 = time.monotonic()
    while "injecting fault slow" not in err.read_text():
        assert job.poll() is None and time.monotonic() - t0 < 90, err.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_sigterm_mid_step_saves_within_seconds_and_resumes_bit_exact(tmp_path, whole):
    run = tmp_path / "stopped"
    # stage 0's W1: its first two microbatches' weight gradients are in, the last stage is done and
    # waits in the step's all-reduce: a stop must discard those gradients and meet that rank there
    job = torchrun(run, run / "ck", f"fault=slow:step={SLOW_STEP}:stage=0:task=W1:seconds={SLOW_S}")
    err = run / "err"
    try:
        _wait_for_the_slow_task(job, err)
        time.sleep(1.5)  # well inside the 60 s task
        ranks = workers(job.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:  # what torchrun's agent does when it is stopped
            os.kill(pid, signal.SIGTERM)
        t_sig = time.monotonic()
        lines: dict[int, str] = {}
        while not lines and time.monotonic() - t_sig < SAVED_WITHIN_S:
            lines = {
                int(m[1]): m[0]
                for m in re.finditer(r"^rrfp: stopped: rank (\d+): .*$", err.read_text(), re.M)
            }
            time.sleep(0.02)
        elapsed = time.monotonic() - t_sig
        print(f"the job's 'saved' line {elapsed:.2f} s after SIGTERM, in a {SLOW_S} s task")
        assert lines, (
            f"no 'stopped' line within {SAVED_WITHIN_S} s of SIGTERM in a {SLOW_S} s step\n"
            + err.read_text()[-3000:]
        )
        job.wait(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = err.read_text()
    assert [int(c) for c in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", text, re.M)] == [143, 143], (
        text[-3000:]
    )
    lines = {int(m[1]): m[0] for m in re.finditer(r"^rrfp: stopped: rank (\d+): .*$", text, re.M)}
    assert list(lines) == [0], f"one line for the job, rank 0's: {lines}"
    ck = run / "ck" / f"step-{SLOW_STEP - 1:08d}"
    for line in lines.values():
        assert (
            f"step {SLOW_STEP} of {STEPS} abandoned midway, not applied; checkpoint {ck} "
            f"(step {SLOW_STEP - 1}) is saved; continue with --resume"
        ) in line, line
    assert f'File "{ROOT / "rrfp"}' not in text, text[
        -3000:
    ]  # torchrun's traceback is its own, none of rrfp's
    # the same checkpoint directory, no fault
    out = train(run / "resume", run / "ck", "resume=required").out(0)
    assert f"resume: from {ck} (step {SLOW_STEP - 1} of {STEPS})" in out, out
    stopped = losses((run / "out").read_text())
    assert sorted(stopped) == list(range(1, SLOW_STEP)), (
        stopped
    )  # the abandoned step printed nothing
    whole_out, whole_ck = whole
    assert {**stopped, **losses(out)} == losses(whole_out), (
        (run / "out").read_text(),
        out,
        whole_out,
    )
    a, b = final_state(whole_ck, STEPS), final_state(run / "ck", STEPS)
    assert (
        a.keys() == b.keys()
        and any(".optim.state." in k for k in a)
        and any(".rng" in k for k in a)
    )
    differ = differing(a, b)
    assert not differ, f"the stopped and resumed run's final state differs in {differ[:5]}"


@pytest.mark.timeout(300)
def test_a_stop_in_step_1_saves_nothing_and_the_next_run_is_exact(tmp_path, whole):
    run = tmp_path / "stopped"
    # no exit code read: the ranks may be forks of the agent
    job = torchrun(run, run / "ck", "fault=slow:step=1:stage=0:task=W1:seconds=60", forked=True)
    try:
        _wait_for_the_slow_task(job, run / "err")
        time.sleep(1.0)
        for pid in workers(job.pid):
            os.kill(pid, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = (run / "err").read_text()
    lines = re.findall(r"^rrfp: stopped: .*$", text, re.M)
    assert lines and all(
        f"step 1 of {STEPS} abandoned midway, not applied; no checkpoint saved (no step was "
        "completed" in ln
        for ln in lines
    ), text[-3000:]
    assert [p.name for p in (run / "ck").iterdir() if not p.name.startswith(".")] == [], (
        "a checkpoint was saved"
    )
    train(run / "again", run / "ck")  # resume = auto: nothing to resume, step 0
    a, b = final_state(whole[1], STEPS), final_state(run / "ck", STEPS)
    assert a.keys() == b.keys() and any(".optim.state." in k for k in a)
    differ = differing(a, b)
    assert not differ, (
        f"the run after the stop ends in another state than one never stopped: {differ[:5]}"
    )
