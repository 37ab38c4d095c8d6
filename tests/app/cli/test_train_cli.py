"""`rrfp train` on bad input: one line that names the problem, exit code 2, no
traceback, and no process group (nothing waits for peers that never come).

Every config error is a ConfigError from ``TrainConfig.load``, which ``rrfp
train`` prints as that one line before any group exists. So the tables of
errors check each message in this process (``config_error``), and one case of
each table runs the command, in this process (``rrfp``), under a torchrun-like environment;
one runs it as a subprocess, for what only a process shows."""

from __future__ import annotations

import subprocess
from unittest import mock

import pytest
from harness import ROOT
from harness.cli_run import (
    CONFIG,
    assert_usage_error,
    config_error,
    rrfp,
    sets_args,
)
from harness.launch import child_env, rrfp_argv

from rrfp.app.config.train_config import ConfigError, TrainConfig

BAD_OVERRIDES = [
    (["foo=1"], ["--set foo: no section has a key 'foo'"]),
    (["schedule.hnt=bfw"], ["--set schedule.hnt: unknown key schedule.hnt (did you mean hint?)"]),
    (
        ["model.n_embdd=32"],
        ["--set model.n_embdd: unknown key model.n_embdd (did you mean n_embd?)"],
    ),
    (["steps=abc"], ["run.steps", "'abc'", "wrong type", "int"]),
    (["model.n_embd=1.5"], ["model.n_embd", "wrong type"]),
    (["lr=fast"], ["optim.lr", "wrong type", "float"]),
    (["hint=nope"], ["unknown hint 'nope'", "gpipe, 1f1b"]),
    (['budget="0"'], ["schedule.budget", "budget 0 is below 1 microbatch"]),
    (["budget=0x"], ["schedule.budget", "must be above 0x"]),
    (["budget=lots"], ["schedule.budget", "not a budget: 'lots'"]),
    (["schedule.dispatch=eager"], ["schedule.dispatch", "unknown dispatch mode", "'eager'"]),
    (["steps=0"], ["run.steps must be >= 1, got 0"]),
    (["steps"], ["--set 'steps' is not KEY=VALUE"]),
]

# each names its own key and value, and no other (they once shared one line naming all three)
SIGN_ERRORS = [
    (["timeout_s=0"], "run.timeout_s must be > 0, got 0"),
    (["lr=0"], "optim.lr must be > 0, got 0"),
    (["unit_ms=-1"], "emulation.unit_ms must be >= 0 (0: no emulated time), got -1"),
    (["lr=-0.5"], "optim.lr must be > 0, got -0.5"),
]


@pytest.mark.parametrize("sets,message", SIGN_ERRORS, ids=[" ".join(s) for s, _ in SIGN_ERRORS])
def test_sign_errors_name_the_key_and_its_value(sets, message):
    assert config_error(sets) == message


@pytest.mark.parametrize("sets,needles", BAD_OVERRIDES, ids=[" ".join(s) for s, _ in BAD_OVERRIDES])
def test_bad_override(sets, needles):
    config_error(sets, *needles)


@pytest.mark.parametrize(
    "sets,needles", [BAD_OVERRIDES[2], BAD_OVERRIDES[-1]], ids=["wrong type", "not KEY=VALUE"]
)
def test_bad_override_on_the_command_line(sets, needles):
    assert_usage_error(rrfp("--config", CONFIG, *sets_args(sets), "--dry-run"), *needles)


def test_integer_budget_is_a_count():
    assert rrfp("--config", CONFIG, "--set", "budget=4", "--dry-run", world=4).returncode == 0
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "budget=0", "--dry-run"), "budget 0 is below 1"
    )


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    assert_usage_error(
        rrfp("--config", str(missing), "--dry-run"),
        "cannot read config",
        str(missing),
        "No such file",
    )


def test_bad_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nsteps = 5\nhint = bfw\n")  # an unquoted string
    assert_usage_error(
        rrfp("--config", str(bad), "--dry-run"), str(bad), "not valid TOML", "line 3"
    )


def test_bad_key_and_type_in_file(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nsteps = "many"\n')
    assert_usage_error(rrfp("--config", str(cfg), "--dry-run"), str(cfg), "run.steps", "wrong type")
    cfg.write_text("[runn]\nsteps = 5\n")
    assert_usage_error(rrfp("--config", str(cfg), "--dry-run"), "unknown section [runn]")


def test_missing_config_argument():
    assert_usage_error(rrfp(), "--config")


def test_dry_run_prints_the_layout():
    res = rrfp("--config", CONFIG, "--dry-run", world=4)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert lines[:6] == [
        "layout pp=4 x tp=1 x dp=1 (world size 4)",
        "rank  stage  tp  dp",
        "   0      0   0   0",
        "   1      1   0   0",
        "   2      2   0   0",
        "   3      3   0   0",
    ], res.stdout
    assert 'hint = "bfw"' in res.stdout  # then the resolved config
    # every rank checks, only rank 0 prints
    other = rrfp("--config", CONFIG, "--dry-run", world=4, rank=2)
    assert (other.returncode, other.stdout, other.stderr) == (0, "", "")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_layout_that_does_not_fit_the_world(dry_run):
    extra = ["--dry-run"] if dry_run else []
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "pp=3", *extra, world=4),
        "pp=3",
        "does not match world size 4",
    )


def test_more_stages_than_layers():
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "model.n_layer=2", world=4),
        "model.n_layer=2 is fewer than the 4 pipeline stages",
    )


VIRTUAL_ERRORS = [
    (
        ["virtual=3", "placement=v"],
        ["parallel.virtual = 3", "placement v needs exactly 2 stages per rank"],
    ),
    (["virtual=0"], ["parallel.virtual must be >= 1, got 0"]),
    (["placement=w"], ["parallel.placement must be one of interleaved, v, got 'w'"]),
    (
        ["virtual=2"],
        [
            "model.n_layer=4 is fewer than the 8 pipeline stages",
            "parallel.virtual = 2 stages on each of 4 pipeline ranks",
        ],
    ),
]


@pytest.mark.parametrize(
    "sets,needles", VIRTUAL_ERRORS, ids=[" ".join(s) for s, _ in VIRTUAL_ERRORS]
)
def test_virtual_stage_errors(sets, needles):
    """Virtual stages that cannot be placed, or a model too shallow for pp x V stages: one line."""
    config_error(sets, *needles, world=4)


def test_virtual_stage_error_on_the_command_line():
    sets, needles = VIRTUAL_ERRORS[-1]
    assert_usage_error(rrfp("--config", CONFIG, *sets_args(sets), world=4), *needles)


def test_dry_run_shows_the_virtual_stages():
    res = rrfp(
        "--config",
        CONFIG,
        "--set",
        "virtual=2",
        "--set",
        "placement=v",
        "--set",
        "model.n_layer=8",
        "--dry-run",
        world=4,
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert (
        "stages: 4 rank(s) x 2 stage(s) per rank (v): rank 0: 0, 7; rank 1: 1, 6; rank 2: 2, 5; "
        "rank 3: 3, 4"
    ) in res.stdout.splitlines(), res.stdout


@pytest.mark.e2e
def test_no_launcher_environment():
    """Without torchrun's environment the run cannot start; it says how to start it. The
    command's subprocess smoke test: the entry point's exit status and stderr."""
    res = subprocess.run(
        rrfp_argv("train", "--config", CONFIG),
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun" in lines[0] and lines[0].startswith("rrfp: error:"), (
        res.stderr
    )
    assert res.returncode != 0


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_tp_that_does_not_divide_the_heads(dry_run):
    extra = ["--dry-run"] if dry_run else []
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "tp=3", "--set", "pp=1", *extra, world=3),
        "tp=3 does not divide n_head=4",
    )


def test_tp_dp_that_do_not_divide_the_world():
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "tp=2", "--set", "dp=2", "--dry-run", world=6),
        "does not divide world size 6",
    )


def test_dry_run_shows_a_tp_dp_layout():
    res = rrfp(
        "--config", CONFIG, "--set", "tp=2", "--set", "dp=2", "--set", "pp=2", "--dry-run", world=8
    )
    assert res.returncode == 0, res.stderr
    assert "layout pp=2 x tp=2 x dp=2 (world size 8)" in res.stdout


DEVICE_ERRORS = [
    (
        ["backend=nccl"],
        ["compute.backend = nccl needs CUDA", "compute.backend = gloo"],
    ),  # this machine has no CUDA
    (["backend=nccl", "device=cpu"], ["carries CUDA tensors only"]),
    (["device=cuda", "backend=gloo"], ["compute.device = cuda needs compute.backend = nccl"]),
    (["device=cuda"], ["compute.device = cuda needs CUDA", "compute.device = cpu"]),  # auto: nccl
    (["device=tpu"], ["compute.device must be one of auto, cpu, cuda, got 'tpu'"]),
    (["backend=mpi"], ["compute.backend must be one of auto, gloo, nccl, got 'mpi'"]),
]


@pytest.mark.parametrize("sets,needles", DEVICE_ERRORS, ids=[" ".join(s) for s, _ in DEVICE_ERRORS])
def test_device_and_backend_errors(sets, needles):
    config_error(sets, *needles)


def test_device_error_exits_2_before_any_group():
    sets, needles = DEVICE_ERRORS[0]
    assert_usage_error(rrfp("--config", CONFIG, *sets_args(sets), world=2), *needles)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    """Checked without a GPU: CUDA is reported present with one device, and two ranks share
    the node."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 ranks on this node but only 1 GPU"):
        TrainConfig.load(CONFIG, ["backend=nccl"], world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert (
        TrainConfig.load(CONFIG, ["backend=nccl", "pp=2"], world_size=2).compute.device_type
        == "cuda"
    )


def test_the_auto_backend_is_nccl_with_a_gpu_per_local_rank_else_gloo(monkeypatch):
    """Checked without a GPU: CUDA is reported present with two devices."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for local, backend in (("2", "nccl"), ("4", "gloo")):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        cfg = TrainConfig.load(CONFIG, [f"pp={local}"], world_size=int(local))
        assert cfg.compute.backend == backend, (local, cfg.backend_choice)
        assert cfg.compute.device_type == ("cuda" if backend == "nccl" else "cpu")
    assert cfg.backend_choice == "auto: 2 GPU(s) for 4 ranks on this node"
    cpu = TrainConfig.load(CONFIG, ["pp=2", "device=cpu"], world_size=2)
    assert (cpu.compute.backend, cpu.backend_choice) == ("gloo", "auto: compute.device = cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    none = TrainConfig.load(CONFIG, ["pp=2"], world_size=2)
    assert (none.compute.backend, none.backend_choice) == ("gloo", "auto: no CUDA")
    assert none.as_toml()["compute"]["backend"] == "gloo"  # --dry-run shows what was chosen


def test_the_launcher_refuses_a_bad_config_before_starting_ranks():
    """`rrfp train --nproc-per-node N` checks the config for the world it would start, in one
    process: a typo is one line and exit 2, with none of torchrun's failure summary (which only
    ranks that failed under its agent produce). In this process: starting the ranks, which
    runs torchrun's agent, fails the test instead."""
    started = AssertionError("the launcher started the ranks")
    with mock.patch("rrfp.app.cli.train_command.start_ranks", side_effect=started):
        res = rrfp("--config", CONFIG, "--nproc-per-node", "2", "--set", "schedule.hnt=bfw")
        assert_usage_error(res, "unknown key schedule.hnt", "did you mean hint?")
        assert "ChildFailedError" not in res.stderr and res.stdout == "", res.stdout
        # the layout is checked against the world the launcher would start, not one it implies
        res = rrfp("--config", CONFIG, "--nproc-per-node", "3", "--set", "parallel.pp=2")
        assert_usage_error(res, "does not match world size 3")


def test_the_launcher_is_refused_under_torchrun():
    assert_usage_error(
        rrfp("--config", CONFIG, "--nproc-per-node", "2", world=2),
        "--nproc-per-node starts the ranks itself",
    )


def test_the_launcher_forks_its_ranks_only_without_cuda():
    """A process that asked CUDA for its devices cannot fork one that uses CUDA: with CUDA the
    ranks are fresh interpreters."""
    from rrfp.app.job.launcher import can_fork

    for cuda in (True, False):
        with mock.patch("torch.cuda.is_available", return_value=cuda):
            assert can_fork() is not cuda


def test_the_launcher_hands_torchrun_the_same_train_command():
    from argparse import Namespace

    from rrfp.app.job import forked_rank
    from rrfp.app.job.launcher import agent_args

    args = Namespace(
        nproc_per_node=4, config="c.toml", set=["a=1", "b=2"], resume=True, debug=False
    )
    train = ["train", "--config", "c.toml", "--set", "a=1", "--set", "b=2", "--resume"]
    assert agent_args(args, fork=True) == [
        "--standalone", "--nproc-per-node", "4", "--start-method", "fork",
        "--run-path", forked_rank.__file__, "rrfp", *train,
    ]  # fmt: skip
    assert agent_args(args, fork=False) == [
        "--standalone", "--nproc-per-node", "4", "-m", "rrfp", *train,
    ]  # fmt: skip
