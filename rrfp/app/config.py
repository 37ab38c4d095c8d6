"""Run configuration: TOML sections [run], [model], [data] into dataclasses
that validate themselves, plus ``--set key=value`` overrides.

Parsed once: a TrainConfig holds resolved objects (the Hint, the Budget, the
Dispatch mode, the Variability, the Layout and the Workload), and everything
below the app takes those objects. The [model] and [data] sections belong to
the workload named by ``run.model``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rrfp.app.errors import ConfigError
from rrfp.app.registry import find_workload
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import NOMINAL_BUDGET, Hint, HintError, default_split, resolve
from rrfp.core.layout import Layout, plan_layout
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import PRESETS, Variability
from rrfp.pipeline.faults import Fault
from rrfp.pipeline.workload import Workload

ALIASES = {"executor": "dispatch"}  # the older key: executor = "ready" | "fixed"
# [run]'s numbers, within what a run can mean (and torch, numpy and timedelta can hold): (lowest, highest)
RUN_BOUNDS = {
    "pp": (0, 65536),
    "tp": (1, 65536),
    "dp": (1, 65536),
    "virtual": (1, 64),
    "microbatches": (1, 65536),
    "steps": (1, 10**9),
    "threads": (1, 1024),
    "log_every": (1, 10**9),
    "seed": (0, 2**63 - 1),
    "lr": (0, 100),
    "weight_decay": (0, 100),
    "unit_ms": (0, 600_000),
    "timeout_s": (1, 604_800),
    "checkpoint_every": (0, 10**9),
    "checkpoint_keep": (1, 10**6),
    "warmup_steps": (0, 10**9),
}
SECTION_INT_BOUND = 2**31 - 1  # any integer of a workload's [model] or [data] section, in magnitude
RESUME_MODES = ("off", "auto", "required")
AUTOCAST_MODES = ("off", "bfloat16", "float16")
ON_CORRUPT_CHECKPOINT = ("fallback", "stop")


@dataclass(frozen=True)
class RunConfig:
    pp: int = 0  # 0: world size / (tp * dp)
    tp: int = 1
    dp: int = 1
    virtual: int = 1  # V stages per pipeline rank: the model is split into pp x V stages
    placement: str = (
        "interleaved"  # with virtual > 1: "interleaved" (r, r+pp, ...) or "v" (r and 2pp-1-r)
    )
    microbatches: int = 8
    steps: int = 50
    dispatch: Dispatch | str = Dispatch.READY  # the executor: "ready" or "fixed"
    hint: Hint | str = "bfw"
    budget: Budget | str | int = "2x"  # N microbatches, "Nx" (N x 1F1B's), or bytes like "512MiB"
    split: bool | None = None  # None: the hint's default (split for zbh1 and bfw)
    lr: float = 1e-3
    # linear warmup: the learning rate rises from 0 at step 0 to lr at this step (0 = none), constant after
    warmup_steps: int = 0
    weight_decay: float = 0.0
    clip_grad_norm: float = (
        0.0  # clip the whole model's gradient norm to this before each step; 0 = off
    )
    seed: int = 0
    preset: str = "none"  # variability model for emulated device time
    unit_ms: float = 0.0  # emulated device time of one average forward; 0 = off
    # how long a peer may stay silent (no heartbeat) before it is named and the run ends; a peer that
    # beats may compute for longer (gloo). Also bounds start-up, and on nccl every wait; at least 1 s, what a
    # rendezvous's sockets need to connect at all
    timeout_s: float = 60.0
    backend: str = "gloo"  # gloo (CPU) or nccl (CUDA)
    device: str = "auto"  # auto, cpu or cuda; auto: cuda when backend = nccl
    threads: int = 1  # torch intra-op threads per rank
    trace: str = ""  # merged Chrome trace written by rank 0 at the end
    cost: CostModel | str | None = (
        None  # a cost model file (rrfp calibrate): emulated time from the data
    )
    sizes: str = (
        ""  # rank 0 writes every iteration's microbatch features and step time here, for rrfp sim
    )
    log_every: int = 1
    model: str = "gpt"  # a workload: models/<name>.py, a dotted module, or module:attribute
    checkpoint_dir: str = ""  # where checkpoints go; "" = none (also none on SIGTERM)
    checkpoint_every: int = (
        0  # save every N steps (and at the end, and on SIGTERM); 0 = only those two
    )
    checkpoint_keep: int = (
        2  # complete checkpoints kept; older ones go once a newer one is committed
    )
    resume: str = (
        "off"  # off | auto (the latest checkpoint, if any) | required (rrfp train --resume)
    )
    # a latest checkpoint that fails verification: resume from the newest that verifies, or stop (exit 2)
    on_corrupt_checkpoint: str = "fallback"
    on_nonfinite: str = (
        "stop"  # NaN/Inf in the loss or gradients: "stop" the run, or "skip" the step everywhere
    )
    # torch.autocast on the run's device type around every iteration (its F, B and W); parameters and the
    # optimizer stay float32. float16 has no loss scaling here: its small gradients may underflow
    autocast: str = "off"  # off | bfloat16 | float16
    log_dir: str = "runs/logs"  # a failing rank writes its traceback to LOG_DIR/rank-N.log
    # testing aid: make a rank fail, e.g. "kill:step=3:stage=1:task=B2" (rrfp/pipeline/faults.py)
    fault: Fault | str | None = field(default_factory=lambda: os.environ.get("RRFP_FAULT", ""))

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "virtual", "microbatches", "steps", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp < 0:
            raise ConfigError(f"run.pp must be >= 1 (or 0 for world size / (tp*dp)), got {self.pp}")
        for name, parse in (
            ("dispatch", Dispatch.parse),
            ("hint", resolve),
            ("budget", Budget.parse),
        ):
            try:
                object.__setattr__(self, name, parse(getattr(self, name)))
            except ValueError as e:  # HintError included
                raise ConfigError(f"run.{name}: {e}") from None
        if isinstance(self.cost, str):
            object.__setattr__(self, "cost", _load_cost(self.cost) if self.cost else None)
        if isinstance(self.fault, str):
            try:
                object.__setattr__(
                    self, "fault", Fault.parse(self.fault) if self.fault.strip() else None
                )
            except ValueError as e:
                raise ConfigError(f"run.fault (or RRFP_FAULT): {e}") from None
        try:
            object.__setattr__(
                self, "placement", str(VirtualLayout(1, self.virtual, self.placement).placement)
            )
        except ValueError as e:
            raise ConfigError(
                f"run.virtual = {self.virtual}, run.placement = {self.placement!r}: {e}"
            ) from None
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"run.on_nonfinite must be stop or skip, got {self.on_nonfinite!r}")
        if self.autocast not in AUTOCAST_MODES:
            raise ConfigError(
                f"run.autocast must be one of {', '.join(AUTOCAST_MODES)}, got {self.autocast!r}"
            )
        if self.preset not in PRESETS:
            raise ConfigError(
                f"run.preset must be one of {', '.join(PRESETS)}, got {self.preset!r}"
            )
        for name in ("lr", "weight_decay", "unit_ms", "timeout_s", "clip_grad_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"run.{name} must be a finite number, got {getattr(self, name)}")
        for name, positive in (("lr", True), ("timeout_s", True), ("unit_ms", False)):
            value = getattr(self, name)
            if value < 0 or (positive and value == 0):
                raise ConfigError(
                    f"run.{name} must be {'> 0' if positive else '>= 0 (0: no emulated time)'}, "
                    f"got {value:g}"
                )
        if self.clip_grad_norm < 0:
            raise ConfigError(
                f"run.clip_grad_norm must be >= 0 (0: no clipping), got {self.clip_grad_norm:g}"
            )
        if (
            self.hint.planned and self.unit_ms == 0 and self.cost is None
        ):  # the preset's lengths are made up
            raise ConfigError(
                "run.hint = plan in real time (run.unit_ms = 0) has no task costs to plan on: run "
                "`rrfp calibrate` and give run.cost = FILE, or set run.unit_ms > 0 to emulate "
                "the preset's times"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"run.backend must be gloo or nccl, got {self.backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"run.device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "run.backend = nccl carries CUDA tensors only: set run.device = cuda (or auto), "
                "or run.backend = gloo"
            )
        for name, (lo, hi) in RUN_BOUNDS.items():
            if not lo <= getattr(self, name) <= hi:
                raise ConfigError(
                    f"run.{name} = {getattr(self, name)} is out of bounds: it must be within "
                    f"[{lo}, {hi}]"
                )
        if self.resume not in RESUME_MODES:
            raise ConfigError(
                f"run.resume must be one of {', '.join(RESUME_MODES)}, got {self.resume!r}"
            )
        if self.on_corrupt_checkpoint not in ON_CORRUPT_CHECKPOINT:
            raise ConfigError(
                f"run.on_corrupt_checkpoint must be one of {', '.join(ON_CORRUPT_CHECKPOINT)}, "
                f"got {self.on_corrupt_checkpoint!r}"
            )
        if not self.checkpoint_dir and (self.checkpoint_every or self.resume != "off"):
            what = (
                "--resume"
                if self.resume == "required"
                else (
                    f"run.resume = {self.resume}"
                    if self.resume != "off"
                    else f"run.checkpoint_every = {self.checkpoint_every}"
                )
            )
            raise ConfigError(f"{what} needs run.checkpoint_dir")
        if self.device == "cuda" and self.backend == "gloo":
            raise ConfigError(
                "run.device = cuda needs run.backend = nccl: rrfp's gloo channels carry CPU "
                "tensors only"
            )

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``, once ``auto`` is decided."""
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def variability(self) -> Variability:
        return Variability.preset(self.preset)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class TrainConfig:
    """A whole run. ``world_size`` defaults to torchrun's WORLD_SIZE (1 outside
    torchrun); the layout and the model checks are done here, before any
    process group exists, so bad input fails on every rank at once."""

    run: RunConfig = field(default_factory=RunConfig)
    model: Any = None  # the workload's model config; None: its defaults
    data: Any = None  # the workload's data config; None: its defaults
    world_size: int = field(default_factory=_world_size)

    def __post_init__(self) -> None:
        wl = self.workload
        if self.model is None:
            object.__setattr__(self, "model", wl.model_config())
        if self.data is None:
            object.__setattr__(self, "data", wl.data_config())
        try:
            layout = plan_layout(self.world_size, self.run.pp, self.run.tp, self.run.dp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        object.__setattr__(self, "_layout", layout)
        stages = self.num_stages
        try:
            wl.check(self.model, self.data, stages, layout.tp)
        except ValueError as e:
            split = (
                f" (run.virtual = {self.run.virtual} stages on each of {layout.pp} pipeline ranks)"
                if self.run.virtual > 1
                else ""
            )
            raise ConfigError(f"{e}{split}") from None
        _check_hint_layout(self.run, self.stages)
        _check_fixed_budget(self.run, self.stages)
        fault = self.run.fault
        if fault is not None and (
            fault.stage is not None
            and fault.stage >= stages
            or fault.rank is not None
            and fault.rank >= self.world_size
        ):
            raise ConfigError(f"run.fault {fault}: no such stage or rank in {layout.short()}")
        if fault is not None and fault.task is not None:
            split = default_split(self.run.hint.name, self.run.split)
            if fault.task.mb >= self.run.microbatches or (
                fault.task.kind.name == "W" and not split
            ):
                raise ConfigError(
                    f"run.fault {fault}: no task {fault.task} with {self.run.microbatches} "
                    f"microbatches, split = {split}"
                )
        if self.run.device_type == "cuda":
            _check_cuda(self.world_size)
        if self.run.cost is not None and self.run.cost.num_stages != stages:
            raise ConfigError(
                f"run.cost was calibrated for {self.run.cost.num_stages} stages, this run has "
                f"{stages}: rerun rrfp calibrate --pp {layout.pp}"
                + (f" with run.virtual = {self.run.virtual}" if self.run.virtual > 1 else "")
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
        return self._layout.pp * self.run.virtual

    @property
    def stages(self) -> VirtualLayout:
        """Which of the num_stages stages each pipeline rank holds."""
        return VirtualLayout(self._layout.pp, self.run.virtual, self.run.placement)

    @classmethod
    def from_dict(
        cls, doc: dict, source: str = "config", world_size: int | None = None
    ) -> TrainConfig:
        for key in doc:
            if key not in ("run", "model", "data"):
                raise ConfigError(f"{source}: unknown section [{key}] (expected run, model, data)")
        run = _section(source, "run", RunConfig, doc.get("run", {}))
        wl = find_workload(run.model)
        parts = {
            name: _section(source, name, kind, doc.get(name, {}))
            for name, kind in (("model", wl.model_config), ("data", wl.data_config))
        }
        return cls(run, **parts, **({} if world_size is None else {"world_size": world_size}))

    @classmethod
    def load(
        cls, path: str | Path | None, overrides: list[str] = (), world_size: int | None = None
    ) -> TrainConfig:
        doc: dict = {}
        source = str(path) if path else "defaults"
        if path:
            try:
                doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
            except OSError as e:
                raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}): "
                    "a TOML file is UTF-8"
                ) from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for name, table in doc.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: [{name}] must be a table (one [{name}] section)")
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not KEY=VALUE")
            section, _, name = key.strip().rpartition(".")
            if not section:  # a bare key: the section that has it, run first
                model = doc.get("run", {}).get("model", RunConfig.model)
                model = (
                    model if isinstance(model, str) else RunConfig.model
                )  # a wrong type is refused below
                wl = find_workload(model)
                kinds = {"run": RunConfig, "model": wl.model_config, "data": wl.data_config}
                section = next(
                    (
                        s
                        for s, k in kinds.items()
                        if ALIASES.get(name, name) in {f.name for f in dataclasses.fields(k)}
                    ),
                    "run",
                )
            doc.setdefault(section, {})[name] = _parse_value(raw.strip())
        return cls.from_dict(doc, source, world_size)

    def as_dict(self) -> dict:
        """Plain values, as a TOML file would give them."""
        run = {f.name: getattr(self.run, f.name) for f in dataclasses.fields(RunConfig)}
        run.update(
            dispatch=str(self.run.dispatch),
            hint=self.run.hint.name,
            budget=str(self.run.budget),
            cost="(calibrated)" if self.run.cost is not None else "",
            fault=str(self.run.fault or ""),
        )
        return {
            "run": run,
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
        }


def _check_hint_layout(run: RunConfig, layout: VirtualLayout) -> None:
    """The hint has an order on every rank of the layout (``Hint.check_layout``, as rrfp sim asks):
    checked once here, for a rank that finds none fails after the process groups exist."""
    try:
        run.hint.check_layout(layout, run.microbatches, default_split(run.hint.name, run.split))
    except HintError as e:
        shape = f"run.virtual = {layout.virtual}" + (
            f", run.placement = {layout.placement}" if layout.virtual > 1 else ""
        )
        raise ConfigError(
            f"run.hint = {run.hint.name} does not fit {layout.ranks} pipeline rank(s), {shape}, "
            f"run.microbatches = {run.microbatches}: {e}"
        ) from None


def _check_fixed_budget(run: RunConfig, layout: VirtualLayout) -> None:
    """Fixed dispatch follows its order and applies no budget. A class hint's order is its
    nominal one, built for a 2x budget: refuse a smaller budget rather than exceed it silently.
    With virtual stages the order is the rank's, over its local stages (``Budget.rank_limit``)."""
    if run.dispatch is not Dispatch.FIXED or not run.hint.is_class or run.hint.planned:
        return
    split = default_split(run.hint.name, run.split)
    why = (
        f"run.dispatch = fixed with hint {run.hint.name} follows the hint's nominal order, built for a "
        f"{NOMINAL_BUDGET:g}x budget, and applies no budget of its own"
    )
    if run.budget.bytes is not None:
        raise ConfigError(
            f"{why}: a byte budget (run.budget = {run.budget}) cannot hold it; use a count "
            f"or Nx budget, or run.dispatch = ready"
        )
    for r in range(layout.ranks):
        needs = run.hint.rank_peak(layout, r, run.microbatches, split)
        allowed = run.budget.rank_limit(layout, r).count
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
                f"{why}: {where} holds up to {needs} {unit}, above run.budget = "
                f"{run.budget} ({allowed} there); raise run.budget to {NOMINAL_BUDGET:g}x, or use "
                f"run.dispatch = ready, or a schedule hint (1f1b, zbh1)"
            )


def _load_cost(path: str) -> CostModel:
    try:
        return CostModel.from_json(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"run.cost: cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"run.cost: {path} is not a cost model from rrfp calibrate: {e}"
        ) from None


def _check_cuda(world_size: int) -> None:
    """CUDA runs need CUDA, and a GPU for every rank on this node."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"run.backend = nccl needs CUDA, but torch {torch.__version__} sees none "
            "(a CPU build or no GPU); use run.backend = gloo, or install a CUDA build "
            "(make test TORCH_SPEC=torch)"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise ConfigError(
            f"{local} ranks on this node but only {gpus} GPU(s): each rank needs its own "
            "(use --nproc-per-node <= the GPU count)"
        )


def _section(source: str, name: str, kind: type, values) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    known = {f.name: f for f in dataclasses.fields(kind)}
    values = {ALIASES.get(k, k) if name == "run" else k: v for k, v in values.items()}
    for k, v in values.items():
        if k not in known:
            raise ConfigError(f"{source}: unknown key {name}.{k} (known: {', '.join(known)})")
        _check_type(f"{source}: {name}.{k}", v, known[k].type)
        if (
            name != "run"
            and isinstance(v, int)
            and not isinstance(v, bool)
            and abs(v) > SECTION_INT_BOUND
        ):
            raise ConfigError(
                f"{source}: {name}.{k} = {v} is out of bounds: it must be within "
                f"[{-SECTION_INT_BOUND}, {SECTION_INT_BOUND}]"
            )
    try:
        return kind(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: [{name}] {e}") from None


def _parse_value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string such as executor=fixed


_SIMPLE = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "bool | None": (bool,),
    "str | int": (str, int),
    "Budget | str | int": (str, int),
    "Hint | str": (str,),
    "Dispatch | str": (str,),
    "Fault | str | None": (str,),
    "CostModel | str | None": (str,),
}


def _check_type(where: str, value, annotation) -> None:
    ok_types = _SIMPLE.get(str(annotation))
    if ok_types is None:
        return
    if isinstance(value, bool) and bool not in ok_types or not isinstance(value, ok_types):
        raise ConfigError(f"{where} = {value!r} has the wrong type (expected {annotation})")
