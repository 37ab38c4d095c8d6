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

Both compare with one run never stopped, made once for the file. The stop in step 1 is a torchrun
job, whose agent ends what is left of the job once a rank has exited. The ranks of every other run
are plain processes (tests/harness/train_rows.py) with the same command and config; the mid-step
stop's are signalled as torchrun's agent signals its workers when it is stopped, the job's store
served as that agent serves it, and each rank's exit code and output are read from the rank.
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


def torchrun(tmp: Path, ck: Path, *extra: str):
    """``rrfp train`` on 2 ranks under torchrun, started (the agent from the preloaded forkserver,
    tests/harness/train_rows.py; its ranks forks of the agent, as ``rrfp train --nproc-per-node``
    has them). --monitor-interval 3: once a rank has exited, the agent SIGTERMs the other only
    after 3 s, so each rank's own line is what this test reads."""
    tmp.mkdir(parents=True, exist_ok=True)
    return python_m(
        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--monitor-interval", "3",
        *forked_rrfp("train", *_train_args(tmp, ck, *extra)), out=tmp / "out", err=tmp / "err",
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


def _wait_for_the_slow_task(running, said) -> None:
    """Until the slow task has started, as ``said()`` (what the job printed to stderr) shows, while
    ``running()``."""
    t0 = time.monotonic()
    while "injecting fault slow" not in said():
        assert running() and time.monotonic() - t0 < 90, said()[-3000:]
        time.sleep(0.05)


def _stopped_lines(text: str) -> dict[int, str]:
    return {int(m[1]): m[0] for m in re.finditer(r"^rrfp: stopped: rank (\d+): .*$", text, re.M)}


@pytest.mark.timeout(240)
def test_sigterm_mid_step_saves_within_seconds_and_resumes_bit_exact(tmp_path, whole):
    run = tmp_path / "stopped"
    # stage 0's W1: its first two microbatches' weight gradients are in, the last stage is done and
    # waits in the step's all-reduce: a stop must discard those gradients and meet that rank there
    job = TrainJob(
        run,
        _train_args(
            run, run / "ck", f"fault=slow:step={SLOW_STEP}:stage=0:task=W1:seconds={SLOW_S}"
        ),
        agent_store=True,
    )

    def said() -> str:
        return job.err(0) + job.err(1)

    try:
        _wait_for_the_slow_task(lambda: job.codes() == [None, None], said)
        time.sleep(1.5)  # well inside the 60 s task
        for p in job.procs:  # what torchrun's agent does when it is stopped
            os.kill(p.pid, signal.SIGTERM)
        t_sig = time.monotonic()
        lines: dict[int, str] = {}
        while not lines and time.monotonic() - t_sig < SAVED_WITHIN_S:
            lines = _stopped_lines(said())
            time.sleep(0.02)
        elapsed = time.monotonic() - t_sig
        print(f"the job's 'saved' line {elapsed:.2f} s after SIGTERM, in a {SLOW_S} s task")
        assert lines, (
            f"no 'stopped' line within {SAVED_WITHIN_S} s of SIGTERM in a {SLOW_S} s step\n"
            + said()[-3000:]
        )
        assert job.wait(range(2), time.monotonic() + 30), job.tails()
    finally:
        job.kill()
    text = said()
    assert job.codes() == [143, 143], job.tails()
    lines = _stopped_lines(text)
    assert list(lines) == [0] and lines[0] in job.err(0), f"one line for the job, rank 0's: {lines}"
    ck = run / "ck" / f"step-{SLOW_STEP - 1:08d}"
    for line in lines.values():
        assert (
            f"step {SLOW_STEP} of {STEPS} abandoned midway, not applied; checkpoint {ck} "
            f"(step {SLOW_STEP - 1}) is saved; continue with --resume"
        ) in line, line
    assert f'File "{ROOT / "rrfp"}' not in text, text[-3000:]  # no traceback of rrfp's
    # the same checkpoint directory, no fault
    out = train(run / "resume", run / "ck", "resume=required").out(0)
    assert f"resume: from {ck} (step {SLOW_STEP - 1} of {STEPS})" in out, out
    stopped = losses(job.out(0))
    assert sorted(stopped) == list(range(1, SLOW_STEP)), (
        stopped
    )  # the abandoned step printed nothing
    whole_out, whole_ck = whole
    assert {**stopped, **losses(out)} == losses(whole_out), (
        job.out(0),
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
    # no exit code read: the ranks are forks of the agent, whose summary names the first alone
    job = torchrun(run, run / "ck", "fault=slow:step=1:stage=0:task=W1:seconds=60")
    try:
        _wait_for_the_slow_task(lambda: job.poll() is None, (run / "err").read_text)
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
