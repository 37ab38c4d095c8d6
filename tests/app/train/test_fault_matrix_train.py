"""The fault matrix of `rrfp train`: a fault kind injected on rank 1 of two in one phase of the
run (debug.fault, rrfp/app/faults.py), and how the job ends. Each row asserts its outcome:

- "rank 1 named": rank 0 exits 1 with one line, and the line names rank 1, within the phase's bound
  (``timeout_s``; for a hang, ``timeouts.progress_s``) plus slack of the fault;
- "finishes exactly": both ranks exit 0 and rank 0 prints the losses of the same run without the
  fault;
- "stops, one line": both ranks exit 143 (SIGTERM's) within the bound, with one "stopped" line for
  the job.

Phases: start-up (before rank 1 joins the rendezvous), the F, B or W task of step 2's microbatch 1,
step 2's gradient sync (a 2-replica DP layout), the write and the commit of the checkpoint after
step 1, and the final barrier after step 3. Kinds: kill (SIGKILL), stop (SIGSTOP for good),
pause (SIGSTOP, continued after half of ``timeout_s``), slow (1.5 x the phase's bound more: a
task's lane held, or a sleep in the phase), term (SIGTERM: what torchrun's agent sends to stop a
job), hang (a sleep for good in the sync, save, commit or barrier phase, alive and beating: its
peer waits ``timeouts.progress_s``, set to ``PROGRESS_S`` in every row, at its next collective; in
the F task, where rank 1 names its own task once it ran past ``timeouts.task_s``, 2 x progress_s,
and rank 0 names rank 1 as failed first; or
inside the F task of step 2's microbatch 1 on one stage of two TP ranks, "TP F", before the task's
first TP all-reduce, where rank 0 waits for it: rank 0's line names that all-reduce too; and the
same on one MoE stage of two EP ranks, "EP F" (kill, stop and hang), before the task's first
all-to-all, where rank 0 waits for it).
The pause, slow and term rows are the ``long`` tier (they wait out their fault).

Each rank is a child of the test session's forkserver running ``rrfp.app.cli.main.main``
(tests/harness/train_rows.py); the rows run a few at a time, all started by one module fixture,
each test then reading its own row's result. docs/faults.md holds the table
(tests/pipeline/test_fault_matrix.py writes it).
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the harness
from harness.train_fault_rows import (
    DISK,
    FINISHES,
    LAYOUTS,
    LONG,
    MEET_S,
    NAMED,
    PAUSE_S,
    PHASES,
    PROGRESS_S,
    ROWS,
    SET_ASIDE,
    SLACK_S,
    START_S,
    TASK_S,
    TIMEOUT_S,
    _bound,
)  # noqa: E402
from harness.train_rows import TrainJob, losses  # noqa: E402

from rrfp.app.faults import FULL_BYTES  # noqa: E402
from rrfp.app.job.run_outputs import PROBE_PREFIX  # noqa: E402
from rrfp.app.train.checkpoint_dir import MARKER  # noqa: E402

LIMIT_S = 120.0  # a row that has not ended by then hangs
AT_ONCE = 3  # rows running together


def _slow_s(phase: str) -> float:
    return 1.5 * _bound(phase)


def _spec(kind: str, phase: str) -> str:
    where, _ = PHASES[phase]
    if kind == "pause":
        return f"stop:rank=1:{where}:seconds={PAUSE_S:g}"
    if kind == "slow":
        return f"slow:rank=1:{where}:seconds={_slow_s(phase):g}"
    return f"{kind}:rank=1:{where}"


def _argv(tmp: Path, layout: str, fault: str | None, meet_s: float = MEET_S) -> list[str]:
    sets = [
        "steps=3",
        f"timeout_s={TIMEOUT_S:g}",
        f"timeouts.progress_s={PROGRESS_S:g}",
        f"timeouts.process_group_s={meet_s:g}",
        f"timeouts.store_connect_s={meet_s:g}",
        "n_microbatches=4",
        "model.n_layer=2",
        "model.n_embd=16",
        "model.block_size=32",
        "data.min_seq_len=8",
        "data.max_seq_len=32",
        f"log_dir={tmp / 'logs'}",
        "output.dir=",  # no run folder: metrics nobody reads
        f"checkpoint.dir={tmp / 'ck'}",
        "checkpoint.every=1",
        *LAYOUTS[layout],
        *([f"fault={fault}"] if fault else []),
    ]
    # the EP rows need a mixture of experts: the Llama family's (its layers' sizes as above)
    config = "configs/moe-tiny.toml" if layout == "ep" else "configs/gpt-tiny.toml"
    return ["--config", config, *(a for s in sets for a in ("--set", s))]


@dataclass
class Outcome:
    """How a row's job ended: exit codes, rank 0's lines and losses, and when (seconds after
    rank 1 logged the fault; None: it never did, or the rank did not end)."""

    codes: list[int | None]
    lines: list[list[str]]
    losses: dict[int, str]
    fault_at: float | None
    ended_after: dict[int, float] = field(default_factory=dict)
    tails: str = ""
    committed: list[str] = field(default_factory=list)  # the checkpoints left committed
    left: list[str] = field(default_factory=list)  # everything else left in the checkpoint folder


def _left(ck: Path) -> list[str]:
    """What a checkpoint folder holds besides its committed checkpoints."""
    committed = re.compile(r"step-\d{8}")
    return sorted(
        p.name
        for p in ck.glob("*")
        if not (committed.fullmatch(p.name) and (p / MARKER).is_file())
        and not p.name.startswith(PROBE_PREFIX)
    )


def run_job(tmp: Path, layout: str, fault: str | None, meet_s: float = MEET_S) -> Outcome:
    job = TrainJob(tmp, _argv(tmp, layout, fault, meet_s))
    fault_at = None
    try:
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            job.poll()
            if fault_at is None and fault and "injecting fault" in job.err(1):
                fault_at = time.monotonic()
            # a stopped or hung rank 1 never ends: rank 0 ending is the row's end
            never = fault is not None and fault.startswith(("stop", "hang"))
            if 0 in job.ended and (1 in job.ended or fault_at is not None and never):
                if 1 in job.ended or time.monotonic() > job.ended[0] + 1:
                    break
            time.sleep(0.05)
        base = fault_at if fault_at is not None else job.started
        return Outcome(
            codes=[job.code(r) for r in (0, 1)],
            lines=[job.lines(r) for r in (0, 1)],
            losses=losses(job.out(0)),
            fault_at=None if fault_at is None else fault_at - job.started,
            ended_after={r: t - base for r, t in job.ended.items()},
            tails="\n".join(f"--- rank {r}:\n{job.err(r)[-1500:]}" for r in (0, 1)),
            committed=sorted(c.parent.name for c in (tmp / "ck").glob(f"step-*/{MARKER}")),
            left=_left(tmp / "ck"),
        )
    finally:
        job.kill()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else {}


def resume_after_flip(tmp: Path) -> tuple[Outcome, Outcome, dict, dict]:
    """A job of three steps (checkpoints of steps 2 and 3 kept); then one byte of step 3's commit
    record flipped; then the same job resumed: the first job, the resumed one, the files of step 3
    as the resume found them and those of ``rejected-step-00000003`` after it."""
    first = run_job(tmp, "pp", None)
    latest = tmp / "ck" / "step-00000003"
    record = bytearray((latest / MARKER).read_bytes())
    record[40] ^= 0x40
    (latest / MARKER).write_bytes(bytes(record))
    found = _files(latest)
    job = TrainJob(tmp / "resumed", [*_argv(tmp, "pp", None), "--set", "resume=auto"])
    job.finish(LIMIT_S)
    resumed = Outcome(
        codes=job.codes(),
        lines=[job.lines(r) for r in (0, 1)],
        losses=losses(job.out(0)),
        fault_at=0.0,
        tails=job.tails(),
        committed=sorted(c.parent.name for c in (tmp / "ck").glob(f"step-*/{MARKER}")),
        left=_left(tmp / "ck"),
    )
    return first, resumed, found, _files(tmp / "ck" / "rejected-step-00000003")


def _row_job(root: Path, kind: str, phase: str) -> tuple:
    """``run_job`` and its arguments for the row (kind, phase)."""
    if kind == "flip":
        return resume_after_flip, root / f"{kind}-{phase}"
    meet = START_S if phase == "start-up" else MEET_S
    return run_job, root / f"{kind}-{phase}", PHASES[phase][1], _spec(kind, phase), meet


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """The job of every row this session runs (and the references they compare with), AT_ONCE
    at a time, started at once; {(kind, phase) or layout: Future}."""
    root = tmp_path_factory.mktemp("train_matrix")
    chosen = [
        item.callspec.params
        for item in request.session.items
        if item.originalname == "test_train_fault_matrix_row"
    ]
    pool = concurrent.futures.ThreadPoolExecutor(AT_ONCE)
    futures: dict = {
        layout: pool.submit(run_job, root / f"reference-{layout}", layout, None)
        for layout in {PHASES[c["phase"]][1] for c in chosen if c["outcome"] == FINISHES}
    }
    for c in chosen:
        futures[c["kind"], c["phase"]] = pool.submit(*_row_job(root, c["kind"], c["phase"]))
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("api", "kind", "phase", "outcome"),
    [pytest.param(*row, marks=[pytest.mark.long] if row[1] in LONG else []) for row in ROWS],
)
def test_train_fault_matrix_row(api, kind, phase, outcome, outcomes):
    if outcome == SET_ASIDE:  # the same losses from the newest that verifies, the bad one kept
        first, got, found, kept = outcomes[kind, phase].result()
        assert first.codes == [0, 0] and got.codes == [0, 0], first.tails + got.tails
        assert got.losses == {3: first.losses[3]}, (got.losses, first.losses, got.tails)
        warned = [ln for ln in got.lines[0] if "failed verification" in ln]
        assert len(warned) == 1 and "resuming from" in warned[0], got.tails
        assert "step-00000003 as rejected-step-00000003" in warned[0], warned
        assert got.left == ["rejected-step-00000003"], got.left
        assert kept == found, "the rejected checkpoint's files changed"  # byte for byte
        assert got.committed == ["step-00000002", "step-00000003"], got.committed
        return
    got: Outcome = outcomes[kind, phase].result()
    assert got.fault_at is not None, f"the fault never fired\n{got.tails}"
    bound = _bound(phase, kind) + SLACK_S
    if outcome == FINISHES:
        reference: Outcome = outcomes[PHASES[phase][1]].result()
        assert reference.codes == [0, 0], reference.tails
        assert got.codes == [0, 0], got.tails
        assert got.losses == reference.losses and len(got.losses) == 3, (got.losses, got.tails)
        return
    if outcome == NAMED:
        assert got.codes[0] == 1, got.tails
        assert len(got.lines[0]) == 1 and "rank 1" in got.lines[0][0], got.tails
        line = got.lines[0][0]
        for name in re.findall(r"checkpoint (step-\d+) was not saved", line):
            assert name not in got.committed, f"{name} is committed, yet: {line}"
        for name in re.findall(r"checkpoint (step-\d+) is committed", line):
            assert name in got.committed, f"{name} is not committed, yet: {line}"
        if phase == "F" and kind == "hang":  # rank 1 named its own task, past its bound
            said = [ln for ln in got.lines[1] if "task F1 (microbatch 1) has run for" in ln]
            assert said and f"over its bound of {TASK_S:g} s" in said[0], got.tails
        if phase == "TP F":  # the collective rank 0 waited at, and what rank 1's heartbeat said
            at = "the row-parallel all-reduce of transformer.h.0.attn.c_proj in task F1 of stage 0"
            assert f"{at}: rank 1 (alive, in task F1 for " in line, line
            assert "never reached it" in line and f"timeouts.progress_s = {PROGRESS_S:g} s" in line
        if phase == "EP F" and kind == "hang":  # the all-to-all rank 0 waited at
            at = "the EP count all-to-all of layers.1.mlp.experts in task F1 of stage 0"
            assert f"{at}: rank 1 (alive, in task F1 for " in line, line
            assert "never reached it" in line and f"timeouts.progress_s = {PROGRESS_S:g} s" in line
        took = got.ended_after[0]
        assert took <= bound, f"named after {took:.1f} s\n{got.tails}"
        print(f"{api} {kind} {phase}: named after {took:.2f} s")
        return
    if outcome == DISK:  # each rank's one line names the checkpoint, the cause and the limit
        assert got.codes == [1, 1], got.tails
        partial = "ck/.partial-step-00000001: rank 1: File too large (EFBIG)"
        for lines in got.lines:
            assert len(lines) == 1 and partial in lines[0], got.tails
            assert "checkpoint step-00000001 was not saved" in lines[0], got.tails
            assert f"file size limit of {FULL_BYTES} bytes (ulimit -f" in lines[0], got.tails
        assert got.committed == [] and got.left == [], (got.committed, got.left)
        assert max(got.ended_after.values()) <= bound, got.ended_after
        return
    assert got.codes == [143, 143], got.tails
    stopped = [ln for lines in got.lines for ln in lines if ln.startswith("rrfp: stopped")]
    assert len(stopped) == 1, got.tails
    assert max(got.ended_after.values()) <= bound, got.ended_after


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_commit_write_longer_than_progress_s_is_progress_not_a_stuck_rank(tmp_path):
    """Rank 0 writes the commit for 1.5 x progress_s (a slow file system) while rank 1 waits for
    it at the commit's all-reduce: a write is progress, so the run finishes and keeps it."""
    slow = f"slow:rank=0:step=1:during=commit:seconds={1.5 * PROGRESS_S:g}"
    got = run_job(tmp_path, "pp", slow)
    assert got.codes == [0, 0], got.tails
    assert len(got.losses) == 3, got.tails
    assert f"slow for {1.5 * PROGRESS_S:g} s, done" in got.tails, got.tails  # rank 0's fault fired
    assert got.committed == ["step-00000002", "step-00000003"], got.committed  # checkpoint.keep


if __name__ == "__main__":  # every row's outcome, as observed (no assertion)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
            rows = [r for r in ROWS if not sys.argv[1:] or r[1] in sys.argv[1:]]
            jobs = {
                (kind, phase): pool.submit(*_row_job(Path(d), kind, phase))
                for _, kind, phase, _ in rows
            }
            for (kind, phase), f in jobs.items():
                o = f.result()
                o = o[1] if isinstance(o, tuple) else o  # flip: the resumed job
                ends = {r: round(t, 2) for r, t in o.ended_after.items()}
                print(kind, phase, o.codes, ends, o.losses, o.lines, sep=" | ", flush=True)
