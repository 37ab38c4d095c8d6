"""A workload's ``[model]`` and ``[data]`` keys, checked as rrfp's own sections are.

Each key is a field of the workload's config dataclass, and its annotation says which TOML values
it takes (read with ``typing.get_type_hints``, so ``from __future__ import annotations`` reads
the same): ``int``; ``float`` (an int too, made a float); ``bool``; ``str``; ``pathlib.Path`` (a
string); ``Literal[...]`` (one of its values); an enum (a member's value or name); ``tuple[...]``
and ``list[...]`` (a TOML array, each item checked); ``dict[str, X]`` (a TOML table); unions of
these; ``X | None``, where None is the default kept by leaving the key out, for TOML has no null;
and ``Any`` (anything). A field of another type, a nested dataclass say, keeps its default: a
value given for it is refused, naming the type.

A key's doc line is its field's ``metadata["doc"]``, else the comment on its line, else its
docstring (a string right below it); ``rrfp config --config FILE`` prints them.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import json
import math
import pathlib
import textwrap
import tokenize
import types
import typing
from dataclasses import MISSING
from typing import Any, Literal

from rrfp.app.config.fields import did_you_mean
from rrfp.app.errors import ConfigError

SUPPORTED = "int, float, bool, str, Path, Literal, an enum, tuple, list, dict[str, ...], X | None"
_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", pathlib.Path: "str (a path)"}


@dataclasses.dataclass(frozen=True)
class WorkloadKey:
    """One key of a workload's section: the field's name, its type, default and doc line. The doc
    line is read from the source when asked (the reference pages), not when a config loads: reading
    the source costs every process that loads a config about 0.03 CPU-s."""

    name: str
    type: Any
    default: Any  # MISSING: the dataclass requires it
    owner: type  # the workload config dataclass that declares the key
    given_doc: str = ""  # the field's metadata "doc", which comes before its comment

    @property
    def doc(self) -> str:
        return self.given_doc or _comment_docs(self.owner).get(self.name, "")

    @property
    def type_name(self) -> str:
        return type_name(self.type)

    @property
    def shown_default(self) -> str:
        if self.default is MISSING:
            return "required"
        return "none (leave the key out)" if self.default is None else toml_shown(self.default)


def workload_keys(kind: type) -> dict[str, WorkloadKey]:
    """The keys of a workload config dataclass, by name, in field order. A dataclass whose
    annotations do not resolve is the user's error, one ConfigError naming it."""
    try:
        hints = typing.get_type_hints(kind)
    except Exception as e:  # noqa: BLE001 - a name in an annotation the module does not define
        raise ConfigError(
            f"{kind.__module__}.{kind.__qualname__}: its annotations do not resolve "
            f"({type(e).__name__}: {e}): import what they name in its module"
        ) from None
    out = {}
    for f in dataclasses.fields(kind):
        if not f.init:
            continue
        default = (
            f.default
            if f.default is not MISSING
            else f.default_factory()
            if f.default_factory is not MISSING
            else MISSING
        )
        out[f.name] = WorkloadKey(
            f.name, hints.get(f.name, Any), default, kind, f.metadata.get("doc", "")
        )
    return out


class _Misfit(Exception):
    """A value that the type does not take: ConfigError once the key is known."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message)


def check_value(where: str, tp: Any, value: Any) -> Any:
    """``value`` (a TOML value) as a value of ``tp``, or one ConfigError naming ``where`` (how a
    message names the key: ``--set model.width``, ``FILE: model.width``) and what it takes."""
    try:
        return _convert(tp, value)
    except _Misfit as e:
        if str(e):
            raise ConfigError(f"{where} {e}") from None
        raise ConfigError(
            f"{where} = {_shown_value(value)} has the wrong type (expected {type_name(tp)})"
        ) from None


def _convert(tp: Any, value: Any) -> Any:
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float) if tp is float else int):
            raise _Misfit
        if isinstance(value, float) and not math.isfinite(value):
            raise _Misfit(f"must be a finite number, got {value}")
        return float(value) if tp is float else value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise _Misfit
        return value
    if tp is pathlib.Path:
        if not isinstance(value, str):
            raise _Misfit
        return pathlib.Path(value)
    if origin is Literal:
        if any(type(value) is type(c) and value == c for c in args):
            return value
        if not any(isinstance(value, type(c)) for c in args):
            raise _Misfit
        shown = [_shown_value(c) for c in args]
        raise _Misfit(
            f"must be one of {', '.join(shown)}, got {_shown_value(value)}"
            + did_you_mean(str(value), [str(c) for c in args])
        )
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value in (member.value, member.name) and type(value) is type(member.value):
                return member
        names = [str(m.value) for m in tp]
        raise _Misfit(
            f"must be one of {', '.join(names)}, got {_shown_value(value)}"
            + did_you_mean(str(value), names)
        )
    if origin in (typing.Union, types.UnionType):
        return _union(args, value)
    if tp in (list, tuple) or origin in (list, tuple):
        return _array(origin or tp, args, value)
    if tp is dict or origin is dict:
        return _table(args, value)
    raise _Misfit(
        f"has type {type_name(tp)}, which no TOML value sets (rrfp reads {SUPPORTED}): leave "
        "it out to keep its default, or give the field one of those types"
    )


def _union(args: tuple, value: Any) -> Any:
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:  # X | None: X's own message (None is the default, left out)
        return _convert(members[0], value)
    # the member of the value's own type first: 3 stays an int in ``int | float``
    members.sort(key=lambda a: a is not type(value))
    for member in members:
        try:
            return _convert(member, value)
        except _Misfit:
            continue
    raise _Misfit


def _array(kind: type, args: tuple, value: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        raise _Misfit
    if not args:  # a bare list or tuple: any items
        items = list(value)
    elif kind is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _Misfit
        items = [_convert(a, v) for a, v in zip(args, value)]
    else:
        items = [_convert(args[0], v) for v in value]
    return tuple(items) if kind is tuple else items


def _table(args: tuple, value: Any) -> Any:
    if not isinstance(value, dict):
        raise _Misfit
    key_type, item_type = args or (str, Any)
    if key_type is not str:
        raise _Misfit(f"has type {type_name(dict[key_type, item_type])}: TOML keys are str")
    return {k: _convert(item_type, v) for k, v in value.items()}


def type_name(tp: Any) -> str:
    """A type as the reference and the messages name it, in TOML's words."""
    if tp is Any or tp is object:
        return "any"
    if tp is type(None):
        return "None"
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(_shown_value(c) for c in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(_shown_value(m.value) for m in tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if tp in (list, tuple):
        return "array"
    if origin in (list, tuple):
        if not args:
            return "array"
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"array [{', '.join(type_name(a) for a in args)}]"
        return f"array of {type_name(args[0])}"
    if tp is dict or origin is dict:
        return f"table of {type_name(args[1])}" if args else "table"
    return getattr(tp, "__name__", str(tp))


def toml_shown(value: Any) -> str:
    """A default as TOML writes it (a string quoted, an array bracketed)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, pathlib.PurePath)):
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _shown_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else toml_shown(value)


@functools.cache  # every key of a class asks for its doc: the source is read once per class
def _comment_docs(kind: type) -> dict[str, str]:
    """Each field's comment on its line, or its docstring, in the source of ``kind`` and the
    dataclasses it extends ({} where the source cannot be read)."""
    docs: dict[str, str] = {}
    for cls in reversed(kind.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        comments = {}
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
        body = ast.parse(source).body[0].body
        for i, node in enumerate(body):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            found = [comments[n] for n in lines if n in comments]
            after = body[i + 1] if i + 1 < len(body) else None
            if found:
                docs[node.target.id] = found[-1]
            elif (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def as_toml(config: Any) -> dict:
    """A workload config's values as TOML writes them: an enum as its value, a path as its text,
    and a None (TOML has no null) left out, as the key that keeps it is."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, pathlib.PurePath):
            return str(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return plain(dataclasses.asdict(value))
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        return value

    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: plain(v) for k, v in values.items() if v is not None}
