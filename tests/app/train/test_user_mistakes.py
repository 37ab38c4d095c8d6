"""A mistake in the user's own workload (tests/fixtures/user_mistakes.py), run as a user runs it,
`rrfp train --nproc-per-node 2`, ends in one line on stderr and nothing else: the line names the
user's function, the task that called it, the exception and the shapes on both sides, and says it
is the user's code, not rrfp's. Under a bare torchrun the same line comes first, and torchrun's own
summary shows it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import ROOT
from harness.forked_python import run_python

pytestmark = pytest.mark.e2e

FIXTURE = "tests.fixtures.user_mistakes"


def _config(tmp: Path, workload: str) -> Path:
    path = tmp / f"{workload}.toml"
    path.write_text(
        f'[run]\nmodel = "{FIXTURE}:{workload}"\nsteps = 1\n\n[schedule]\nn_microbatches = 2\n\n'
        f'[output]\nlog_dir = "{tmp / "logs"}"\ndir = ""\n'
    )  # no run folder: no test reads the metrics (rank 0 of a fresh interpreter imports no
    # TensorBoard writer)
    return path


def _run(tmp: Path, module: str, *argv: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV`` from the repository, started from the preloaded forkserver
    (tests/harness/forked_python.py); rrfp's launcher forks its ranks, torchrun's agent starts
    fresh interpreters."""
    return run_python(["-m", module, *argv], cwd=ROOT, timeout=150)


def launched(tmp: Path, workload: str) -> subprocess.CompletedProcess:
    """``rrfp train --nproc-per-node 2`` on the fixture's ``workload``."""
    return _run(
        tmp, "rrfp", "train", "--nproc-per-node", "2", "--config", str(_config(tmp, workload))
    )


BOUNDARY = (
    "rrfp: error: rank 1 (stage 1): step 1, task F0 (microbatch 0): your code "
    f"({FIXTURE}:boundary) raised RuntimeError in the forward of stage 1 (torch.nn.Linear): mat1 "
    "and mat2 shapes cannot be multiplied (4x16 and 8x1); stage 0 sent [4, 16]; stage 1's first "
    "layer, Linear takes [*, 8]: make stage 0's output fit stage 1's input (traceback in {log})"
)


@pytest.mark.timeout(180)
def test_a_stage_output_that_does_not_fit_the_next_stage_is_one_line_with_both_shapes(tmp_path):
    res = launched(tmp_path, "boundary")
    log = tmp_path / "logs" / "rank-1.log"
    assert res.stderr == BOUNDARY.format(log=log) + "\n", res.stderr
    assert res.returncode == 1, res.returncode
    assert "rrfp: raised in task F0 (microbatch 0) of iteration 0" in log.read_text()


@pytest.mark.timeout(180)
def test_targets_that_do_not_fit_the_loss_are_one_line_with_both_shapes(tmp_path):
    res = launched(tmp_path, "loss_shape")
    log = tmp_path / "logs" / "rank-1.log"
    assert res.stderr == (
        "rrfp: error: rank 1 (stage 1): step 1, task F0 (microbatch 0): your code "
        f"({FIXTURE}:loss_shape) raised RuntimeError in the loss ({FIXTURE}.squared_error): The "
        "size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 0; it "
        "got the output [4, 1] and the targets [8, 1]: make the last stage's output and the "
        f"batches' targets fit the loss (traceback in {log})\n"
    ), res.stderr
    assert res.returncode == 1, res.returncode


@pytest.mark.timeout(120)
def test_batches_that_return_too_few_microbatches_are_one_line_before_any_rank_starts(tmp_path):
    res = launched(tmp_path, "one_short")
    log = tmp_path / "logs" / "rank-0.log"
    assert res.stderr == (
        f"rrfp: error: your code's batches ({FIXTURE}.batches_one_short) for step 1 returned 1 "
        "microbatch where 2 were asked for; batches(data, step, n) must return exactly n (inputs, "
        f"targets) pairs (traceback in {log})\n"
    ), res.stderr
    assert res.returncode == 1, res.returncode


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("workload", "said"),
    [
        (
            "one_extra",
            "batches_one_extra) for step 1 returned 3 microbatches where 2 were asked for",
        ),
        (
            "bare_tensors",
            "batches_of_bare_tensors) for step 1 returned microbatch 0 as a Tensor [4, 8], not an "
            "(inputs, targets) pair",
        ),
    ],
)
def test_batches_with_one_too_many_or_bare_tensors_are_one_line_before_any_rank_starts(
    tmp_path, workload, said
):
    res = launched(tmp_path, workload)
    log = tmp_path / "logs" / "rank-0.log"
    assert res.stderr == (
        f"rrfp: error: your code's batches ({FIXTURE}.{said}; batches(data, step, n) must return "
        f"exactly n (inputs, targets) pairs (traceback in {log})\n"
    ), res.stderr
    assert res.returncode == 1, res.returncode


@pytest.mark.timeout(180)
def test_under_a_bare_torchrun_the_line_comes_first_and_its_summary_shows_it(tmp_path):
    config = _config(tmp_path, "boundary")
    res = _run(
        tmp_path, "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "rrfp", "train", "--config", str(config),
    )  # fmt: skip
    line = BOUNDARY.format(log=tmp_path / "logs" / "rank-1.log")
    first = next(ln for ln in res.stderr.splitlines() if ln.startswith("rrfp: "))
    assert first == line, res.stderr
    summary = res.stderr[res.stderr.index("ChildFailedError") :]
    assert f"traceback : {line}" in summary, res.stderr
    assert res.returncode == 1, res.returncode
