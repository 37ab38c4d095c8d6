"""An exception raised in the user's code is the user's: marked where rrfp calls that code
(rrfp/pipeline/user_code.py), it keeps its type, and rrfp/app/job/failure.py classifies it USER and
prints a line that names the function and what rrfp passed it; an exception rrfp raises itself
stays INTERNAL ("please report it"), and a lost peer inside the user's forward stays a peer
failure. The e2e runs are in test_user_mistakes.py."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from harness.cli_run import rrfp_in_process
from torch import nn

from rrfp.app.job.failure import INTERNAL, SECONDARY, USER, Failure, kind_of
from rrfp.app.train.evaluation import held_out
from rrfp.app.train.run_summary import data_found
from rrfp.comm.pipeline_channels import PipelineChannels
from rrfp.core.budget import Budget
from rrfp.core.errors import PeerFailure
from rrfp.core.hints import resolve
from rrfp.core.policy import Dispatch
from rrfp.loop.lane import ComputeLane
from rrfp.pipeline.executor import StageExecutor
from rrfp.pipeline.schedule_settings import ScheduleSettings
from rrfp.pipeline.user_code import WorkloadError, user_code
from rrfp.pipeline.worker import StageWorker
from tests.fixtures import user_mistakes

LOG = "runs/logs/rank-1.log"


def _mse(out, targets):
    return ((out - targets) ** 2).mean()


def _raised(fn, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_a_forward_that_does_not_fit_its_input_is_the_users_with_both_shapes():
    worker = StageWorker(nn.Linear(8, 1), 1, 2, 1, _mse, split=False)
    e = _raised(worker.forward, 0, torch.randn(4, 16), torch.randn(4, 1))
    assert type(e) is RuntimeError  # its own type: an embedding caller catches what torch raised
    assert kind_of(e) == USER
    assert Failure.of(e).line(1, 1, LOG, debug=False, model="upkg.net") == (
        "rank 1 (stage 1): your code (upkg.net) raised RuntimeError in the forward of stage 1 "
        "(torch.nn.Linear): mat1 and mat2 shapes cannot be multiplied (4x16 and 8x1); stage 0 "
        "sent [4, 16]; stage 1's first layer, Linear takes [*, 8]: make stage 0's output fit "
        f"stage 1's input (traceback in {LOG})"
    )


def test_a_forward_error_not_about_shapes_gives_the_input_without_a_fix():
    class Broken(nn.Module):
        def forward(self, x):
            raise KeyError("no such head")

    e = _raised(StageWorker(Broken(), 0, 2, 1, _mse, split=False).forward, 0, torch.ones(2, 3))
    mark = user_code(e)
    assert mark.where.startswith("the forward of stage 0 (") and mark.where.endswith(".Broken)")
    assert mark.detail == "its input (from the workload's batches) is [2, 3]"


def test_targets_that_do_not_fit_the_loss_are_the_users_with_both_shapes():
    worker = StageWorker(nn.Linear(8, 1), 1, 2, 1, _mse, split=False)
    e = _raised(worker.forward, 0, torch.randn(4, 8), torch.randn(8, 1))
    assert kind_of(e) == USER
    assert user_code(e).where == "the loss (test_user_code._mse)"
    assert user_code(e).detail == (
        "it got the output [4, 1] and the targets [8, 1]: make the last stage's output and the "
        "batches' targets fit the loss"
    )


def test_a_custom_backward_that_raises_is_the_users():
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("my backward is broken")

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(Fails.apply(x))

    worker = StageWorker(Stage(), 1, 2, 1, _mse, split=False)
    worker.forward(0, torch.ones(2, 3), torch.ones(2, 1))
    e = _raised(worker.backward, 0)
    assert kind_of(e) == USER and user_code(e).where.startswith("the backward of stage 1 (")


@pytest.mark.parametrize("measure", [True, False])  # rrfp's own in-place check, or autograd's
def test_a_forward_that_changes_a_saved_tensor_in_place_is_the_users_backward(measure):
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x).sigmoid()  # sigmoid saves its output for backward
            y.mul_(2)
            return y

    worker = StageWorker(InPlace(), 0, 2, 1, _mse, split=False, measure_activations=measure)
    worker.forward(0, torch.ones(2, 3))
    e = _raised(worker.backward, 0, torch.ones(2, 3))
    assert "modified by an inplace operation" in str(e)
    assert kind_of(e) == USER and user_code(e).where.startswith("the backward of stage 0 (")


def test_rrfps_own_errors_stay_internal():
    """The worker's own checks of what the executor asked for are rrfp's: a bug if they fire."""
    worker = StageWorker(nn.Linear(3, 3), 0, 2, 1, _mse, split=False)
    worker.forward(0, torch.ones(2, 3))
    twice = _raised(worker.forward, 0, torch.ones(2, 3))  # F0 twice in one iteration
    assert user_code(twice) is None and kind_of(twice) == INTERNAL
    wrong_grad = _raised(worker.backward, 0, torch.ones(5, 3))  # its grad_output's shape
    assert kind_of(wrong_grad) == INTERNAL
    assert "internal error, please report it" in Failure.of(wrong_grad).line(0, 0, LOG, False)


def test_a_lost_peer_inside_the_users_forward_is_a_peer_failure():
    """A TP layer's collective in the forward that lost its peer: the peer's failure, not the
    user's."""

    class Collective(nn.Module):
        def forward(self, x):
            raise PeerFailure("the row-parallel all-reduce of x in task F0: rank 3 is gone", 3)

    e = _raised(StageWorker(Collective(), 0, 2, 1, _mse, split=False).forward, 0, torch.ones(1))
    assert user_code(e) is not None and kind_of(e) == SECONDARY


def test_the_executor_names_the_task_and_the_iteration():
    worker = StageWorker(nn.Linear(8, 1), 0, 1, 2, _mse, split=False)
    settings = ScheduleSettings(2, Dispatch.READY, resolve("1f1b"), Budget.parse("2x"), False)
    lane = ComputeLane()
    ex = StageExecutor(worker, PipelineChannels(0), lane, settings)
    batches = [(torch.ones(4, 8), torch.ones(4, 1)), (torch.ones(4, 9), torch.ones(4, 1))]
    try:
        e = _raised(asyncio.run, ex.run_iteration(4, batches))
    finally:
        lane.close()
    mark = user_code(e)
    assert (mark.task, mark.iteration, mark.stage) == ("F1", 4, 0), mark
    line = Failure.of(e).line(0, 0, LOG, False)
    assert line.startswith(
        "rank 0 (stage 0): step 5, task F1 (microbatch 1): your code raised RuntimeError in "
        "the forward of stage 0 (torch.nn.Linear): mat1 and mat2 shapes cannot be multiplied"
    ), line


def test_batches_and_build_stage_are_the_users():
    wl = user_mistakes.one_short
    e = _raised(wl.microbatches, wl.data_config(), 0, 3)
    assert isinstance(e, WorkloadError) and kind_of(e) == USER
    assert str(e) == "returned 2 microbatches where 3 were asked for"
    e = _raised(held_out, wl, wl.data_config(), 0, 3)  # evaluation's held-out microbatches too
    assert isinstance(e, WorkloadError) and user_code(e).where == (
        "batches (tests.fixtures.user_mistakes.batches_one_short) for held-out iteration 1"
    )

    def build_stage(model, stage, num_stages, tp_group):
        raise IndexError("no layer 9")

    broken = dataclasses.replace(user_mistakes.boundary, build_stage=build_stage)
    e = _raised(broken.build_stages, broken.model_config(), [1], 2, 0)
    assert user_code(e).where == (
        "build_stage (test_user_code.test_batches_and_build_stage_are_the_users.<locals>."
        "build_stage) for stage 1"
    )


def test_a_typo_in_check_is_one_line_naming_it_exit_1(tmp_path, monkeypatch):
    """The config does not load: the traceback goes to the default log_dir (here, in tmp_path)."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.toml"
    config.write_text('[run]\nmodel = "tests.fixtures.user_mistakes:typo_in_check"\n')
    res = rrfp_in_process("train", "--config", str(config), "--dry-run")
    assert res.returncode == 1, res.stderr
    assert res.stderr == (
        "rrfp: error: your code raised AttributeError in check "
        "(tests.fixtures.user_mistakes.check_with_a_typo): 'ModelConfig' object has no attribute "
        "'widht' (traceback in runs/logs/rank-0.log)\n"
    )
    assert "widht" in (tmp_path / "runs" / "logs" / "rank-0.log").read_text()


def test_batches_that_return_too_few_are_found_by_a_dry_run(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        '[run]\nmodel = "tests.fixtures.user_mistakes:one_short"\n[schedule]\nn_microbatches = 2\n'
    )
    res = rrfp_in_process(
        "train", "--config", str(config), "--dry-run", "--set", f"log_dir={tmp_path}"
    )
    assert res.returncode == 1, res.stderr
    assert "your code's batches (tests.fixtures.user_mistakes.batches_one_short)" in res.stderr
    assert "internal error" not in res.stderr


def test_the_start_up_summarys_questions_to_the_workload_are_the_users():
    """rank 0's summary asks the workload about its data: describe_data, else one microbatch."""
    wl = user_mistakes.one_short
    e = _raised(data_found, SimpleNamespace(workload=wl, data=wl.data_config()))
    assert isinstance(e, WorkloadError) and kind_of(e) == USER  # batches(data, 0, 1) gives none

    def describe_data(data):
        return f"{data.files} files"

    described = dataclasses.replace(wl, describe_data=describe_data)
    e = _raised(data_found, SimpleNamespace(workload=described, data=wl.data_config()))
    assert type(e) is AttributeError and user_code(e).where == (
        "describe_data (test_user_code.test_the_start_up_summarys_questions_to_the_workload_are_"
        "the_users.<locals>.describe_data)"
    )
