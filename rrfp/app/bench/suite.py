"""What `rrfp bench` runs: the workloads, the executors and the sizes, checked
once in the parent so that bad input exits 2 before any rank starts.

An executor is named ``ENGINE HINT``: ``fixed 1f1b`` and ``ready bfw`` are
rrfp's dispatch modes with a hint; ``torch 1f1b`` and ``torch zb`` are
torch.distributed.pipelining's schedules, the anchors. Dashes may stand for
the space on a command line (``ready-bfw``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rrfp.app.config import RunConfig, TrainConfig
from rrfp.app.errors import ConfigError, UsageError
from rrfp.core.hints import HintError, default_split, resolve
from rrfp.core.policy import Dispatch

ROOT = Path(__file__).resolve().parents[3]  # the repository: configs/ and models/ live here
TORCH_SCHEDULES = {"1f1b": False, "zb": True}  # torch anchor -> whether its backward is split into B and W
TORCH_MODULE = "rrfp.pipeline.torch_schedules"
BASELINE = "fixed 1f1b"
DEFAULT_EXECUTORS = ("fixed 1f1b", "fixed zbh1", "fixed bfw", "ready bfw", "ready plan", "torch 1f1b", "torch zb")


def file_slug(name: str) -> str:
    """An executor's name as a file name part: ``ready bfw`` -> ``ready-bfw``."""
    return "".join(c if c.isalnum() or c in "._" else "-" for c in name)


@dataclass(frozen=True)
class Executor:
    """One contender: rrfp's ``fixed``/``ready`` dispatch with a hint, or a torch schedule."""

    engine: str  # "fixed", "ready" or "torch"
    hint: str  # an rrfp hint, or a torch schedule in TORCH_SCHEDULES

    @property
    def name(self) -> str:
        return f"{self.engine} {self.hint}"

    @property
    def is_torch(self) -> bool:
        return self.engine == "torch"

    @property
    def split(self) -> bool:
        """Whether this executor runs B and W as separate tasks (what its durations and bound use)."""
        return TORCH_SCHEDULES[self.hint] if self.is_torch else default_split(resolve(self.hint).name)

    @classmethod
    def parse(cls, text: str) -> "Executor":
        words = text.strip().lower().replace("-", " ").split()
        if len(words) != 2:
            raise UsageError(f"--executors: {text!r} is not ENGINE HINT (e.g. 'ready bfw', 'fixed-1f1b', "
                             f"'torch zb')")
        engine, hint = words
        if engine == "torch":
            if hint not in TORCH_SCHEDULES:
                raise UsageError(f"--executors: torch schedule {hint!r} is not one of {', '.join(TORCH_SCHEDULES)}")
            return cls(engine, hint)
        try:
            Dispatch.parse(engine)
            resolve(hint)
        except ValueError as e:  # HintError included
            raise UsageError(f"--executors: {text!r}: {e}") from None
        return cls(engine, hint)


@dataclass(frozen=True)
class Case:
    """One workload of the suite: its config, its variability preset, and where task times come from."""

    name: str
    config: str  # TOML run config (absolute path)
    preset: str
    calibrate: bool  # durations from the data: fit a cost model on this machine first

    def train_config(self, spec: "BenchSpec") -> TrainConfig:
        """The run config every rank builds this workload from: ConfigError names what does not fit."""
        return TrainConfig.load(self.config, [f"pp={spec.pp}", f"tp={spec.tp}", f"microbatches={spec.mb}",
                                              f"preset={self.preset}", f"budget={spec.budget}",
                                              f"unit_ms={spec.unit_ms}", f"seed={spec.seed}"],
                                world_size=spec.pp * spec.tp)


# Default suite: the tiny GPT under the `lang` preset, and the VLM whose task times come from its data
# (a cost model calibrated here) times the `jitter` preset's noise.
SUITE = {"gpt": ("configs/gpt-tiny.toml", "lang", False), "vlm": ("configs/vlm-tiny.toml", "jitter", True)}


def parse_case(text: str, preset: str | None) -> Case:
    """A suite name (gpt, vlm) or a TOML config path (its own preset and run.cost)."""
    if text in SUITE:
        config, default_preset, calibrate = SUITE[text]
        return Case(text, str(ROOT / config), preset or default_preset, calibrate)
    path = Path(text)
    if path.suffix != ".toml":
        raise UsageError(f"--workloads: {text!r} is neither {' nor '.join(SUITE)} nor a .toml config")
    if not path.is_file():
        raise UsageError(f"--workloads: no config file {text}")
    try:
        own = tomllib.loads(path.read_text()).get("run", {}).get("preset", RunConfig.preset)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{text}: not valid TOML: {e}") from None
    return Case(path.stem, str(path.resolve()), preset or own, False)


@dataclass(frozen=True)
class BenchSpec:
    """Everything the ranks need to run the suite; travels to them as JSON."""

    cases: tuple[Case, ...]
    executors: tuple[Executor, ...]
    pp: int = 4
    tp: int = 1
    mb: int = 16
    reps: int = 5  # measured iterations per executor, after one warm-up
    unit_ms: float = 20.0
    budget: str = "2x"
    seed: int = 0
    peer_timeout_s: float = 120.0

    @property
    def world(self) -> int:
        return self.pp * self.tp

    def as_dict(self) -> dict:
        doc = dataclasses.asdict(self)
        doc["executors"] = [e.name for e in self.executors]
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> "BenchSpec":
        doc = dict(doc)
        doc["cases"] = tuple(Case(**c) for c in doc["cases"])
        doc["executors"] = tuple(Executor.parse(e) for e in doc["executors"])
        return cls(**doc)


def runtime_plans() -> bool:
    """Whether the runtime plans ``hint = plan`` each iteration (its config accepts the hint)."""
    try:
        RunConfig(hint="plan")
    except ConfigError:
        return False
    return True


def unavailable(ex: Executor, tp: int) -> str | None:
    """Why this executor cannot run here, or None."""
    if ex.is_torch:
        if importlib.util.find_spec(TORCH_MODULE) is None:
            return f"the torch anchors ({TORCH_MODULE}) are not in this build yet"
        if tp != 1:
            return "the torch anchors run pipeline parallelism alone (--tp 1)"
        return None
    try:
        planned = resolve(ex.hint).planned
    except HintError as e:
        return str(e)
    if planned and not runtime_plans():
        return "the runtime does not plan the hint each iteration yet (hint = plan is simulator-only)"
    return None
