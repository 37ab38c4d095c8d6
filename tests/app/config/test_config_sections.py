"""The config in sections: a dry run's resolved config reads back as the same config; every key has
its doc line and docs/configuration.md is the reference the dataclasses give; the waits derive from
one timeout_s and each can be set apart; an embedder's ScheduleSettings runs what the old keywords
ran."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process
from harness.distributed import run_ranks
from harness.launch import rank_vars

from rrfp.app.config.fields import toml_text
from rrfp.app.config.reference import reference_markdown, reference_text
from rrfp.app.config.sections import SECTIONS, TimeoutsSection
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.train.step_statistics import PER_RANK, StepStatistics
from rrfp.pipeline.timeouts import Timeouts


def _load(path, sets=()):
    return TrainConfig.load(path, list(sets), world_size=4)


def rrfp(*args, world=None, rank=0):
    """``rrfp ARGS`` in this process (tests/harness/cli_run.py); with ``world``, as a torchrun-like
    rank whose rendezvous nobody serves."""
    return rrfp_in_process(*args, env=rank_vars(rank, world, port=9) if world is not None else {})


def test_rrfp_train_dry_run_prints_a_config_that_reads_back():
    config = "configs/gpt-tiny.toml"
    res = rrfp("train", "--config", config, "--dry-run", world=4)
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    other = rrfp("train", "--config", config, "--dry-run", world=4, rank=1)
    assert (other.returncode, other.stderr) == (0, "")
    # the resolved config it prints reads back as the same config
    doc = tomllib.loads(res.stdout[res.stdout.index("# the resolved config") :])
    assert TrainConfig.from_dict(doc, world_size=4) == TrainConfig.load(ROOT / config, world_size=4)
    assert "memory: pipeline rank 3 (stage 3): at least" in res.stdout


def test_every_key_has_its_doc_line():
    for kind in SECTIONS:
        assert kind.DOC, kind.NAME
        for name, f in kind.keys().items():
            doc = f.metadata.get("doc", "")
            assert doc and "\n" not in doc, f"{kind.NAME}.{name} has no doc line"


def test_the_configuration_page_is_the_generated_reference():
    page = (ROOT / "docs/configuration.md").read_text()
    assert page == reference_markdown(), (
        "regenerate: rrfp config --markdown > docs/configuration.md"
    )
    for kind in SECTIONS:
        for name in kind.keys():
            assert f"| `{name}` |" in page


def test_the_reference_on_the_command_line():
    res = rrfp("config")
    assert res.returncode == 0 and res.stdout == reference_text()
    assert "  peer_wait_s (float, default 0.0)" in res.stdout
    # --help-config answers alone, as --help does: no --config needed
    helped = rrfp("train", "--help-config")
    assert (helped.returncode, helped.stdout) == (0, reference_text())


def test_the_waits_derive_from_timeout_s_and_each_is_set_apart():
    cfg = _load(ROOT / "configs/gpt-tiny.toml", ["timeout_s=20"])
    assert cfg.waits == Timeouts(20, 20, 20, 70, 20, 20, 20, 200, 400)
    cfg = _load(
        ROOT / "configs/gpt-tiny.toml", ["timeout_s=20", "timeouts.heartbeat_s=5", "peer_wait_s=90"]
    )
    assert (cfg.waits.heartbeat_s, cfg.waits.peer_wait_s, cfg.waits.store_connect_s) == (5, 90, 20)
    assert cfg.waits.key("heartbeat_s") == "timeouts.heartbeat_s"
    assert cfg.waits.key("store_connect_s") == "run.timeout_s"
    assert TimeoutsSection().resolve(60).nccl_watchdog_s == 150
    with pytest.raises(ConfigError, match=r"timeouts.peer_wait_s = -1 is out of bounds"):
        TrainConfig.load(ROOT / "configs/gpt-tiny.toml", ["timeouts.peer_wait_s=-1"])


@pytest.mark.parametrize(
    "sets,split",
    [
        ([], True),
        (["hint=1f1b"], False),
        (["hint=zbh1"], True),
        (["hint=bfw", "split=false"], False),
    ],
)
def test_the_schedule_says_whether_b_and_w_run_apart(sets, split):
    """``split`` where set, else the hint's default: what the executor's settings resolve to."""
    cfg = _load(ROOT / "configs/gpt-tiny.toml", sets)
    assert cfg.schedule.split_backward is split
    assert cfg.schedule_settings().split is split


DID_YOU_MEAN = [
    (["hint=bfx"], "(did you mean bf?)"),
    (
        ["schedle.hint=bfw"],
        "--set schedle.hint: unknown section [schedle] (did you mean schedule?)",
    ),
    (["microbatchs=4"], "--set microbatchs: no section has a key 'microbatchs' (did you mean"),
    (["dispach=fixed"], "(did you mean dispatch?)"),
    (["optim.lrr=1"], "--set optim.lrr: unknown key optim.lrr (did you mean lr?)"),
    (["steps=x"], "--set steps (run.steps) = 'x' has the wrong type"),
]


@pytest.mark.parametrize("sets,needle", DID_YOU_MEAN, ids=[s[0] for s, _ in DID_YOU_MEAN])
def test_a_typo_is_blamed_on_set_with_a_guess(sets, needle):
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(ROOT / "configs/gpt-tiny.toml", sets, world_size=4)
    assert needle in str(info.value)
    assert "configs/gpt-tiny.toml" not in str(info.value)


def test_a_typo_in_the_file_names_the_file(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("[optim]\nlrr = 1\n[sheduel]\n")
    with pytest.raises(
        ConfigError, match=r"unknown section \[sheduel\] \(did you mean schedule\?\)"
    ):
        TrainConfig.load(path, world_size=4)
    path.write_text("[optim]\nlrr = 1\n")
    with pytest.raises(ConfigError, match=rf"{path}: unknown key optim.lrr \(did you mean lr\?\)"):
        TrainConfig.load(path, world_size=4)


def test_an_unknown_section_is_guessed_from_the_keys_written_under_it(tmp_path):
    """A section's keys say which section was meant better than its spelling does: ``[machine]``
    holding ``device`` and ``threads`` is [compute], which no spelling guess would find."""
    path = tmp_path / "moved.toml"
    path.write_text('[machine]\ndevice = "cpu"\nthreads = 2\n')
    with pytest.raises(
        ConfigError, match=r"unknown section \[machine\] \(did you mean compute\?\)"
    ):
        TrainConfig.load(path, world_size=4)
    with pytest.raises(ConfigError, match=r"\[machine\] \(did you mean compute\?\)"):
        TrainConfig.load(ROOT / "configs/gpt-tiny.toml", ["machine.threads=2"], world_size=4)
    path.write_text("[machine]\nthreads = 2\nlr = 1\n")  # keys of two sections: no guess
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path, world_size=4)
    assert "did you mean compute" not in str(info.value)


def test_without_torchrun_the_config_is_checked_first():
    bad = rrfp("train", "--config", "configs/gpt-tiny.toml", "--set", "schedule.hint=bfx")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "unknown hint 'bfx'" in bad.stderr and "torchrun" not in bad.stderr
    good = rrfp("train", "--config", "configs/gpt-tiny.toml")
    assert good.returncode == 2 and "torchrun" in good.stderr and good.stderr.count("\n") == 1


def test_step_statistics_travel_as_one_tensor_by_name():
    stats = StepStatistics(loss=2.5, busy=1.0, wall=3.0, tokens=64, stops=1, grad_sq=0.25)
    t = stats.to_tensor()
    assert t.dtype.is_floating_point and t.numel() == len(dataclasses.fields(StepStatistics)) - len(
        PER_RANK
    )
    want = StepStatistics(5.0, 2.0, 6.0, 128, 0, 2, 0, grad_sq=0.5)
    assert StepStatistics.from_tensor(t + t) == want
    with pytest.raises(ValueError):
        StepStatistics.from_tensor(t[:3])


def test_step_statistics_carry_each_ranks_memory_and_in_flight_in_its_own_slot():
    """Summed over the ranks (the step's all-reduce), every rank's peak stays its own."""
    ranks = [
        StepStatistics.of_rank(r, 3, memory=100.0 * (r + 1), in_flight=r + 2) for r in range(3)
    ]
    total = sum(s.to_tensor() for s in ranks)
    got = StepStatistics.from_tensor(total, 3)
    assert got.memory == [100.0, 200.0, 300.0] and got.in_flight == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="3 ranks"):
        StepStatistics.from_tensor(total[:-1], 3)


def test_toml_text_reads_back():
    doc = {"a": {"s": 'q"uote\\', "n": 3, "f": 0.1, "b": False, "l": [1, 2]}, "e": {}}
    assert tomllib.loads(toml_text(doc)) == doc


def _settings_and_waits(rank, world):
    """A runtime started with its waits set apart, and executors from settings and from keywords."""
    import torch

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    waits = Timeouts.derive(30, heartbeat_s=7, peer_wait_s=11, process_group_s=40)

    async def main():
        async with PipelineRuntime.start(
            pp=world, timeouts=waits, heartbeat=True, timeout_s=30
        ) as rt:
            module = torch.nn.Linear(4, 4)
            settings = ScheduleSettings.of(4, hint="1f1b", budget="1x", dispatch="fixed")
            a = rt.stage_executor(module, torch.nn.functional.mse_loss, settings)
            b = rt.stage_executor(
                module,
                torch.nn.functional.mse_loss,
                n_microbatches=4,
                hint="1f1b",
                budget="1x",
                dispatch="fixed",
            )
            return (
                a.settings == b.settings,
                a.timeouts.peer_wait_s,
                rt.heartbeat.timeout_s,
                rt.timeouts == waits,
            )

    return run(main())


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_the_runtime_routes_each_wait_and_takes_one_settings_object():
    for same, peer_wait, heartbeat, kept in run_ranks(_settings_and_waits, 2, timeout=90).values():
        assert same and kept
        assert (peer_wait, heartbeat) == (11, 7)


@pytest.mark.parametrize(
    "text,sets,needle",
    [
        ("[run]\npp = 2\n", [], "{path}: unknown key run.pp: pp is a key of [parallel] (write "),
        ("[schedule]\nlr = 0.1\n", [], "{path}: unknown key schedule.lr: lr is a key of [optim]"),
        (
            "",
            ["run.dir=x"],
            "--set run.dir: unknown key run.dir: dir is a key of [checkpoint], [output] (write "
            "checkpoint.dir or output.dir)",
        ),
    ],
)
def test_a_key_in_the_wrong_section_names_its_section(tmp_path, text, sets, needle):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(path, sets, world_size=4)
    assert needle.format(path=path) in str(info.value), str(info.value)
