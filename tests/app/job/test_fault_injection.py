"""Fault injection (debug.fault) end to end: one rank fails at a chosen (step,
stage, task), or its model raises, and the run ends with one line per failure.

The failing rank's line names the cause (or there is none: SIGKILL leaves no
time to write one); every other rank stops with a short line that points at
the rank that failed first (rrfp/app/job/failure_board.py), within run.timeout_s
+ 10 s, with a non-zero exit code; nothing of the run is left alive. The ranks
are plain processes (rank_procs.py), or torchrun's forks of its agent.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from harness.fault_run import STARTUP_S, TIMEOUT_S, _args, _wait_for_fault
from harness.rank_procs import RankProcs
from harness.train_rows import forked_rrfp, python_m

pytestmark = pytest.mark.e2e

SLACK_S = 10


def _survivor_line(ranks: RankProcs, rank: int, peer: int) -> str:
    err = ranks.err(rank)
    assert "Traceback" not in err, f"rank {rank} printed a traceback:\n{err}"
    lines = ranks.error_lines(rank)
    assert len(lines) == 1, f"rank {rank}: expected one error line, got:\n{err}"
    line = lines[0]
    # the failure board names the rank that left; without it (its store was in a rank that is gone)
    # a channel names its peer, and a world collective (the step's all-reduce) cannot say which rank
    # left
    assert re.match(
        rf"rrfp: error: rank {rank}: stopped: (rank {peer} left first without a word \(killed, or "
        rf"hung\)|peer rank {peer} failed or left first|another rank failed or left first|"
        rf"rank {peer} went silent: no heartbeat for )",
        line,
    ), line
    log = re.search(r"traceback in (\S+)\)$", line)
    assert log and "Traceback" in Path(log.group(1)).read_text(), line
    return line


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["kill", "stop"])
def test_a_killed_or_stopped_rank_ends_the_others(tmp_path, kind):
    world, victim = 3, 1  # the middle stage: both neighbours lose it
    fault = f"{kind}:step=3:stage=1:task=B2"
    ckpt = (
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.every=1",
    )  # steps 1 and 2 commit before the fault
    ranks = RankProcs(tmp_path, world, _args(tmp_path, world, f"fault={fault}", *ckpt))
    survivors = [0, 2]
    try:
        _wait_for_fault(ranks, victim, f"rank 1 stage 1: step 3 task B2: injecting fault {fault}")
        limit = TIMEOUT_S + SLACK_S
        ended = ranks.wait(survivors, limit)
        assert sorted(ended) == survivors, (
            f"still running {limit} s after the {kind}: "
            f"{set(survivors) - set(ended)}\n{ranks.tails()}"
        )
        lines = [_survivor_line(ranks, r, victim) for r in survivors]
        named = "went silent: no heartbeat for" if kind == "stop" else "left first without a word"
        assert any(f"stopped: rank {victim} {named}" in ln for ln in lines), lines
        assert all(ranks.procs[r].returncode == 1 for r in survivors), ranks.tails()
        assert ranks.error_lines(victim) == [], "the victim had no time to write a line"
        if kind == "kill":
            assert ranks.procs[victim].wait(5) == -9
            assert any("the peer process probably died" in ln for ln in lines), lines
        else:
            assert ranks.procs[victim].poll() is None, "the stopped rank is still there, stopped"
            assert min(ended.values()) > TIMEOUT_S / 2, (
                f"ended before the deadline could pass: {ended}"
            )
            assert any(
                f"(run.timeout_s = {TIMEOUT_S}): it is stopped, hung or cut off" in ln
                for ln in lines
            ), lines
        print(
            f"{kind}: survivors ended after "
            + ", ".join(f"rank {r}: {t:.1f} s" for r, t in ended.items())
        )
        assert ranks.alive() == ([victim] if kind == "stop" else []), "an orphan is left"
    finally:
        ranks.kill_all()
    assert ranks.alive() == [], "processes of the run are left after the cleanup"
    # the last committed checkpoint survived the failure: a resumed run loads it and finishes step 3
    assert sorted(d.name for d in (tmp_path / "ck").iterdir() if not d.name.startswith(".")) == [
        "step-00000001",
        "step-00000002",
    ]
    again = tmp_path / "resume"
    again.mkdir()
    resumed = RankProcs(again, world, _args(tmp_path, world, *ckpt, "resume=required", "steps=3"))
    try:
        assert sorted(resumed.wait(range(world), STARTUP_S)) == list(range(world)), resumed.tails()
        assert [p.returncode for p in resumed.procs] == [0] * world, resumed.tails()
        assert "resume: from" in resumed.out(0) and "step 2 of 3" in resumed.out(0), resumed.out(0)
        assert re.search(r"done: 1 steps after step 2", resumed.out(0)), resumed.out(0)
    finally:
        resumed.kill_all()


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_kill_during_a_save_is_named_by_every_survivor(tmp_path):
    """Every survivor fails in DCP's world collective, which names no peer, and gloo fails it at
    once only on the killed rank's ring neighbours (1 and 3): rank 0 stays blocked in it, posting
    nothing, until one of them exits. The neighbours still name rank 2, whose alive counter stood
    still."""
    world, victim = 4, 2
    fault = "kill:step=3:stage=2:during=save"
    ranks = RankProcs(
        tmp_path,
        world,
        _args(
            tmp_path,
            world,
            f"fault={fault}",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every=1",
        ),
    )
    survivors = [0, 1, 3]
    try:
        _wait_for_fault(ranks, victim, "injecting fault")
        ended = ranks.wait(survivors, TIMEOUT_S + SLACK_S)
        assert sorted(ended) == survivors, ranks.tails()
        for r in survivors:
            line = _survivor_line(ranks, r, victim)
            assert f"stopped: rank {victim} left first without a word" in line, line
            assert "checkpoint step-00000003 was not saved" in line, line
        print(
            "survivors ended after " + ", ".join(f"rank {r}: {t:.1f} s" for r, t in ended.items())
        )
    finally:
        ranks.kill_all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fault,debug",
    [("bug:step=2:stage=1:task=F0", True), ("raise:step=2:stage=1:task=B3", False)],
    ids=["internal-error-debug", "run-failure"],
)
def test_one_primary_line_and_a_pointer_from_the_other_rank(tmp_path, fault, debug):
    """The victim is rank 1: rank 0 holds the store (plain processes, no torchrun agent), and the
    failure board needs it alive to tell rank 0 who failed first."""
    world = 2
    victim = int(fault.split("stage=")[1][0])
    other = 1 - victim
    ranks = RankProcs(
        tmp_path, world, _args(tmp_path, world, f"fault={fault}") + (["--debug"] if debug else [])
    )
    try:
        ended = ranks.wait([0, 1], STARTUP_S + TIMEOUT_S + SLACK_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [1, 1], ranks.tails()
        (line,) = ranks.error_lines(victim)
        where = (
            "traceback above" if debug else f"traceback in {tmp_path / 'logs'}/rank-{victim}.log"
        )
        if fault.startswith("bug"):
            assert line.startswith(
                f"rrfp: error: rank {victim} (stage {victim}): internal error, please report "
                f"it ({where}): RuntimeError: "
            ), line
        else:
            assert line.startswith(
                f"rrfp: error: rank {victim} (stage {victim}): step 2 task B3: injected fault"
            )
            assert line.endswith(f"({where})"), line
        assert ("Traceback" in ranks.err(victim)) == debug, ranks.err(victim)
        assert "Traceback" in (tmp_path / "logs" / f"rank-{victim}.log").read_text()
        (pointer,) = ranks.error_lines(other)
        # the failure board names the rank whose line has the cause
        assert pointer.startswith(
            f"rrfp: error: rank {other}: stopped: rank {victim} failed first (see its line): "
        ), pointer
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.timeout(120)
def test_an_error_of_the_models_own_is_one_line_and_its_task_is_in_the_log(tmp_path):
    """The model itself raises (tests/fixtures/failing_stage.py: stage 1's third forward, F0 of step
    2). The iteration raises that error, not an ExceptionGroup, so `rrfp train` still ranks it and
    prints one line, which calls it the user's; rrfp's note on it (which task, microbatch,
    iteration) is in the traceback's log."""
    sets = (
        "pp=2",
        "steps=5",
        "n_microbatches=2",
        f"timeout_s={TIMEOUT_S}",
        f"log_dir={tmp_path / 'logs'}",
        "unit_ms=1",
    )
    ranks = RankProcs(
        tmp_path,
        2,
        ["--config", "tests/fixtures/failing_stage.toml", *(a for s in sets for a in ("--set", s))],
    )
    try:
        ended = ranks.wait([0, 1], STARTUP_S + TIMEOUT_S + SLACK_S)
        assert sorted(ended) == [0, 1] and [p.returncode for p in ranks.procs] == [1, 1], (
            ranks.tails()
        )
        assert "Traceback" not in ranks.err(1), ranks.err(1)
        log = tmp_path / "logs" / "rank-1.log"
        (line,) = ranks.error_lines(1)
        # the model's error is the user's, not an internal one: its task, function and input shape
        assert re.fullmatch(
            r"rrfp: error: rank 1 \(stage 1\): step 2, task F0 \(microbatch 0\): your code "
            r"\(tests\.fixtures\.failing_stage\) raised RuntimeError in the forward of stage 1 "
            r"\(tests\.fixtures\.failing_stage\.FailingStage\): injected failure in stage 1's "
            rf"forward; stage 0 sent \[2, \d+, 16\] \(traceback in {re.escape(str(log))}\)",
            line,
        ), line
        text = log.read_text()
        assert (
            "rrfp: raised in task F0 (microbatch 0) of iteration 1, on stage 1 of 2 (rank 1)"
            in text
        ), text
        assert "ExceptionGroup" not in text, text
        (pointer,) = ranks.error_lines(0)
        assert pointer.startswith(
            "rrfp: error: rank 0: stopped: rank 1 failed first (see its line): "
        ), pointer
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.timeout(120)
def test_nan_with_on_nonfinite_stop_ends_every_rank_with_one_line(tmp_path):
    world = 2
    ranks = RankProcs(
        tmp_path, world, _args(tmp_path, world, "fault=nan:step=2:stage=0", "on_nonfinite=stop")
    )
    try:
        ended = ranks.wait([0, 1], STARTUP_S + TIMEOUT_S + SLACK_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [1, 1], ranks.tails()
        for r in range(world):
            assert "Traceback" not in ranks.err(r)
            (line,) = ranks.error_lines(r)
            assert line.startswith(
                f"rrfp: error: rank {r} (stage {r}): step 2: NaN or Inf in the loss or the "
                f"gradients (first on rank 0, stage 0); every rank ends here, no update was "
                f"made"
            ), line
        steps = [ln for ln in ranks.out(0).splitlines() if ln.startswith("step")]
        assert len(steps) == 1, "step 1 ran, step 2 stopped"
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.timeout(120)
def test_under_torchrun_the_pointer_names_the_first_failure_and_nothing_is_left(tmp_path):
    """The user's path: torchrun's agent holds the store, so the failure board works even after
    rank 0 is gone; rank 0 lost rank 1, yet names rank 2, whose line has the cause. The agent
    SIGTERMs the other ranks as soon as it sees one exit: --monitor-interval 3 lets them finish
    their lines first (with the default 0.1 s, rank 0, still waiting, would end silently). The
    agent starts from the preloaded forkserver and its ranks are forks of it, as ``rrfp train
    --nproc-per-node`` has them (tests/harness/train_rows.py's ``forked_rrfp``): the agent's store
    and its ending of the ranks are the point, not an interpreter's start. The agent leads a
    session of its own, which its ranks and anything they start stay in: what is left of the run
    after the agent ends is what is left in that session."""
    world = 3
    agent = python_m(
        "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        "--monitor-interval=3",
        *forked_rrfp("train", *_args(tmp_path, world, "fault=bug:step=3:stage=2:task=B1")),
        out=tmp_path / "out", err=tmp_path / "err",
    )  # fmt: skip
    try:
        code = agent.wait(STARTUP_S)
        assert _in_session(agent.pid) == [], "a process of the run outlived torchrun"
    finally:
        for pid in _in_session(agent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
    err = (tmp_path / "err").read_text()
    assert code != 0
    lines = sorted(ln for ln in err.splitlines() if ln.startswith("rrfp: error:"))
    assert len(lines) == world, err[-3000:]
    assert lines[2].startswith("rrfp: error: rank 2 (stage 2): internal error, please report it"), (
        lines[2]
    )
    for r in (0, 1):
        assert lines[r].startswith(
            f"rrfp: error: rank {r}: stopped: rank 2 failed first (see its line): "
        ), lines[r]


def _in_session(sid: int) -> list[int]:
    """Live processes of the session ``sid`` (a zombie has ended: it is not counted)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(pid))
    return found
