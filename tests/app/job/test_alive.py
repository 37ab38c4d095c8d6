"""Alive but slow is not dead (issue 17, point 5), with real gloo ranks (rank_procs.py).

A rank busy in one task for 3x run.timeout_s, or stopped (SIGSTOP) and continued
within timeout_s, is not reported failed: the run ends with exit 0 and the
single-process reference's losses. A rank stopped for good is named as silent
within timeout_s. A peer lost during a checkpoint write gives one line that
names it and says which checkpoint stays. Rank 1 is always the victim: rank 0
holds the store (plain processes, no torchrun agent), which carries the heartbeat.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from harness.rank_procs import RankProcs

STARTUP_S = 90  # imports and rendezvous of every rank on a loaded 2-core machine
SLACK_S = 10
SETS = (
    "n_microbatches=4",
    "model.n_embd=32",
    "model.block_size=64",
    "model.n_layer=2",
    "data.min_seq_len=16",
    "data.max_seq_len=64",
)


def _args(tmp: Path, *sets: str) -> list[str]:
    return [
        "--config",
        "configs/gpt-tiny.toml",
        *(a for s in (*SETS, f"log_dir={tmp / 'logs'}", *sets) for a in ("--set", s)),
    ]


def reference_losses(steps: int) -> list[float]:
    """The same model, data and optimizer in this one process (pp = 1)."""
    from rrfp.app.config.train_config import TrainConfig

    cfg = TrainConfig.load("configs/gpt-tiny.toml", [*SETS, f"steps={steps}"], world_size=1)
    wl = cfg.workload
    torch.manual_seed(cfg.run.seed)
    model = wl.build_stage(cfg.model, 0, 1, None)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
    )
    losses = []
    for step in range(steps):
        batch = wl.batches(cfg.data, step, cfg.schedule.n_microbatches)
        loss = sum(wl.loss_fn(model(x), y) for x, y in batch) / len(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def printed_losses(out: str) -> dict[int, float]:
    """Step number -> loss, as rank 0 printed them (4 decimals)."""
    return {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"^step\s+(\d+)/\d+\s+loss (\S+)", out, re.M)
    }


def _assert_reference(out: str, steps: int, first: int = 1) -> None:
    got, want = printed_losses(out), reference_losses(steps)
    assert sorted(got) == list(range(first, steps + 1)), out
    worst = max(abs(got[s] - want[s - 1]) for s in got)
    assert worst < 2e-4, (
        f"losses differ from the single-process reference by {worst:.2e}: {got} vs {want}"
    )


def _wait_for(ranks: RankProcs, rank: int, text: str, what: str) -> None:
    t0 = time.monotonic()
    while text not in ranks.err(rank) + ranks.out(rank):
        exited = {r: p.returncode for r, p in enumerate(ranks.procs) if p.poll() is not None}
        assert not exited, f"rank(s) ended before {what}: {exited}\n{ranks.tails()}"
        assert time.monotonic() - t0 < STARTUP_S, f"no {what} within {STARTUP_S} s\n{ranks.tails()}"
        time.sleep(0.02)


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", [":task=F1", ""], ids=["in-a-task", "before-the-step-all-reduce"])
def test_a_rank_busy_for_three_timeouts_is_not_reported_failed(tmp_path, where):
    """Rank 1 computes for 6 s (pure Python: the heartbeat thread gets the GIL only in turns) with
    timeout_s = 2, in one task (rank 0 waits on a channel) or after its iteration (rank 0 waits in
    the step's world all-reduce); before the heartbeat, rank 0 gave up after 2 s and each rank
    blamed the other. Rank 0 says, while it waits for a task, that rank 1 is alive and in it."""
    busy = f"busy:step=2:rank=1{where}:seconds=6"
    ranks = RankProcs(tmp_path, 2, _args(tmp_path, "steps=3", "timeout_s=2", f"fault={busy}"))
    try:
        ended = ranks.wait([0, 1], STARTUP_S + 6 + SLACK_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [0, 0], ranks.tails()
        assert "busy for 6 s, done" in ranks.err(1), ranks.err(1)
        for r in range(2):
            assert ranks.error_lines(r) == [] and "Traceback" not in ranks.err(r), ranks.tails()
        if where:
            assert re.search(
                r"rank 0 stage 0: iteration 1: waiting for \d+ s \(rank 1: alive, in task F1 for "
                r"\d+ s\)",
                ranks.err(0),
            ), ranks.err(0)
        _assert_reference(ranks.out(0), 3)
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(180)
def test_a_rank_stopped_and_continued_within_timeout_s_is_not_reported_failed(tmp_path):
    """SIGSTOP rank 1 for 3.5 s (more than half of timeout_s = 6: rank 1 itself, continued, sees an
    old beat of rank 0 and must not blame it), then SIGCONT: the run finishes."""
    steps, timeout_s, stopped_s = 12, 6, 3.5
    ranks = RankProcs(
        tmp_path, 2, _args(tmp_path, f"steps={steps}", f"timeout_s={timeout_s}", "unit_ms=2")
    )
    try:
        _wait_for(ranks, 0, "step    3/", "third step")
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)
        at = len(printed_losses(ranks.out(0)))
        time.sleep(stopped_s)
        assert ranks.procs[0].poll() is None, (
            f"rank 0 ended while rank 1 was stopped\n{ranks.tails()}"
        )
        os.kill(ranks.procs[1].pid, signal.SIGCONT)
        assert at < steps, "the run finished before the stop: nothing was tested"
        ended = ranks.wait([0, 1], STARTUP_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [0, 0], ranks.tails()
        for r in range(2):
            assert ranks.error_lines(r) == [] and "Traceback" not in ranks.err(r), ranks.tails()
        _assert_reference(ranks.out(0), steps)
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(180)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-the-store-host"])
def test_a_rank_stopped_for_good_is_named_as_silent_within_timeout_s(tmp_path, victim):
    """Rank 0's process holds the store here: stopped, it takes the heartbeats with it, and the
    other rank names the store and rank 0 (its failure board then gives up within 2 s)."""
    timeout_s, other = 3, 1 - victim
    ranks = RankProcs(
        tmp_path, 2, _args(tmp_path, "steps=100000", f"timeout_s={timeout_s}", "unit_ms=2")
    )
    try:
        _wait_for(ranks, 0, "step    3/", "third step")
        os.kill(ranks.procs[victim].pid, signal.SIGSTOP)
        ended = ranks.wait([other], timeout_s + SLACK_S)
        assert other in ended, (
            f"rank {other} still runs {timeout_s + SLACK_S} s after the stop\n{ranks.tails()}"
        )
        assert ended[other] >= timeout_s - 1, (
            f"rank {other} ended {ended[other]:.1f} s after the stop: too early"
        )
        assert ranks.procs[other].returncode == 1, ranks.tails()
        assert "Traceback" not in ranks.err(other), ranks.err(other)
        (line,) = ranks.error_lines(other)
        silent = (
            rf"rank 1 went silent: no heartbeat for [\d.]+ s \(run.timeout_s = {timeout_s}\): it "
            r"is stopped, hung or cut off"
            if victim == 1
            else r"the rendezvous store at 127.0.0.1:\d+ \(in rank 0's process\) stopped "
            r"answering: no heartbeat "
            rf"read for [\d.]+ s \(run.timeout_s = {timeout_s}\): rank 0 is stopped, hung or gone"
        )
        log = re.escape(str(tmp_path / "logs" / f"rank-{other}.log"))
        assert re.fullmatch(
            rf"rrfp: error: rank {other}: stopped: {silent} \(traceback in {log}\)", line
        ), line
        assert ranks.procs[victim].poll() is None, "the stopped rank is still there, stopped"
        print(
            f"SIGSTOP rank {victim}: rank {other} named it {ended[other]:.1f} s later (timeout_s = "
            f"{timeout_s})"
        )
    finally:
        ranks.kill_all()
    assert ranks.alive() == []


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("step", [1, 2], ids=["no-checkpoint-yet", "previous-one-kept"])
def test_a_peer_killed_during_a_checkpoint_write_is_one_line_that_says_what_stays(tmp_path, step):
    ck = tmp_path / "ck"
    sets = (f"checkpoint.dir={ck}", "checkpoint.every=1", "timeout_s=5")
    ranks = RankProcs(
        tmp_path, 2, _args(tmp_path, "steps=3", *sets, f"fault=kill:step={step}:rank=1:during=save")
    )
    try:
        ended = ranks.wait([0, 1], STARTUP_S + SLACK_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [1, -9], ranks.tails()
        assert "Traceback" not in ranks.err(0), ranks.err(0)
        (line,) = ranks.error_lines(0)
        assert "internal error" not in line, line
        kept = (
            f"the newest committed checkpoint stays ({ck / 'step-00000001'})"
            if step == 2
            else "and no checkpoint was committed before it (a resume starts at step 0)"
        )
        assert line.startswith(
            f"rrfp: error: rank 0: stopped: rank 1 left first without a word (killed, or hung): "
            f"step {step}: checkpoint step-{step:08d} was not saved, {kept}: "
        ), line
        assert "the peer process probably died" in line, line
    finally:
        ranks.kill_all()
    assert ranks.alive() == []
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == [
        f"step-{s:08d}" for s in range(1, step)
    ], "only what was committed before the loss is a checkpoint"
    if step == 1:
        return
    # the kept one resumes, the half-written one does not get in the way, and the losses are the
    # reference's
    again = tmp_path / "resume"
    again.mkdir()
    resumed = RankProcs(again, 2, _args(again, "steps=3", *sets, "resume=required"))
    try:
        assert sorted(resumed.wait([0, 1], STARTUP_S)) == [0, 1], resumed.tails()
        assert [p.returncode for p in resumed.procs] == [0, 0], resumed.tails()
        assert f"resume: from {ck / 'step-00000001'}" in resumed.out(0), resumed.out(0)
        _assert_reference(resumed.out(0), 3, first=2)
    finally:
        resumed.kill_all()


@pytest.mark.parametrize(
    "text,lost",
    [
        ("rank 1: RuntimeError: [pair.cc:553] Connection closed by peer", True),
        ("rank 0: OSError: [Errno 28] No space left on device", False),
    ],
    ids=["transport-error", "full-disk"],
)
def test_a_dcp_failure_is_a_lost_peer_only_when_its_causes_are_transport_errors(
    tmp_path, monkeypatch, text, lost
):
    """DCP gathers every rank's exception into one CheckpointException: a peer's transport error in
    it is the same lost peer as a failed collective (secondary, names what stays); a full disk stays
    this run's own CheckpointError (primary)."""
    import asyncio
    from types import SimpleNamespace

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train import checkpoints
    from rrfp.app.train.checkpoint_state import CheckpointError
    from rrfp.core.errors import PeerFailure

    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml", [*SETS, f"checkpoint.dir={tmp_path}"], world_size=2
    )
    rt = SimpleNamespace(
        rank=0, stage=0, tp_rank=0, ep_rank=None, device=torch.device("cpu"), cpu_group=None
    )

    def fail(path, *args, **kw):
        raise CheckpointError(f"cannot write checkpoint {path}: {text}")

    monkeypatch.setattr(checkpoints, "save_stage", fail)
    ckpts = checkpoints.RunCheckpoints(cfg, rt, [torch.nn.Linear(1, 1)], [None])
    with pytest.raises(PeerFailure if lost else CheckpointError) as caught:
        asyncio.run(ckpts.save(2))
    line = str(caught.value)
    if lost:
        assert line.startswith(
            "rank 0: step 2: checkpoint step-00000002 was not saved, and no checkpoint was "
            "committed before it (a resume starts at step 0): a peer was lost while writing it "
            "(the peer process probably died): "
        ), line
    else:
        assert not isinstance(caught.value, PeerFailure) and "No space left on device" in line, line
