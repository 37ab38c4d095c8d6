"""Input that cannot run is refused before any process group exists, in one
line with exit code 2: data longer than the model's context, a fixed class-hint
order that holds more than the budget, a fault spec that names nothing, and a
config loader that never fails with anything but a one-line ConfigError."""

from __future__ import annotations

import math

import pytest
from harness.cli_run import CONFIG, assert_usage_error, config_error, rrfp, sets_args
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rrfp.app.config.train_config import ConfigError, TrainConfig
from rrfp.app.errors import UsageError
from rrfp.app.faults import Fault
from rrfp.core.errors import InjectedFault
from rrfp.core.hints import peak_in_flight, resolve
from rrfp.core.tasks import Task

VLM = "configs/vlm-tiny.toml"

REFUSED = [
    (
        ["data.max_seq_len=200"],
        ["data.max_seq_len=200 is above model.block_size=128", "model's context"],
    ),
    (["model.vocab_size=100"], ["model.vocab_size=100 is below the data's 256 byte tokens"]),
    (["pp=8"], ["pp=8", "does not match world size 4"]),
    (["model.n_layer=2"], ["model.n_layer=2 is fewer than the 4 pipeline stages"]),
    (
        ["dispatch=fixed", "budget=1x"],
        [
            "schedule.dispatch = fixed with hint bfw",
            "built for a 2x budget",
            "stage 0 holds up to 8 microbatches",
            "schedule.budget = 1x (4 there)",
        ],
    ),
    (["dispatch=fixed", "hint=bf", "budget=64MiB"], ["hint bf", "a byte budget"]),
    (["fault=kill:step=3:stage=7"], ["debug.fault kill:step=3:stage=7", "no such stage or rank"]),
    (["fault=kill:step=3:stage=1:task=W2", "hint=1f1b"], ["no task W2", "split = False"]),
    (["fault=explode:step=1:stage=0"], ["debug.fault", "kind must be one of kill, stop"]),
    (["on_nonfinite=ignore"], ["optim.on_nonfinite must be one of stop, skip, got 'ignore'"]),
]


@pytest.mark.parametrize("sets,needles", REFUSED, ids=[" ".join(s) for s, _ in REFUSED])
def test_refused_with_one_line(sets, needles):
    config_error(sets, *needles, world=4)


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets,needles", [REFUSED[0], REFUSED[4]], ids=["context", "fixed-budget"])
def test_refused_before_any_process_group(sets, needles):
    """Through the CLI, without --dry-run: exit 2, and a rendezvous nobody serves is not joined."""
    assert_usage_error(rrfp("--config", CONFIG, *sets_args(sets), world=4), *needles)


def test_vlm_context_is_checked_too():
    with pytest.raises(ConfigError, match="model.block_size=100 is below the longest sequence"):
        TrainConfig.load(VLM, ["model.block_size=100"], world_size=2)


def test_fixed_class_hint_within_its_budget_is_accepted():
    for sets in (
        ["dispatch=fixed"],
        ["dispatch=fixed", "budget=3x"],
        ["dispatch=fixed", "hint=1f1b", "budget=1"],
        ["dispatch=ready", "budget=1"],
        ["dispatch=fixed", "hint=plan", "budget=1x", "unit_ms=1"],
    ):
        TrainConfig.load(CONFIG, sets, world_size=4)


def test_fixed_class_hint_with_virtual_stages_is_checked_on_the_rank_order():
    """With two stages per rank the check reads the rank's order over its local stages against
    Budget.rank_limit. It once read the one-stage-per-rank orders, and refused pp 4, M 4, v, fixed
    bfw at 1x, whose rank orders hold 8 local-stage microbatches, exactly the limit."""
    v = ["model.n_layer=8", "virtual=2", "placement=v", "dispatch=fixed"]
    TrainConfig.load(CONFIG, v + ["n_microbatches=4", "budget=1x"], world_size=4)
    TrainConfig.load(
        CONFIG, v + ["budget=2x"], world_size=4
    )  # M = 8: up to 16 local-stage microbatches held, 16 allowed
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(CONFIG, v + ["budget=1x"], world_size=4)
    line = str(info.value)
    assert (
        "\n" not in line
        and "pipeline rank 0 (stages 0, 7) holds up to 13 local-stage microbatches "
        "(1/2 of a microbatch each), above schedule.budget = 1x (8 there)"
        in line
    ), line


# a hint with no order on some rank of the layout: found by the config, not by the ranks once their
# groups exist
HINT_LAYOUT = [
    (
        ["steps=2", "hint=zbv", "schedule.dispatch=fixed"],
        [
            "schedule.hint = zbv does not fit 4 pipeline rank(s), parallel.virtual = 1",
            "it needs virtual = 2 and placement v",
        ],
    ),
    (
        ["hint=zbv"],
        ["schedule.hint = zbv", "it needs virtual = 2 and placement v"],
    ),  # ready dispatch builds it too
    (
        ["virtual=2", "model.n_layer=8", "hint=zbh1", "schedule.dispatch=fixed"],
        [
            "schedule.hint = zbh1",
            "parallel.virtual = 2, parallel.placement = interleaved",
            "has no order over virtual stages",
        ],
    ),
    (
        ["virtual=2", "model.n_layer=8", "hint=1f1b", "n_microbatches=9"],
        ["schedule.hint = 1f1b", "schedule.n_microbatches = 9", "a multiple"],
    ),
    (
        ["hint=os:getcwd"],
        ["schedule.hint = os:getcwd", "rank 0: TypeError"],
    ),  # a user function that cannot order
]


@pytest.mark.parametrize("sets,needles", HINT_LAYOUT, ids=[" ".join(s) for s, _ in HINT_LAYOUT])
def test_hint_that_does_not_fit_the_layout_is_refused(sets, needles):
    config_error(sets, *needles, world=4)


def _csv_of_stage_0(tmp_path):
    """A CSV order for stage 0 alone (GPipe, whole backward, 8 microbatches): none for 1-3."""
    path = tmp_path / "stage0.csv"
    path.write_text(
        "stage,task\n"
        + "".join(f"0,F{m}\n" for m in range(8))
        + "".join(f"0,B{m}\n" for m in range(8))
    )
    return path


def test_csv_hint_without_rows_for_a_later_stage_is_refused(tmp_path):
    """Rank 0's order is complete: only a check over every rank finds stage 1's missing rows."""
    path = _csv_of_stage_0(tmp_path)
    TrainConfig.load(
        CONFIG, [f"hint={path}", "pp=1", "model.n_layer=1"], world_size=1
    )  # one stage: it fits
    config_error(
        [f"hint={path}"], "schedule.hint = csv:stage0.csv", "no rows for stage 1 of 4", world=4
    )


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_hint_that_does_not_fit_exits_2_before_any_process_group(tmp_path):
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", f"hint={_csv_of_stage_0(tmp_path)}", world=4),
        "schedule.hint = csv:stage0.csv",
        "no rows for stage 1 of 4",
    )


def _end_file_error(sets: list[str], *needles: str) -> str:
    from rrfp.app.job.run_outputs import check_end_files

    with pytest.raises(ConfigError) as info:
        check_end_files(TrainConfig.load(CONFIG, sets, world_size=4).output)
    line = str(info.value)
    assert "\n" not in line and all(n in line for n in needles), line
    return line


def test_trace_and_sizes_that_cannot_be_written_are_refused_at_the_start(tmp_path):
    """output.trace and output.sizes are written when the run ends: a folder that cannot hold them
    is found before it starts, as checkpoint.dir's is."""
    from rrfp.app.job.run_outputs import check_end_files

    (tmp_path / "a-file").write_text("")
    _end_file_error(
        ["trace=/proc/trace.json"],
        "output.trace = /proc/trace.json cannot be written",
        "cannot create a file in /proc",
    )
    _end_file_error(
        [f"sizes={tmp_path}/a-file/sizes.json"], "output.sizes", "a-file is a file, not a folder"
    )
    _end_file_error([f"trace={tmp_path}/a-file/deeper/t.json"], "output.trace", "Not a directory")
    _end_file_error([f"trace={tmp_path}"], "output.trace", "is a folder")
    check_end_files(
        TrainConfig.load(
            CONFIG, [f"trace={tmp_path}/new/t.json", f"sizes={tmp_path}/s.json"], world_size=4
        ).output
    )
    assert (tmp_path / "new").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [
        "a-file",
        "new",
    ]


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_unwritable_trace_exits_2_before_any_process_group():
    assert_usage_error(
        rrfp("--config", CONFIG, "--set", "trace=/proc/trace.json", world=4),
        "output.trace = /proc/trace.json cannot be written",
    )


def test_peak_in_flight_of_schedules():
    one_f_one_b, gpipe = resolve("1f1b"), resolve("gpipe")
    assert [peak_in_flight(one_f_one_b.order(4, s, 8, False), False) for s in range(4)] == [
        4,
        3,
        2,
        1,
    ]
    assert peak_in_flight(gpipe.order(4, 0, 8, True), True) == 8
    # with a split backward a microbatch is held until its W
    assert peak_in_flight([Task.parse(t) for t in "F0 B0 F1 W0 B1 W1".split()], True) == 2
    assert peak_in_flight([Task.parse(t) for t in "F0 B0 F1 W0 B1 W1".split()], False) == 1


def test_fault_spec_round_trip_and_errors():
    f = Fault.parse("kill:step=3:stage=1:task=B2")
    assert (f.kind, f.step, f.stage, f.rank, f.task) == ("kill", 3, 1, None, Task.parse("B2"))
    assert str(f) == "kill:step=3:stage=1:task=B2" and Fault.parse(str(f)) == f
    assert f.hits(rank=5, stage=1) and not f.hits(rank=5, stage=0)
    assert Fault.parse("stop:step=1:rank=2").hits(rank=2, stage=0)
    for bad, match in [
        ("kill:stage=1", "step=N is required"),
        ("kill:step=1", "stage=S or rank=R"),
        ("kill:step=0:stage=1", "out of range"),
        ("kill:step=x:stage=1", "must be an integer"),
        ("kill:step=1:stage=1:step=2", "once each"),
        ("nan:step=1:stage=0:task=F0", "no task"),
        ("kill:step=1:stage=0:task=X9", "not a task"),
        ("slow:step=1:stage=0:task=F0", "slow takes task=T or during=P, and seconds=X"),
        ("slow:step=1:stage=0:seconds=5", "slow takes task=T or during=P, and seconds=X"),
        ("slow:step=1:stage=0:task=F0:during=save:seconds=5", "slow takes task=T or during=P"),
        ("stop:step=1:stage=0:during=load", "during must be one of startup, sync, save, commit"),
        ("stop:step=1:stage=0:during=startup", "happens once per run: it takes no step"),
        ("kill:rank=0:during=barrier:seconds=1", "other kinds take no seconds"),
        ("term:stage=0", "step=N is required"),
        ("kill:step=1:stage=0:seconds=5", "other kinds take no seconds"),
        ("slow:step=1:stage=0:task=F0:seconds=999999999", "out of range"),
    ]:
        with pytest.raises(ValueError, match=match):
            Fault.parse(bad)


def test_slow_fault_holds_one_task_of_one_step():
    """The slow task's extra lane time: only its task, only in its step, only where it hits."""
    from rrfp.app.faults import FaultInjector

    f = Fault.parse("slow:step=2:stage=1:task=W1:seconds=60")
    assert str(f) == "slow:step=2:stage=1:task=W1:seconds=60" and Fault.parse(str(f)) == f
    inj = FaultInjector.for_rank(f, rank=1, stage=1)
    assert FaultInjector.for_rank(f, rank=0, stage=0) is None
    inj.begin_step(0)
    assert inj.hold_s(Task.parse("W1")) == 0.0
    inj.begin_step(1)
    assert inj.hold_s(Task.parse("W1")) == 60.0 and inj.hold_s(Task.parse("W0")) == 0.0
    inj.task_done(Task.parse("W1"))  # it fires nothing else (no kill, no raise)


def test_a_fault_during_the_commit_fires_there_only():
    """during=commit fires as the rank enters its step's checkpoint commit, not in its write."""
    from rrfp.app.faults import FaultInjector

    f = Fault.parse("raise:step=2:rank=0:during=commit")
    assert str(f) == "raise:step=2:rank=0:during=commit" and Fault.parse(str(f)) == f
    inj = FaultInjector.for_rank(f, rank=0, stage=0)
    inj.begin_step(1)  # step 2 runs, then its checkpoint is saved
    inj.checkpoint_write(2, "save")
    inj.checkpoint_write(1, "commit")
    with pytest.raises(InjectedFault, match="step 2 during the checkpoint commit"):
        inj.checkpoint_write(2, "commit")
    slow = Fault.parse("slow:step=1:rank=1:during=save:seconds=0.01")
    assert Fault.parse(str(slow)) == slow
    FaultInjector.for_rank(slow, rank=1, stage=1).checkpoint_write(
        1, "save"
    )  # sleeps, raises nothing


def test_each_phase_fires_in_its_own_place_only():
    """A fault of each phase fires as its rank enters that phase (of its step, or of the run for
    start-up and the final barrier), and nowhere else; a stop with seconds is continued."""
    from rrfp.app.faults import PHASES, FaultInjector

    for phase in PHASES:
        once = phase in ("startup", "barrier")
        f = Fault.parse(f"raise:rank=1:during={phase}" + ("" if once else ":step=2"))
        assert Fault.parse(str(f)) == f, str(f)
        inj = FaultInjector.for_rank(f, rank=1, stage=1)
        for other in PHASES:
            if other != phase:
                inj.phase(other, 0 if once else 2)  # another phase: nothing
        if not once:
            inj.phase(phase, 1)  # its phase of another step: nothing
        with pytest.raises(InjectedFault, match="injected fault"):
            inj.phase(phase, 0 if once else 2)
    with pytest.raises(ValueError, match="no phase"):
        inj.phase("load", 2)
    paused = Fault.parse("stop:step=3:rank=0:during=sync:seconds=1.5")
    assert (paused.seconds, str(paused)) == (1.5, "stop:step=3:rank=0:seconds=1.5:during=sync")
    assert Fault.parse("term:rank=0:during=startup").step == 0


def test_rrfp_fault_environment_variable(monkeypatch):
    monkeypatch.setenv("RRFP_FAULT", "stop:step=2:stage=3")
    assert str(TrainConfig.load(CONFIG, [], world_size=4).debug.fault) == "stop:step=2:stage=3"
    monkeypatch.setenv("RRFP_FAULT", "stop:step=2")
    with pytest.raises(ConfigError, match="RRFP_FAULT"):
        TrainConfig.load(CONFIG, [], world_size=4)


# -- fuzz: the TOML file and --set overrides ------------------------------------------

_KEYS = [
    "pp",
    "tp",
    "dp",
    "n_microbatches",
    "steps",
    "dispatch",
    "executor",
    "hint",
    "budget",
    "split",
    "lr",
    "seed",
    "preset",
    "unit_ms",
    "timeout_s",
    "backend",
    "device",
    "threads",
    "log_every",
    "model",
    "on_nonfinite",
    "fault",
    "cost",
    "weight_decay",
    "model.n_layer",
    "model.n_embd",
    "model.block_size",
    "model.n_head",
    "data.max_seq_len",
    "data.min_seq_len",
    "data.microbatch_size",
    "run.nope",
    "nope.x",
    "model.x",
]
_WORDS = [
    "fixed",
    "ready",
    "bfw",
    "bf",
    "1f1b",
    "plan",
    "2x",
    "0x",
    "1x",
    "64MiB",
    "lang",
    "none",
    "gpt",
    "vlm",
    "kill:step=1:stage=0",
    "nan:step=2",
    "nope:x",
    "os:getcwd",
    "",
    "gloo",
    "nccl",
    "cuda",
    "stop",
    "skip",
]
# values as TOML writes them: most documents parse, so the checks behind the parser get exercised
_LITERAL = st.one_of(
    st.integers(-3, 300).map(str),
    st.sampled_from(
        [
            "0.5",
            "1e-3",
            "-2.0",
            "nan",
            "inf",
            "-inf",
            "1e400",
            "true",
            "false",
            "[1, 2]",
            "{a = 1}",
            "[]",
        ]
    ),
    st.sampled_from(_WORDS).map(lambda w: f'"{w}"'),
)
_VALUES = st.one_of(
    _LITERAL, st.sampled_from(_WORDS), st.text(max_size=8)
)  # --set also takes bare words
_OVERRIDES = st.lists(
    st.one_of(st.tuples(st.sampled_from(_KEYS), _VALUES).map("=".join), st.text(max_size=10)),
    max_size=4,
)
_TABLE = st.dictionaries(
    st.sampled_from(sorted({k.rpartition(".")[2] for k in _KEYS})), _LITERAL, max_size=5
)


def _render(tables: dict, trailer: str) -> list[str]:
    return [
        line
        for name, table in tables.items()
        for line in [f"[{name}]", *(f"{k} = {v}" for k, v in table.items())]
    ] + [trailer]


_TOML_LINES = st.builds(
    _render,
    st.dictionaries(st.sampled_from(["run", "model", "data", "other"]), _TABLE, max_size=3),
    st.sampled_from(["", "", "", "", "", "[run", "x = ", "\x00", "[[run]]\nx = 1", "y = 1"]),
)


@pytest.mark.timeout(120)
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=_TOML_LINES, overrides=_OVERRIDES, world=st.sampled_from([1, 2, 4]))
@example(lines=[], overrides=["cost=5"], world=4)  # once an AttributeError
@example(lines=["[run]", "lr = nan"], overrides=[], world=4)  # once accepted
@example(
    lines=[], overrides=["timeout_s=inf"], world=4
)  # once accepted, to fail in timedelta later
@example(lines=["[model]", "block_size = 8"], overrides=["model=vlm"], world=2)
@example(lines=["[[run]]", "x = 1"], overrides=["steps=2"], world=4)  # once an AttributeError
@example(lines=["[run]", "model = [1, 2]"], overrides=["steps=2"], world=4)  # once a TypeError
@example(lines=[], overrides=["0\n0=1"], world=4)  # once a two-line error
def test_config_loader_raises_only_config_errors(tmp_path, lines, overrides, world):
    path = tmp_path / "fuzz.toml"
    path.write_text("\n".join(lines), errors="surrogateescape")
    try:
        TrainConfig.load(path, overrides, world_size=world)
    except UsageError as e:  # ConfigError included
        text = str(e)
        assert text and "\n" not in text.strip() and "Traceback" not in text, repr(text)
    else:
        cfg = TrainConfig.load(path, overrides, world_size=world)
        values = (cfg.optim.lr, cfg.emulation.unit_ms, cfg.run.timeout_s, cfg.optim.weight_decay)
        assert all(math.isfinite(v) for v in values)
