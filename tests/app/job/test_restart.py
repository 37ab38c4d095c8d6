"""Restarts that resume by themselves: under ``torchrun --max-restarts 1`` with
``resume = "auto"``, a rank killed in step 3 (SIGKILL, in the first attempt
only) makes torchrun restart both workers; they resume from the step-2
checkpoint and finish. The job exits 0, and the losses and the final model,
optimizer and RNG state equal those of a run that was never interrupted.

The command is docs/checkpoints.md's (restarts), with the fault standing in
for ``kill -9``. The run never interrupted has no restart to make: its ranks are plain processes
(tests/harness/train_rows.py) running the same command.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import ROOT
from harness.checkpoint_state import differing, final_state
from harness.forked_python import run_python
from harness.train_rows import TrainJob, forked_rrfp, losses

pytestmark = pytest.mark.e2e

STEPS, KILLED_IN = 4, 3
SETS = [
    "model.n_layer=2",
    "model.n_embd=32",
    "model.block_size=64",
    "data.min_seq_len=16",
    "data.max_seq_len=64",
    "n_microbatches=4",
    "model.dropout=0.1",
    f"steps={STEPS}",
    "checkpoint.every=1",
    "resume=auto",
    "timeout_s=30",
]


def _train_args(tmp: Path, *extra: str) -> list[str]:
    """The arguments after ``rrfp train``: the config, ``SETS`` and ``extra``."""
    sets = [*SETS, f"checkpoint.dir={tmp / 'ck'}", f"log_dir={tmp / 'logs'}", *extra]
    return ["--config", "configs/gpt-tiny.toml", *[a for s in sets for a in ("--set", s)]]


def torchrun(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 --max-restarts 1 -m rrfp train``, the agent started from the
    preloaded forkserver (tests/harness/forked_python.py), each attempt's ranks forks of it as
    ``rrfp train --nproc-per-node`` has them (``forked_rrfp``): the restart is the point here, not
    a fresh interpreter's start (test_fault_matrix_agents.py's ranks are fresh)."""
    return run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", *forked_rrfp("train", *_train_args(tmp, *extra))], cwd=ROOT, timeout=150,
    )  # fmt: skip


@pytest.mark.timeout(330)
def test_torchrun_restart_resumes_and_matches_an_unbroken_run(tmp_path):
    whole = TrainJob(tmp_path / "whole", _train_args(tmp_path / "whole")).finish(150)
    assert whole.codes() == [0, 0], whole.tails()
    whole_out = whole.out(0)
    broken = torchrun(tmp_path / "broken", f"fault=kill:step={KILLED_IN}:stage=1:attempt=0")
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert "injecting fault kill" in broken.stderr, "the rank was never killed"
    resumed = (
        f"resume: from {tmp_path / 'broken' / 'ck' / f'step-{KILLED_IN - 1:08d}'} (step "
        f"{KILLED_IN - 1} of {STEPS})"
    )
    assert resumed in broken.stdout, broken.stdout
    assert f"done: {STEPS - KILLED_IN + 1} steps after step {KILLED_IN - 1}" in broken.stdout, (
        broken.stdout
    )
    # every step printed once, from the first attempt (1, 2) or the restarted one (3, 4), as the
    # unbroken run
    assert losses(whole_out) == losses(broken.stdout) and len(losses(whole_out)) == STEPS, (
        whole_out,
        broken.stdout,
    )
    a, b = (
        final_state(tmp_path / "whole" / "ck", STEPS),
        final_state(tmp_path / "broken" / "ck", STEPS),
    )
    assert (
        a.keys() == b.keys()
        and any(".optim.state." in k for k in a)
        and any(".rng" in k for k in a)
    )
    differ = differing(a, b)
    assert not differ, f"the restarted run's final state differs in {differ[:5]}"
