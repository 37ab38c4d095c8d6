"""What `rrfp bench` runs: the workloads, the contenders and the sizes, checked
once in the parent so that bad input exits 2 before any rank starts.

A contender is one row of the comparison. rrfp's are named ``DISPATCH HINT``:
``fixed 1f1b`` and ``ready bfw`` are rrfp's dispatch modes with a hint
(``ready bfw v2``: on two virtual stages per rank in the v placement,
``fixed 1f1b i2``: interleaved). torch's are named ``torch SCHEDULE``:
``torch 1f1b`` and ``torch zb`` are torch.distributed.pipelining's schedules,
the anchors. ``drop-in ready bfw`` is rrfp's executor reached through
``rrfp.ScheduleReady``, torch's schedule surface (rrfp.app.bench.dropin).
Dashes may stand for the spaces on a command line (``ready-bfw``,
``drop-in-ready-bfw``).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from rrfp.app.config.sections import EmulationSection
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError, UsageError
from rrfp.core.budget import DEFAULT_BUDGET
from rrfp.core.hints import default_split, resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.pipeline.schedule_settings import AUTO_UNSPLIT
from rrfp.pipeline.timeouts import DEFAULT_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[3]  # the repository: configs/ lives here
BASELINE = "fixed 1f1b"
# fixed bfw is ready bfw's ablation (its nominal order, same memory), fixed plan ready plan's (the
# plan's predicted run replayed as a fixed order): each pair differs in dispatch alone
# drop-in: the ready rows again through torch's schedule surface, ScheduleReady (what that path
# costs)
# v2: two virtual stages per rank in the v shape, beside torch's schedules of that shape (zb,
# dualpipev)
DEFAULT_CONTENDERS = (
    "fixed 1f1b",
    "fixed zbh1",
    "fixed bfw",
    "ready bfw",
    "fixed plan",
    "ready plan",
    "torch 1f1b",
    "torch zb",
    "drop-in ready bfw",
    "drop-in ready plan",
    "ready bfw v2",
    "ready plan v2",
    "torch dualpipev",
)
VIRTUAL_SUFFIX = re.compile(
    r"(?P<placement>[vi])(?P<virtual>\d+)"
)  # v2: v placement; i2, i3: interleaved
DROP_IN = "drop-in"
OVERLAP = "overlap"  # the suffix of a contender whose EP tasks' all-to-alls take a W beside
UNSPLIT = "unsplit"  # the suffix of a split contender that leaves stages unsplit
# which: the last stage, or the stages schedule.unsplit_stages = "auto" picks
UNSPLIT_WHICH = ("last", AUTO_UNSPLIT)
RRFP, TORCH = "rrfp", "torch"  # the frameworks a contender runs on
FLAG = "--contenders"  # the flag that names them, in error lines


def file_slug(name: str) -> str:
    """A contender's name as a file name part: ``ready bfw`` -> ``ready-bfw``."""
    return "".join(c if c.isalnum() or c in "._" else "-" for c in name)


@dataclass(frozen=True)
class Contender:
    """One row the bench compares side by side: rrfp with a dispatch mode and a hint (directly,
    or through ScheduleReady when ``drop_in``), or one of torch's schedules."""

    framework: str  # RRFP or TORCH
    dispatch: str | None  # rrfp's "fixed" or "ready"; None for torch (its schedule is its order)
    hint: str  # an rrfp hint, or a torch schedule (rrfp.app.bench.torch_schedules)
    drop_in: bool = False  # rrfp's executor behind torch's schedule surface (rrfp.ScheduleReady)
    virtual: int = 1  # rrfp's stages per rank (the model splits into pp x virtual)
    placement: str = "interleaved"  # with virtual > 1: "interleaved" or "v"
    # ready dispatch under EP: a W runs beside an EP task while it waits at its all-to-all
    overlap: bool = False
    # a split schedule whose last stage ("last": schedule.unsplit_stages = [-1]) or the stages its
    # cost model picks ("auto", planned rows) run their backward whole; "": every stage splits
    unsplit: str = ""

    @property
    def name(self) -> str:
        first = TORCH if self.is_torch else self.dispatch
        base = f"{DROP_IN} {first} {self.hint}" if self.drop_in else f"{first} {self.hint}"
        if self.virtual > 1:
            base = f"{base} {'v' if self.placement == 'v' else 'i'}{self.virtual}"
        if self.unsplit:
            base = f"{base} {self.unsplit} {UNSPLIT}"
        return f"{base} {OVERLAP}" if self.overlap else base

    @property
    def unsplit_stages(self) -> tuple[int, ...] | str:
        """The stages this row leaves unsplit (schedule.unsplit_stages; "auto" chosen from the cost
        model where the row's settings are built)."""
        return {"last": (-1,), AUTO_UNSPLIT: AUTO_UNSPLIT}.get(self.unsplit, ())

    @property
    def is_torch(self) -> bool:
        return self.framework == TORCH

    @property
    def split(self) -> bool:
        """Whether this contender runs B and W as separate tasks (what its durations and bound
        use)."""
        if self.is_torch:
            from rrfp.app.bench import torch_schedules as ts

            return ts.SCHEDULES[ts.resolve_schedule(self.hint)][3]
        return default_split(resolve(self.hint).name)

    @classmethod
    def parse(cls, text: str) -> Contender:
        rest = text.strip().lower()
        if rest.startswith(DROP_IN) and rest[len(DROP_IN) : len(DROP_IN) + 1] in (" ", "-"):
            contender = cls.parse(rest[len(DROP_IN) + 1 :])
            if contender.is_torch:
                raise UsageError(
                    f"{FLAG}: {text!r}: the drop-in runs rrfp's executor (fixed or ready), "
                    f"not a torch schedule"
                )
            if contender.unsplit:
                raise UsageError(
                    f"{FLAG}: {text!r}: the drop-in runs torch's stage split as torch splits it; "
                    f"'{contender.unsplit} {UNSPLIT}' is for rrfp's own rows"
                )
            return replace(contender, drop_in=True)
        first, _, hint = rest.replace("-", " ", 1).partition(" ")
        hint = hint.strip()
        head, _, last = hint.replace("-", " ").rpartition(" ")
        if head and last == OVERLAP:
            if first != "ready":
                raise UsageError(
                    f"{FLAG}: {text!r}: the overlap picks the task beside an all-to-all by "
                    "readiness: ready dispatch only"
                )
            return replace(cls.parse(f"{first} {head}"), overlap=True)
        which = head.rpartition(" ")[2]
        if last == UNSPLIT and which in UNSPLIT_WHICH and first != TORCH:
            suffix = f"{which} {UNSPLIT}"
            base = cls.parse(f"{first} {hint.replace('-', ' ')[: -len(suffix)].strip()}")
            if not base.split or base.drop_in:
                raise UsageError(
                    f"{FLAG}: {text!r}: '{suffix}' leaves stages of a split schedule whole: "
                    f"{base.name} does not split"
                )
            if which == AUTO_UNSPLIT and not resolve(base.hint).planned:
                raise UsageError(
                    f"{FLAG}: {text!r}: '{suffix}' chooses from the calibrated cost model, which "
                    "the bench fits for planned rows only (plan)"
                )
            return replace(base, unsplit=which)
        if head and first != TORCH and (m := VIRTUAL_SUFFIX.fullmatch(last)):
            placement = "v" if m["placement"] == "v" else "interleaved"
            try:
                VirtualLayout(1, int(m["virtual"]), placement)
            except ValueError as e:
                raise UsageError(f"{FLAG}: {text!r}: {e}") from None
            return replace(
                cls.parse(f"{first} {head}"), virtual=int(m["virtual"]), placement=placement
            )
        if not hint:
            raise UsageError(
                f"{FLAG}: {text!r} is not DISPATCH HINT or torch SCHEDULE (e.g. 'ready bfw', "
                f"'fixed-1f1b', 'torch zb')"
            )
        if first == TORCH:  # checked by unavailable(): the module may be missing
            return cls(TORCH, None, hint.replace(" ", "-"))
        try:
            dispatch = str(Dispatch.parse(first))
        except ValueError:
            raise UsageError(
                f"{FLAG}: {text!r}: {first!r} is neither a dispatch mode (fixed, ready) nor torch"
            ) from None
        try:
            resolve(hint)
        except ValueError as e:  # HintError included
            raise UsageError(f"{FLAG}: {text!r}: {e}") from None
        return cls(RRFP, dispatch, hint)


@dataclass(frozen=True)
class Case:
    """One workload of the suite: its config and overrides, its variability preset, where task times
    come from, and the contenders that run on it."""

    name: str
    config: str  # TOML run config (absolute path)
    preset: str
    calibrate: bool  # durations from the data: fit a cost model on this machine first
    overrides: tuple[str, ...] = ()  # KEY=VALUE on top of the config, as `rrfp train --set`
    contenders: tuple[Contender, ...] = ()

    def train_config(
        self,
        spec: BenchSpec,
        pp: int | None = None,
        tp: int | None = None,
        contender: Contender | None = None,
    ) -> TrainConfig:
        """The run config every rank builds this workload from (for ``contender``'s virtual
        stages, if given): ConfigError names what does not fit."""
        pp, tp = pp or spec.pp, tp or spec.tp
        replicas = [f"parallel.dp={spec.dp}", f"parallel.ep={spec.ep}"]
        stages = (
            []
            if contender is None or contender.virtual == 1
            else [
                f"parallel.virtual={contender.virtual}",
                f"parallel.placement={contender.placement}",
            ]
        )
        if contender is not None and contender.unsplit:
            stages += ["schedule.split=true"]
            # "auto" is chosen where the row's settings are built, from the cost model calibrated
            # with this config (every stage split, and every stage whole)
            if contender.unsplit_stages != AUTO_UNSPLIT:
                stages += [f"schedule.unsplit_stages={list(contender.unsplit_stages)}"]
        return TrainConfig.load(
            self.config,
            [
                *self.overrides,
                f"parallel.pp={pp}",
                f"parallel.tp={tp}",
                f"schedule.n_microbatches={spec.n_microbatches}",
                f"emulation.preset={self.preset}",
                f"schedule.budget={spec.budget}",
                f"emulation.unit_ms={spec.unit_ms}",
                f"run.seed={spec.seed}",
                *replicas,
                *stages,
            ],
            world_size=pp * tp * spec.dp,
        )


# Default suite: the tiny GPT under the `lang` preset, and the VLM whose task times come from its
# data (a cost model calibrated here) times the `jitter` preset's noise. Eight layers, so that
# torch's zero-bubble schedule (two stages per rank) can split them over 2 x 4 stages.
SUITE = {
    "gpt": ("configs/gpt-tiny.toml", "lang", False, ("model.n_layer=8",)),
    "vlm": ("configs/vlm-tiny.toml", "jitter", True, ("model.n_layer=8",)),
    "moe": ("configs/moe-tiny.toml", "lang", False, ()),
}
# The mixture of experts runs in a job of its own, on pp x ep ranks: each pipeline rank's two
# replicas form an EP group (their experts sharded over it), each replica with its own data and
# duration seed, the MoE tasks' experts and all-to-alls timed by their routing
# (rrfp/nn/expert_time.py). Four layers: torch's two-stage-per-rank schedules get one each.
MOE = "moe"
MOE_SHAPE = {"pp": 2, "dp": 2, "ep": 2}
# fixed and ready at the same hint and budget (1F1B has no ready twin: its order is its memory
# bound); a planned hint runs fixed only at ep 1 (under EP each replica plans its own order);
# torch's schedules run the same stages, their experts sharded alike (every replica runs one fixed
# order, so the all-to-alls pair)
MOE_CONTENDERS = (
    "fixed 1f1b",
    "fixed zbh1",
    "ready zbh1",
    "fixed bfw",
    "ready bfw",
    "fixed plan",
    "ready plan",
    "ready bfw overlap",
    "ready plan overlap",
    "torch 1f1b",
    "torch zb",
    "torch dualpipev",
)


def parse_case(text: str, preset: str | None, overrides: list[str]) -> Case:
    """A suite name (gpt, vlm) or a TOML config path (its own preset and emulation.cost)."""
    if text in SUITE:
        config, default_preset, calibrate, own = SUITE[text]
        return Case(
            text, str(ROOT / config), preset or default_preset, calibrate, (*own, *overrides)
        )
    path = Path(text)
    if path.suffix != ".toml":
        raise UsageError(
            f"--workloads: {text!r} is neither {' nor '.join(SUITE)} nor a .toml config"
        )
    if not path.is_file():
        raise UsageError(f"--workloads: no config file {text}")
    try:
        doc = tomllib.loads(path.read_text())
        own = doc.get("emulation", {}).get("preset") or EmulationSection.preset
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{text}: not valid TOML: {e}") from None
    return Case(path.stem, str(path.resolve()), preset or own, False, tuple(overrides))


@dataclass(frozen=True)
class BenchSpec:
    """Everything the ranks need to run the suite; travels to them as JSON."""

    cases: tuple[Case, ...]
    pp: int = 4
    tp: int = 1
    n_microbatches: int = 16
    reps: int = 5  # measured iterations per contender, after one warm-up
    unit_ms: float = 20.0  # 0: real compute, no emulated device time (`rrfp bench --real`)
    budget: str = DEFAULT_BUDGET
    seed: int = 0  # replica d draws its durations from seed + d
    dp: int = 1  # data-parallel replicas per pipeline rank
    ep: int = 1  # expert-parallel group size (dividing dp)
    timeout_s: float = DEFAULT_TIMEOUT_S
    torch_sends: str = (
        "delayed"  # torch anchors: "delayed" by the link latency from sender threads, or "native"
    )
    device: str = "cpu"  # "cuda": the ranks compute on their GPU over NCCL (real compute only)
    pin: bool = False  # real compute on CPU: each rank's threads on a core of its own

    @property
    def real(self) -> bool:
        """Task times are the model's real compute on the run's device: nothing is emulated."""
        return self.unit_ms == 0

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def runs(self) -> int:
        """Iterations the job runs, warm-ups included."""
        return sum(len(c.contenders) for c in self.cases) * (self.reps + 1)

    def as_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        for c in doc["cases"]:
            c["contenders"] = [Contender(**e).name for e in c["contenders"]]
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> BenchSpec:
        doc = dict(doc)
        doc["cases"] = tuple(
            Case(
                **{
                    **c,
                    "overrides": tuple(c["overrides"]),
                    "contenders": tuple(Contender.parse(e) for e in c["contenders"]),
                }
            )
            for c in doc["cases"]
        )
        return cls(**doc)


def cost_key(case: str, contender: Contender) -> str:
    """Which calibrated cost model a contender plans with: its workload's, per layout (a model is
    fitted per stage, virtual stages cut the model finer, and a stage left unsplit prices its B
    whole and its W at nothing)."""
    key = case
    if contender.virtual > 1:
        key = f"{key}-{'v' if contender.placement == 'v' else 'i'}{contender.virtual}"
    return f"{key}-{contender.unsplit}-{UNSPLIT}" if contender.unsplit else key


def unavailable(contender: Contender, case: Case, spec: BenchSpec) -> str | None:
    """Why this contender cannot run this workload here, or None."""
    if spec.device != "cpu" and (contender.is_torch or contender.drop_in):
        return "the bench runs torch's schedules and the drop-in on CPU ranks only"
    if contender.drop_in and spec.tp != 1:
        return "ScheduleReady runs pipeline parallelism alone (--tp 1)"
    if contender.unsplit and not spec.real:
        return "its emulated W would still be drawn apart: an unsplit stage runs on real compute"
    if contender.overlap and spec.ep == 1:
        return "the overlap is at expert parallelism's all-to-alls (--workloads moe, --ep 2)"
    if spec.ep > 1 and contender.drop_in:
        return "the bench's drop-in rows run one replica per stage"
    if spec.ep > 1 and contender.dispatch == "fixed" and resolve(contender.hint).planned:
        return (
            "under expert parallelism each replica plans its own order, which a fixed dispatch "
            "would not pair across the EP group"
        )
    if contender.virtual > 1:
        if contender.drop_in:
            return "ScheduleReady runs one stage per rank"
        if case.calibrate and not spec.real:  # real compute calibrates each layout
            return (
                f"its cost model is calibrated for {spec.pp} stages, and {contender.virtual} "
                f"stages per rank need one for {spec.pp * contender.virtual}"
            )
        try:
            case.train_config(spec, contender=contender)
        except ConfigError as e:
            return f"{e} (more layers: --set model.n_layer=...)"
    if not contender.is_torch:
        return None
    from rrfp.app.bench import torch_schedules as ts

    try:
        per_rank = ts.stages_per_rank(contender.hint)
    except ValueError as e:
        return str(e)
    if spec.tp != 1:
        return "the torch anchors run pipeline parallelism alone (--tp 1)"
    if per_rank > 1:
        try:
            case.train_config(spec, pp=spec.pp * per_rank, tp=1)
        except ConfigError as e:
            return (
                f"it splits the model into {per_rank} x {spec.pp} stages, and {e} "
                f"(more layers: --set model.n_layer=...)"
            )
    return None
