"""How a config section declares its keys: every field carries its doc line, the TOML types it
accepts, and how a TOML value becomes the field's type. The loader, ``rrfp config`` and
docs/configuration.md all read these, so a key's checks and its documentation cannot part."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar

from rrfp.app.errors import ConfigError

TOML_TYPE = {bool: "bool", int: "int", float: "float", str: "str"}


def setting(
    default: Any = MISSING,
    doc: str = "",
    *,
    toml: tuple[type, ...] | None = None,
    parse: Callable[[Any], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    bounds: tuple[float, float] | None = None,
    least: tuple[float, bool, str] | None = None,
    factory: Callable[[], Any] | None = None,
    shown: str | None = None,
) -> Any:
    """A section field. ``doc``: its one line. ``toml``: the TOML value types it accepts (the
    default's type when left out; an int is a float too). ``parse``: a TOML value to the field's
    type, at load (a ValueError names the key). ``choices``/``bounds``: what the value may be.
    ``least``: (lowest, strict, the rule as a message says it), checked before ``bounds``.
    ``shown``: the default as the reference prints it, where the default is not a TOML value."""
    meta = dict(
        doc=doc, toml=toml, parse=parse, choices=choices, bounds=bounds, least=least, shown=shown
    )
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def toml_types(f: dataclasses.Field) -> tuple[type, ...]:
    given = f.metadata.get("toml")
    if given:
        return given
    default = f.default if f.default is not MISSING else f.default_factory()
    kind = type(default)
    return (int, float) if kind is float else (kind,)


def type_name(f: dataclasses.Field) -> str:
    names = []
    for t in toml_types(f):
        name = TOML_TYPE.get(t, t.__name__)
        if name not in names and not (name == "int" and float in toml_types(f)):
            names.append(name)
    return " | ".join(names)


def toml_value(value: Any) -> Any:
    """A resolved value as TOML writes it: hints by name, budgets and modes as their text."""
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [toml_value(v) for v in value]
    name = getattr(value, "name", None)
    if isinstance(name, str) and type(value).__name__ == "Hint":
        return name
    return str(value)


def shown_default(f: dataclasses.Field) -> str:
    if f.metadata.get("shown") is not None:
        return f.metadata["shown"]
    default = f.default if f.default is not MISSING else f.default_factory()
    value = toml_value(default)
    if isinstance(value, str):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def did_you_mean(word: str, known) -> str:
    """`` (did you mean X?)`` when ``word`` is close to one of ``known``, else ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_key(label: str, section: str, key: str, known) -> str:
    """``LABEL: unknown key SECTION.KEY (did you mean ...?)``; LABEL: ``--set KEY`` or the file."""
    prefix = label if label.startswith("--set") else label.rsplit(": ", 1)[0]
    return f"{prefix}: unknown key {section}.{key}{did_you_mean(key, known)}"


@dataclass(frozen=True)
class Section:
    """A TOML table: fields declared with ``setting``; built from TOML values by ``parse``,
    checked when built (``check``), so a hand-built section is checked the same way."""

    NAME: ClassVar[str] = ""
    DOC: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def parse(cls, values: dict, where: Callable[[str], str] | None = None) -> Section:
        """The section from a TOML table's values: unknown keys, wrong types and values that do
        not parse are one ConfigError naming the key (``where(key)``: how the message names it)."""
        where = where or (lambda k: f"{cls.NAME}.{k}")
        known = cls.keys()
        out = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(
                    f"{unknown_key(where(key), cls.NAME, key, known)} (known in "
                    f"[{cls.NAME}]: {', '.join(known)})"
                )
            f = known[key]
            types = toml_types(f)
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                raise ConfigError(
                    f"{where(key)} = {value!r} has the wrong type (expected {type_name(f)})"
                )
            parse = f.metadata.get("parse")
            if parse is not None:
                try:
                    value = parse(value)
                except ConfigError:
                    raise
                except ValueError as e:
                    raise ConfigError(f"{where(key)}: {e}") from None
            out[key] = value
        return cls(**out)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{self.NAME}.{f.name} must be a finite number, got {value}")
            choices = meta.get("choices")
            if choices and value not in choices:
                raise ConfigError(
                    f"{self.NAME}.{f.name} must be one of {', '.join(choices)}, got {value!r}"
                    + did_you_mean(str(value), choices)
                )
            least = meta.get("least")
            if least and (value < least[0] or least[1] and value == least[0]):
                raise ConfigError(f"{self.NAME}.{f.name} must be {least[2]}, got {value:g}")
            bounds = meta.get("bounds")
            if bounds and not bounds[0] <= value <= bounds[1]:
                raise ConfigError(
                    f"{self.NAME}.{f.name} = {value} is out of bounds: it must be within "
                    f"[{bounds[0]}, {bounds[1]}]"
                )
        self.check()

    def check(self) -> None:
        """Checks across this section's fields (ConfigError)."""

    def as_toml(self) -> dict:
        """The section as TOML values (None, a key left to its default's meaning, left out)."""
        out = {}
        for f in dataclasses.fields(self):
            value = toml_value(getattr(self, f.name))
            if value is not None:
                out[f.name] = value
        return out


def toml_text(doc: dict[str, dict]) -> str:
    """A document of flat tables as TOML (strings, numbers, booleans and lists of them): what
    ``rrfp train --dry-run`` prints, and what tomllib reads back to the same values."""
    out = []
    for name, table in doc.items():
        out.append(f"[{name}]")
        out += [f"{key} = {_toml_scalar(value)}" for key, value in table.items()]
        out.append("")
    return "\n".join(out)


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return repr(value)
