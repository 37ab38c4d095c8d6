"""Run configuration: a TOML file in sections ([run], [parallel], [schedule], [optim],
[compute], [checkpoint], [output], [eval], [emulation], [timeouts], [debug],
rrfp/app/config/sections.py)
plus the workload's own [model] and [data], and ``--set key=value`` overrides.

Parsed once: a TrainConfig holds resolved objects (the Hint, the Budget, the Dispatch mode, the
Layout, the Workload), and everything below the app takes those objects.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rrfp.app.config.fields import Section, did_you_mean, unknown_key
from rrfp.app.config.registry import find_workload
from rrfp.app.config.sections import (
    SECTIONS,
    CheckpointSection,
    ComputeSection,
    DebugSection,
    EmulationSection,
    EvalSection,
    OptimSection,
    OutputSection,
    ParallelSection,
    RunSection,
    ScheduleSection,
    TimeoutsSection,
)
from rrfp.app.config.workload_fields import as_toml as workload_toml
from rrfp.app.config.workload_fields import check_value, workload_keys
from rrfp.app.errors import ConfigError
from rrfp.core.hints import NOMINAL_BUDGET, SPLIT_BY_DEFAULT, HintError
from rrfp.core.layout import Layout, layout_for
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.pipeline.schedule_settings import AUTO_UNSPLIT, ScheduleSettings, unsplit_stages_of
from rrfp.pipeline.timeouts import Timeouts
from rrfp.pipeline.user_code import calling, function_name
from rrfp.pipeline.workload import Workload
from rrfp.sim.unsplit_choice import RunSchedule, UnsplitChoice, choose_unsplit_stages

SECTION_INT_BOUND = 2**31 - 1  # any integer of a workload's [model] or [data] section, in magnitude
WORKLOAD_SECTIONS = ("model", "data")
_OVERRIDE_KEY = re.compile(r"[A-Za-z_][\w.]*")  # --set KEY: a name, or SECTION.NAME
BY_NAME: dict[str, type[Section]] = {s.NAME: s for s in SECTIONS}


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class TrainConfig:
    """A whole run. ``world_size`` defaults to torchrun's WORLD_SIZE (1 outside
    torchrun); the layout and the model checks are done here, before any
    process group exists, so bad input fails on every rank at once."""

    run: RunSection = field(default_factory=RunSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    optim: OptimSection = field(default_factory=OptimSection)
    compute: ComputeSection = field(default_factory=ComputeSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    output: OutputSection = field(default_factory=OutputSection)
    eval: EvalSection = field(default_factory=EvalSection)
    emulation: EmulationSection = field(default_factory=EmulationSection)
    timeouts: TimeoutsSection = field(default_factory=TimeoutsSection)
    debug: DebugSection = field(default_factory=DebugSection)
    model: Any = None  # the workload's model config; None: its defaults
    data: Any = None  # the workload's data config; None: its defaults
    world_size: int = field(default_factory=_world_size)

    def __post_init__(self) -> None:
        wl = self.workload
        if self.model is None:
            object.__setattr__(self, "model", wl.model_config())
        if self.data is None:
            object.__setattr__(self, "data", wl.data_config())
        par = self.parallel
        try:
            layout = layout_for(self.world_size, par.pp, par.tp, par.replicas, par.ep)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "_layout", layout)
        try:
            with calling(f"check ({function_name(wl.check)})"):  # a ValueError: the config's
                wl.check(self.model, self.data, self.num_stages, layout.tp)
        except ValueError as e:
            split = (
                f" (parallel.virtual = {par.virtual} stages on each of {layout.pp} pipeline ranks)"
                if par.virtual > 1
                else ""
            )
            raise ConfigError(f"{e}{split}") from None
        self._check_emulation()
        self._check_recipe()
        _check_hint_layout(self.schedule, self.virtual_layout)
        _check_fixed_budget(self.schedule, self.virtual_layout)
        self._check_fault()
        self._check_dp_shard()
        self._check_weight_split()
        self._check_unsplit_stages()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        backend, why = self.compute.chosen(local)
        object.__setattr__(self, "backend_choice", why)  # what the start-up summary says
        if backend != self.compute.backend:
            object.__setattr__(self, "compute", dataclasses.replace(self.compute, backend=backend))
        if self.compute.device_type == "cuda":
            _check_cuda(self.world_size, why)
        self._check_overlap()
        cost = self.emulation.cost
        if cost is not None and cost.num_stages != self.num_stages:
            raise ConfigError(
                f"emulation.cost was calibrated for {cost.num_stages} stages, this run has "
                f"{self.num_stages}: rerun rrfp calibrate --pp {layout.pp}"
                + (f" with parallel.virtual = {par.virtual}" if par.virtual > 1 else "")
            )

    def _check_emulation(self) -> None:
        em = self.emulation
        if self.schedule.hint.planned and em.unit_ms == 0 and em.cost is None:
            raise ConfigError(  # the preset's lengths are made up
                "schedule.hint = plan in real time (emulation.unit_ms = 0) has no task costs to "
                "plan on: run `rrfp calibrate` and give emulation.cost = FILE, or set "
                "emulation.unit_ms > 0 to emulate the preset's times"
            )

    def _check_recipe(self) -> None:
        wl = self.workload
        if self.compute.activation_checkpointing != "off" and wl.blocks is None:
            raise ConfigError(
                f"compute.activation_checkpointing = {self.compute.activation_checkpointing}: "
                f"workload {wl.name!r} does not name its blocks (Workload.blocks); set it to off"
            )

    def _check_dp_shard(self) -> None:
        """What FSDP-sharded stages do not cover yet: checkpoints and tied parameters."""
        if self.parallel.dp_shard == 1:
            return
        if self.checkpoint.dir:
            raise ConfigError(
                f"parallel.dp_shard = {self.parallel.dp_shard} with checkpoint.dir: checkpoints "
                "of FSDP-sharded stages are not supported yet"
            )
        if self.workload.tied is not None and any(
            self.workload.tied(self.model, s, self.num_stages) for s in range(self.num_stages)
        ):
            raise ConfigError(
                f"parallel.dp_shard = {self.parallel.dp_shard} with tied parameters (the model's "
                "tie_embeddings): ties of FSDP-sharded stages are not supported yet"
            )

    def _check_weight_split(self) -> None:
        """schedule.weight_split = functions queues W for linears that no tensor-parallel, FSDP or
        expert-parallel run has put through its queue: refused there."""
        if self.schedule.weight_split != "functions":  # auto resolves to autograd there
            return
        wider = self.beyond_split_functions()
        if wider:
            raise ConfigError(
                f"schedule.weight_split = {self.schedule.weight_split} with {', '.join(wider)}: "
                "not supported; use schedule.weight_split = autograd or auto"
            )

    def beyond_split_functions(self) -> list[str]:
        """The parallelisms above 1 whose layers the split-aware functions do not cover (what
        ``resolve_weight_split`` takes as ``wider``)."""
        par = self.parallel
        return [
            f"parallel.{k} = {v}"
            for k, v in (("tp", par.tp), ("dp_shard", par.dp_shard), ("ep", par.ep))
            if v > 1
        ]

    def _check_unsplit_stages(self) -> None:
        """schedule.unsplit_stages: stages of this layout, a split backward, real compute; "auto"
        chosen here when a cost model is given (``unsplit_choice``), so every rank and the
        start-up line see the same stages."""
        sch = self.schedule
        object.__setattr__(self, "_unsplit_choice", None)
        if not sch.unsplit_stages:
            return
        shown = (
            f'"{sch.unsplit_stages}"'
            if isinstance(sch.unsplit_stages, str)
            else str(list(sch.unsplit_stages))
        )
        if not sch.split_backward:
            raise ConfigError(
                f"schedule.unsplit_stages = {shown} needs a split backward "
                f"(schedule.split = true, or a hint that splits: "
                f"{', '.join(sorted(SPLIT_BY_DEFAULT))}); hint {sch.hint.name} runs every stage "
                "unsplit already"
            )
        if self.emulation.unit_ms:
            raise ConfigError(
                f"schedule.unsplit_stages with emulation.unit_ms = {self.emulation.unit_ms}: the "
                "emulation draws a split W for every stage; unsplit stages run on real compute "
                "(emulation.unit_ms = 0)"
            )
        if sch.unsplit_stages == AUTO_UNSPLIT:
            cost = self.emulation.cost
            if cost is None:
                raise ConfigError(
                    'schedule.unsplit_stages = "auto" has no costs to choose by: run `rrfp '
                    "calibrate` with this split schedule (it prices each stage split and whole) "
                    "and give emulation.cost = FILE"
                )
            if cost.num_stages == self.num_stages:  # else the stage count's check names it
                object.__setattr__(self, "_unsplit_choice", self._choose_unsplit())
            return
        try:
            unsplit_stages_of(sch.unsplit_stages, self.num_stages)
        except ValueError as e:
            raise ConfigError(f"schedule.{e}") from None

    def _choose_unsplit(self) -> UnsplitChoice:
        sch, cost = self.schedule, self.emulation.cost
        assert cost is not None
        try:
            run = RunSchedule(
                self.virtual_layout,
                sch.n_microbatches,
                sch.hint,
                sch.dispatch,
                sch.budget,
                self.emulation.variability,
            )
            return choose_unsplit_stages(cost, run)
        except ValueError as e:
            raise ConfigError(f'schedule.unsplit_stages = "auto": {e}') from None

    @property
    def unsplit_choice(self) -> UnsplitChoice | None:
        """What schedule.unsplit_stages = "auto" chose, and the makespans it chose by."""
        return getattr(self, "_unsplit_choice", None)

    @property
    def unsplit_stages(self) -> tuple[int, ...]:
        """The stages this run leaves unsplit (numbers as schedule.unsplit_stages gives them, or
        those "auto" chose)."""
        sch = self.schedule
        if sch.unsplit_stages != AUTO_UNSPLIT:
            return tuple(sch.unsplit_stages)
        assert self.unsplit_choice is not None, "chosen when the config was built"
        return self.unsplit_choice.stages

    def _check_overlap(self) -> None:
        """schedule.overlap runs a ready W beside an EP task's all-to-all: it needs ready dispatch,
        W's apart, expert parallelism and a lane with a thread beside (the CPU's)."""
        sch, par = self.schedule, self.parallel
        if not sch.overlap:
            return
        need = (
            "schedule.dispatch = ready (the W beside is picked by readiness)"
            if sch.dispatch is not Dispatch.READY
            else "a split backward (schedule.split = true): only a W runs beside"
            if not sch.split_backward
            else "parallel.ep > 1 (it overlaps expert parallelism's all-to-alls)"
            if par.ep == 1
            else "compute.device = cpu (a CUDA stream has no thread beside it)"
            if self.compute.device_type != "cpu"
            else None
        )
        if need is not None:
            raise ConfigError(f"schedule.overlap = true needs {need}")

    def _check_fault(self) -> None:
        fault, sch = self.debug.fault, self.schedule
        if fault is None:
            return
        if (
            fault.stage is not None
            and fault.stage >= self.num_stages
            or fault.rank is not None
            and fault.rank >= self.world_size
        ):
            raise ConfigError(
                f"debug.fault {fault}: no such stage or rank in {self._layout.short()}"
            )
        if fault.task is not None:
            split = sch.split_backward
            if fault.task.mb >= sch.n_microbatches or (fault.task.kind.name == "W" and not split):
                raise ConfigError(
                    f"debug.fault {fault}: no task {fault.task} with {sch.n_microbatches} "
                    f"microbatches, split = {split}"
                )

    @property
    def workload(self) -> Workload:
        return find_workload(self.run.model)

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def num_stages(self) -> int:
        """How many pieces the model is split into: pp x virtual."""
        return self._layout.pp * self.parallel.virtual

    @property
    def virtual_layout(self) -> VirtualLayout:
        """Which of the num_stages stages each pipeline rank holds."""
        return VirtualLayout(self._layout.pp, self.parallel.virtual, self.parallel.placement)

    @property
    def waits(self) -> Timeouts:
        """Every wait's bound: [timeouts]'s, each defaulting from run.timeout_s."""
        return self.timeouts.resolve(self.run.timeout_s)

    def schedule_settings(self) -> ScheduleSettings:
        """The executor's settings, built here once for stage_executor and the bench."""
        sch, em = self.schedule, self.emulation
        unsplit = self.unsplit_stages
        return ScheduleSettings.of(
            sch.n_microbatches,
            dispatch=sch.dispatch,
            hint=sch.hint,
            budget=sch.budget,
            split=sch.split,
            variability=em.variability,
            seed=self.run.seed,
            # the plan prices a stage left unsplit whole, where the model was fitted both ways
            cost=None
            if em.cost is None
            else em.cost.run_whole(unsplit_stages_of(unsplit, self.num_stages)),
            overlap=sch.overlap,
            weight_split=sch.weight_split,
            unsplit_stages=unsplit,
        )

    @classmethod
    def from_dict(
        cls, doc: dict, source: str = "config", world_size: int | None = None
    ) -> TrainConfig:
        """The config of a parsed TOML document (``source`` names it in messages)."""
        return _Loader(source).build(_copy(doc), world_size)

    @classmethod
    def load(
        cls,
        path: str | Path | None,
        overrides: list[str] = (),
        world_size: int | None = None,
        implied_world: bool = False,
    ) -> TrainConfig:
        """The config of the file at ``path`` (None: defaults) with ``--set`` ``overrides``.
        ``implied_world``: check it in the world its [parallel] implies (pp x tp x dp, pp 0
        counting 1), for a command that has no launcher to say."""
        source = str(path) if path else "defaults"
        loader = _Loader(source, path)
        doc = read_config(path) if path else {}
        loader.check_tables(doc)
        for item in overrides:
            loader.apply_override(doc, item)
        return loader.build(doc, world_size, implied_world=implied_world)

    def as_toml(self) -> dict:
        """Plain values by section, as a TOML file would give them."""
        out = {s.NAME: getattr(self, s.NAME).as_toml() for s in SECTIONS}
        out["model"] = workload_toml(self.model)
        out["data"] = workload_toml(self.data)
        return out

    as_dict = as_toml  # the name embedders called it by


def _copy(doc: dict) -> dict:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}


def read_config(path: str | Path) -> dict:
    """The TOML document at ``path``, or one ConfigError saying why it cannot be read. A UTF-8
    byte order mark first (what some Windows editors write) is not part of the TOML."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}): "
            "a TOML file is UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


class _Loader:
    """One load: the document's values, where each came from (the file or ``--set``), so that an
    error names what the user wrote."""

    def __init__(self, source: str, path: str | Path | None = None) -> None:
        self.source = source
        self.path = path  # the config file, where there is one: a relative run.model's hint
        self.origin: dict[tuple[str, str], str] = {}  # (section, key) -> how to name it

    def where(self, section: str, key: str) -> str:
        return self.origin.get((section, key), f"{self.source}: {section}.{key}")

    def check_tables(self, doc: dict) -> None:
        known = [*BY_NAME, *WORKLOAD_SECTIONS]
        for name, table in doc.items():
            if name not in known:
                keys = table if isinstance(table, dict) else {}
                raise ConfigError(
                    f"{self.source}: unknown section [{name}]{_holder(name, keys, known)} "
                    f"(expected {', '.join(known)})"
                )
            if not isinstance(table, dict):
                raise ConfigError(f"{self.source}: [{name}] must be a table (one [{name}] section)")

    def check_placed(self, kind: type[Section], values: dict) -> None:
        """A key written in a section other than the one that holds it (``[run] pp``): one line
        naming where it goes."""
        for key in values:
            if key in kind.keys():
                continue
            homes = [s.NAME for s in SECTIONS if key in s.keys()]
            if homes:
                places = " or ".join(f"{home}.{key}" for home in homes)
                raise ConfigError(
                    f"{unknown_key(self.where(kind.NAME, key), kind.NAME, key, ())}: "
                    f"{key} is a key of {', '.join(f'[{h}]' for h in homes)} (write {places})"
                )

    def apply_override(self, doc: dict, item: str) -> None:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE")
        key = key.strip()
        if not _OVERRIDE_KEY.fullmatch(key):  # a key is a name: the messages below quote it bare
            raise ConfigError(f"--set {item!r}: {key!r} is not a key (write SECTION.KEY=VALUE)")
        section, name = self._place(doc, key)
        doc.setdefault(section, {})[name] = _parse_value(raw.strip())
        full = f"{section}.{name}"
        self.origin[(section, name)] = f"--set {key}" + ("" if key == full else f" ({full})")

    def _place(self, doc: dict, key: str) -> tuple[str, str]:
        """(section, key) of a --set KEY: SECTION.NAME, or a bare NAME found in one section."""
        section, _, name = key.rpartition(".")
        known = [*BY_NAME, *WORKLOAD_SECTIONS]
        if section:
            if section not in known:
                raise ConfigError(
                    f"--set {key}: unknown section [{section}]{_holder(section, [name], known)} "
                    f"(expected {', '.join(known)})"
                )
            return section, name
        kinds = {s.NAME: s.keys() for s in SECTIONS}
        wl = _workload_of(doc, self.path)
        if wl is not None:
            kinds.update(
                model={f.name for f in dataclasses.fields(wl.model_config)},
                data={f.name for f in dataclasses.fields(wl.data_config)},
            )
        holders = [s for s, keys in kinds.items() if name in keys]
        if holders:
            return holders[0], name
        every = [k for keys in kinds.values() for k in keys]
        raise ConfigError(
            f"--set {key}: no section has a key {name!r}{did_you_mean(name, every)} "
            "(write SECTION.KEY; rrfp config lists them)"
        )

    def build(
        self,
        doc: dict,
        world_size: int | None,
        implied_world: bool = False,
    ) -> TrainConfig:
        self.check_tables(doc)
        parts: dict[str, Any] = {}
        for kind in SECTIONS:
            values = doc.get(kind.NAME, {})
            if not isinstance(values, dict):
                raise ConfigError(f"{self.source}: [{kind.NAME}] must be a table")
            self.check_placed(kind, values)
            parts[kind.NAME] = kind.parse(values, lambda k, n=kind.NAME: self.where(n, k))
        wl = find_workload(parts["run"].model, self.path)
        for name, kind in (("model", wl.model_config), ("data", wl.data_config)):
            parts[name] = self.workload_section(name, kind, doc.get(name, {}))
        if implied_world:
            par = parts["parallel"]
            world_size = max(par.pp, 1) * par.tp * par.replicas
        if world_size is not None:
            parts["world_size"] = world_size
        return TrainConfig(**parts)

    def workload_section(self, name: str, kind: type, values) -> Any:
        """The workload's [model] or [data] from its TOML values, each checked against its
        field's type (rrfp/app/config/workload_fields.py) as rrfp's own sections are."""
        if not isinstance(values, dict):
            raise ConfigError(f"{self.source}: [{name}] must be a table")
        known = workload_keys(kind)
        checked = {}
        for k, v in values.items():
            where = self.where(name, k)
            if k not in known:
                raise ConfigError(
                    f"{unknown_key(where, name, k, known)} (known in [{name}]: {', '.join(known)})"
                )
            checked[k] = check_value(where, known[k].type, v)
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > SECTION_INT_BOUND:
                raise ConfigError(
                    f"{where} = {v} is out of bounds: it must be within "
                    f"[{-SECTION_INT_BOUND}, {SECTION_INT_BOUND}]"
                )
        try:
            return kind(**checked)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{self.source}: [{name}] {' '.join(str(e).split())}") from None


def _workload_of(doc: dict, path: str | Path | None) -> Workload | None:
    model = doc.get("run", {}).get("model", RunSection.model)
    return find_workload(model if isinstance(model, str) else RunSection.model, path)


def _check_hint_layout(sch: ScheduleSection, layout: VirtualLayout) -> None:
    """The hint has an order on every rank of the layout (``Hint.check_layout``, as rrfp sim asks):
    checked once here, for a rank that finds none fails after the process groups exist."""
    split = sch.split_backward
    try:
        sch.hint.check_layout(layout, sch.n_microbatches, split)
    except HintError as e:
        shape = f"parallel.virtual = {layout.virtual}" + (
            f", parallel.placement = {layout.placement}" if layout.virtual > 1 else ""
        )
        raise ConfigError(
            f"schedule.hint = {sch.hint.name} does not fit {layout.ranks} pipeline rank(s), "
            f"{shape}, schedule.n_microbatches = {sch.n_microbatches}: {e}"
        ) from None


def _check_fixed_budget(sch: ScheduleSection, layout: VirtualLayout) -> None:
    """Fixed dispatch follows its order and applies no budget. A class hint's order is its
    nominal one, built for a 2x budget: refuse a smaller budget rather than exceed it silently.
    With virtual stages the order is the rank's, over its local stages (``Budget.rank_limit``)."""
    if sch.dispatch is not Dispatch.FIXED or not sch.hint.is_class or sch.hint.planned:
        return
    split = sch.split_backward
    why = (
        f"schedule.dispatch = fixed with hint {sch.hint.name} follows the hint's nominal order, "
        f"built for a {NOMINAL_BUDGET:g}x budget, and applies no budget of its own"
    )
    if sch.budget.bytes is not None:
        raise ConfigError(
            f"{why}: a byte budget (schedule.budget = {sch.budget}) cannot hold it; use a count "
            f"or Nx budget, or schedule.dispatch = ready"
        )
    for r in range(layout.ranks):
        needs = sch.hint.rank_peak(layout, r, sch.n_microbatches, split)
        allowed = sch.budget.rank_limit(layout, r).count
        if needs > allowed:
            where, unit = (
                (f"stage {r}", "microbatches")
                if layout.virtual == 1
                else (
                    f"pipeline rank {r} (stages {', '.join(map(str, layout.stages_of(r)))})",
                    f"local-stage microbatches (1/{layout.virtual} of a microbatch each)",
                )
            )
            raise ConfigError(
                f"{why}: {where} holds up to {needs} {unit}, above schedule.budget = "
                f"{sch.budget} ({allowed} there); raise schedule.budget to {NOMINAL_BUDGET:g}x, "
                f"or use schedule.dispatch = ready, or a schedule hint (1f1b, zbh1)"
            )


def _check_cuda(world_size: int, why: str) -> None:
    """CUDA runs need CUDA, and a GPU for every rank on this node. ``why``: what chose nccl."""
    import torch

    if not torch.cuda.is_available():
        given = "compute.device = cuda" if why.startswith("auto") else "compute.backend = nccl"
        fix = "compute.device = cpu" if why.startswith("auto") else "compute.backend = gloo"
        raise ConfigError(
            f"{given} needs CUDA, but torch {torch.__version__} sees none "
            f"(a CPU build or no GPU); use {fix}, or install a CUDA build "
            "(make test TORCH_SPEC=torch)"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise ConfigError(
            f"{local} ranks on this node but only {gpus} GPU(s): each rank needs its own "
            "(use --nproc-per-node <= the GPU count)"
        )


def _holder(name: str, keys, known: list[str]) -> str:
    """`` (did you mean X?)`` for an unknown section ``name``: the one section that holds every key
    written under it (a section's keys say what it is better than its name's spelling), else the
    known name closest to ``name``."""
    homes = [s.NAME for s in SECTIONS if keys and set(keys) <= set(s.keys())]
    return f" (did you mean {homes[0]}?)" if len(homes) == 1 else did_you_mean(name, known)


def _parse_value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string such as dispatch=fixed
