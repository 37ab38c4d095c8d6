"""Each schedule setting's default and the timeout's are declared once (``DEFAULT_BUDGET``,
``DEFAULT_HINT``, ``DEFAULT_DISPATCH``, ``DEFAULT_TIMEOUT_S``), and every entry that defaults one
(the config, the simulator, the runtime, the drop-in schedule) gets the declared value.
tests/house/test_stats.py checks that no literal of the value stands in for it in rrfp/."""

import dataclasses
import inspect

import pytest

from rrfp.app.config.sections import RunSection, ScheduleSection
from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.hints import DEFAULT_HINT
from rrfp.core.policy import DEFAULT_DISPATCH
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.schedule_settings import ScheduleSettings
from rrfp.pipeline.timeouts import DEFAULT_TIMEOUT_S
from rrfp.pipelining.schedule import ScheduleReady
from rrfp.sim.engine import SimConfig


def default_of(fn, name):
    return inspect.signature(fn).parameters[name].default


def field_default(cls, name):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize(
    "where, value",
    [
        ("SimConfig.hint", field_default(SimConfig, "hint")),
        ("SimConfig.budget", field_default(SimConfig, "budget")),
        ("SimConfig.dispatch", field_default(SimConfig, "dispatch")),
        ("ScheduleSettings.hint", field_default(ScheduleSettings, "hint").name),
        ("ScheduleSettings.budget", field_default(ScheduleSettings, "budget")),
        ("ScheduleSettings.dispatch", field_default(ScheduleSettings, "dispatch")),
        ("ScheduleSettings.of hint", default_of(ScheduleSettings.of, "hint")),
        ("ScheduleSettings.of budget", default_of(ScheduleSettings.of, "budget")),
        ("ScheduleSettings.of dispatch", default_of(ScheduleSettings.of, "dispatch")),
        ("[schedule] hint", ScheduleSection().hint.name),
        ("[schedule] budget", ScheduleSection().budget),
        ("[schedule] dispatch", ScheduleSection().dispatch),
        ("stage_executor hint", default_of(PipelineRuntime.stage_executor, "hint")),
        ("stage_executor budget", default_of(PipelineRuntime.stage_executor, "budget")),
        ("stage_executor dispatch", default_of(PipelineRuntime.stage_executor, "dispatch")),
        ("ScheduleReady hint", default_of(ScheduleReady.__init__, "hint")),
        ("ScheduleReady budget", default_of(ScheduleReady.__init__, "budget")),
        ("ScheduleReady dispatch", default_of(ScheduleReady.__init__, "dispatch")),
        ("[run] timeout_s", RunSection().timeout_s),
        ("PipelineRuntime.start timeout_s", default_of(PipelineRuntime.start, "timeout_s")),
        ("ScheduleReady timeout_s", default_of(ScheduleReady.__init__, "timeout_s")),
    ],
)
def test_every_entry_defaults_to_the_declaration(where, value):
    declared = {
        "hint": DEFAULT_HINT,
        "budget": Budget.parse(DEFAULT_BUDGET),
        "dispatch": DEFAULT_DISPATCH,
        "timeout_s": DEFAULT_TIMEOUT_S,
    }[next(k for k in ("hint", "budget", "dispatch", "timeout_s") if k in where)]
    got = Budget.parse(value) if isinstance(declared, Budget) else value
    assert got == declared, f"{where} defaults to {value!r}, not {declared!r}"
