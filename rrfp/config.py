"""Run configuration: TOML sections [run], [model], [data] into dataclasses
that validate themselves, plus ``--set key=value`` overrides."""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from models.data import DataConfig
from models.gpt import GPTConfig

from .budget import Budget
from .hints import HintError, resolve
from .policy import Executor
from .variability import PRESETS


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key."""


@dataclass
class RunConfig:
    pp: int = 0  # 0: world size / (tp * dp)
    tp: int = 1
    dp: int = 1
    microbatches: int = 8
    steps: int = 50
    executor: str = "ready"
    hint: str = "bfw"
    budget: str | int = "2x"  # N microbatches, "Nx" (N x 1F1B's), or bytes like "512MiB"
    split: bool | None = None  # None: the hint's default (split for zbh1 and bfw)
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    preset: str = "none"  # variability model for emulated device time
    unit_ms: float = 0.0  # emulated device time of one average forward; 0 = off
    timeout_s: float = 60.0  # peer deadline and process-group timeout
    backend: str = "gloo"
    threads: int = 1  # torch intra-op threads per rank
    trace: str = ""  # merged Chrome trace written by rank 0 at the end
    log_every: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "microbatches", "steps", "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp < 0:
            raise ConfigError(f"run.pp must be >= 1 (or 0 for world size / (tp*dp)), got {self.pp}")
        try:
            Executor(self.executor)
        except ValueError:
            raise ConfigError(f"run.executor must be 'ready' or 'fixed', got {self.executor!r}") from None
        try:
            resolve(self.hint)
        except HintError as e:
            raise ConfigError(f"run.hint: {e}") from None
        try:
            Budget.parse(self.budget)
        except ValueError as e:
            raise ConfigError(f"run.budget: {e}") from None
        if self.preset not in PRESETS:
            raise ConfigError(f"run.preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.lr <= 0 or self.unit_ms < 0 or self.timeout_s <= 0:
            raise ConfigError("run.lr and run.timeout_s must be > 0 and run.unit_ms >= 0")
        if self.backend != "gloo":
            raise ConfigError(f"run.backend {self.backend!r} is not supported yet: only gloo (CPU); the "
                              "CUDA lane and NCCL poller exist but are not wired into training")


SECTIONS = {"run": RunConfig, "model": GPTConfig, "data": DataConfig}


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @classmethod
    def from_dict(cls, doc: dict, source: str = "config") -> "TrainConfig":
        parts = {}
        for key in doc:
            if key not in SECTIONS:
                raise ConfigError(f"{source}: unknown section [{key}] (expected {', '.join(SECTIONS)})")
        for name, kind in SECTIONS.items():
            values = doc.get(name, {})
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{name}] must be a table")
            known = {f.name: f for f in dataclasses.fields(kind)}
            for k, v in values.items():
                if k not in known:
                    raise ConfigError(f"{source}: unknown key {name}.{k} (known: {', '.join(known)})")
                _check_type(f"{source}: {name}.{k}", v, known[k].type)
            try:
                parts[name] = kind(**values)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{source}: [{name}] {e}") from None
        return cls(**parts)

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> "TrainConfig":
        doc: dict = {}
        source = str(path) if path else "defaults"
        if path:
            try:
                doc = tomllib.loads(Path(path).read_text())
            except OSError as e:
                raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"override {item!r} is not KEY=VALUE")
            section, _, name = key.strip().rpartition(".")
            section = section or next((s for s, k in SECTIONS.items()
                                       if name in {f.name for f in dataclasses.fields(k)}), "run")
            doc.setdefault(section, {})[name] = _parse_value(raw.strip())
        return cls.from_dict(doc, source)

    def as_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def _parse_value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string such as executor=fixed


def _check_type(where: str, value, annotation) -> None:
    ann = str(annotation)
    ok = True
    if ann.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ann.startswith("float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif ann.startswith("bool |"):
        ok = isinstance(value, bool)
    elif ann == "bool":
        ok = isinstance(value, bool)
    elif ann == "str":
        ok = isinstance(value, str)
    elif ann == "str | int":
        ok = isinstance(value, (str, int)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{where} = {value!r} has the wrong type (expected {ann})")
