"""``rrfp train --nproc-per-node 2`` checks the config once, in the launcher, for the world it
starts, and says its warnings and the resume point there: rank 0 of the job it starts does not
say them again (each appeared twice). With a good config the launcher is torchrun: the ranks
train and rank 0 reports once. The launcher runs in a child of the test session's preloaded
forkserver as ``python -m rrfp`` (tests/harness/forked_python.py), its agent in it and its ranks
forks of it, as from a fresh interpreter: what the launcher and its ranks say is the point; the
console script's own start is tests/app/job/test_own_model_launch.py's."""

from __future__ import annotations

import pytest
from harness import ROOT
from harness.forked_python import run_python
from harness.launch import child_env

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_the_launchers_warnings_and_resume_line_come_once(tmp_path):
    sets = [
        "steps=1",
        "pp=2",
        "n_microbatches=2",
        "model.n_layer=2",
        "model.n_embd=16",
        "model.block_size=32",
        "data.min_seq_len=8",
        "data.max_seq_len=32",
        "budget=1B",  # a byte budget below one microbatch: a warning
        f"checkpoint.dir={tmp_path / 'ck'}",
        "resume=auto",  # with no checkpoint yet: "resume: no checkpoint in ..."
        f"log_dir={tmp_path / 'logs'}",
        f"output.dir={tmp_path / 'run'}",
    ]
    argv = ["train", "--nproc-per-node", "2", "--config", "configs/gpt-tiny.toml"]
    res = run_python(
        ["-m", "rrfp", *argv, *(a for s in sets for a in ("--set", s))],
        cwd=ROOT,
        env=child_env(),
        timeout=200,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("done: 1 steps") == 1, res.stdout
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("rrfp: warning:")]
    assert len(warnings) == 1 and "schedule.budget = 1B" in warnings[0], res.stderr
    resumes = [ln for ln in res.stdout.splitlines() if ln.startswith("resume:")]
    assert resumes == [f"resume: no checkpoint in {tmp_path / 'ck'}, starting at step 0"], (
        res.stdout
    )
