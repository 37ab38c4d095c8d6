"""A workload's [model] and [data] keys are checked against their fields' annotations as rrfp's own
sections are (rrfp/app/config/workload_fields.py):
the value a TOML file or ``--set`` gives either fits
the type, and arrives as that type, or is one line naming the key and what it takes. Checked over
generated types and values, on every built-in model's every key, and on a user's Workload; and
``rrfp config --config FILE`` lists a config's workload keys."""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re
import sys
import tomllib
import typing
from typing import Literal, Optional

import pytest
from harness import ROOT
from harness.cli_run import rrfp_in_process
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.app.config.fields import toml_text
from rrfp.app.config.registry import find_workload, known
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.config.workload_fields import check_value, type_name, workload_keys
from rrfp.app.errors import ConfigError
from rrfp.app.train.checkpoints import fingerprint

# ---- generated: any type the loader reads, any TOML value ----

CHOICES = st.lists(st.sampled_from(["a", "b", "adamw", "sgd", 1, 2, 0.5]), min_size=1, max_size=3)
LEAVES = st.one_of(
    st.sampled_from([int, float, bool, str]),
    CHOICES.map(lambda cs: Literal[tuple(dict.fromkeys(cs))]),
)


def _nest(inner):
    return st.one_of(
        inner.map(lambda t: tuple[t, ...]),
        inner.map(lambda t: list[t]),
        inner.map(lambda t: t | None),
        inner.map(lambda t: Optional[t]),  # noqa: UP045 - typing's spelling, as old code writes it
    )


TYPES = st.recursive(LEAVES, _nest, max_leaves=3)
SCALAR_VALUES = st.one_of(
    st.booleans(),
    st.integers(-(2**31), 2**31),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.sampled_from(["a", "b", "sgd", 1, 2, 0.5]),
)
TOML_VALUES = st.recursive(SCALAR_VALUES, lambda v: st.lists(v, max_size=3), max_leaves=4)


def fits(tp) -> bool:
    """Whether a TOML value of this type is what the docs say ``tp`` takes (the spec's table)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        return lambda v: any(fits(a)(v) for a in args if a is not type(None))
    if origin is Literal:
        return lambda v: any(type(v) is type(c) and v == c for c in args)
    if origin in (list, tuple):
        return lambda v: isinstance(v, list) and all(fits(args[0])(x) for x in v)
    return {
        int: lambda v: type(v) is int,
        float: lambda v: type(v) in (int, float),
        bool: lambda v: type(v) is bool,
        str: lambda v: type(v) is str,
    }[tp]


def arrived_as(tp, value) -> bool:
    """Whether a checked value is of ``tp`` (ints made floats, arrays made tuples or lists)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        return any(arrived_as(a, value) for a in args if a is not type(None))
    if origin is Literal:
        return value in args
    if origin in (list, tuple):
        return type(value) is origin and all(arrived_as(args[0], x) for x in value)
    return type(value) is tp


def same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b and isinstance(a, bool) == isinstance(b, bool)


@settings(max_examples=400, deadline=None)
@given(TYPES, TOML_VALUES)
def test_a_value_is_taken_as_its_type_exactly_when_it_fits(tp, value):
    if fits(tp)(value):
        got = check_value("--set model.k", tp, value)
        assert arrived_as(tp, got) and same(got, value), (tp, value, got)
    else:
        with pytest.raises(ConfigError) as info:
            check_value("--set model.k", tp, value)
        line = str(info.value)
        assert "\n" not in line and line.startswith("--set model.k "), line
        assert f"(expected {type_name(tp)})" in line or "must be one of" in line, line


@settings(max_examples=100, deadline=None)
@given(
    TYPES.filter(lambda t: t not in (bool, str)), st.sampled_from([math.inf, -math.inf, math.nan])
)
def test_a_float_that_is_not_finite_is_refused(tp, value):
    with pytest.raises(ConfigError):
        check_value("model.k", tp, [value] if typing.get_origin(tp) in (list, tuple) else value)


def test_the_messages_name_the_key_and_what_it_takes():
    def line(tp, value):
        with pytest.raises(ConfigError) as info:
            check_value("--set model.k", tp, value)
        return str(info.value)

    assert line(int, 16.5) == "--set model.k = 16.5 has the wrong type (expected int)"
    assert line(int, True) == "--set model.k = true has the wrong type (expected int)"
    assert line(float, "x") == '--set model.k = "x" has the wrong type (expected float)'
    assert line(float, math.inf) == "--set model.k must be a finite number, got inf"
    assert line(Literal["adamw", "sgd"], "adamv") == (
        '--set model.k must be one of "adamw", "sgd", got "adamv" (did you mean adamw?)'
    )
    assert line(tuple[int, ...], [1, "x"]) == (
        '--set model.k = [1, "x"] has the wrong type (expected array of int)'
    )
    assert line(tuple[int, str], [1]) == (
        "--set model.k = [1] has the wrong type (expected array [int, str])"
    )
    assert line(int | None, "x") == '--set model.k = "x" has the wrong type (expected int | None)'
    assert line(int | str, 1.5) == "--set model.k = 1.5 has the wrong type (expected int | str)"
    assert check_value("k", float, 3) == 3.0 and type(check_value("k", float, 3)) is float
    assert check_value("k", int | float, 3) == 3 and type(check_value("k", int | float, 3)) is int
    assert check_value("k", pathlib.Path, "a/b") == pathlib.Path("a/b")
    assert check_value("k", dict[str, int], {"a": 1}) == {"a": 1}
    assert check_value("k", typing.Any, [1, "x"]) == [1, "x"]


class Kind(enum.Enum):
    DENSE = "dense"
    MOE = "moe"


@dataclasses.dataclass(frozen=True)
class Inner:
    depth: int = 1


@dataclasses.dataclass(frozen=True)
class Odd:
    kind: Kind = Kind.DENSE
    inner: Inner = Inner()
    path: pathlib.Path = pathlib.Path("x.bin")
    limit: int | None = None
    sizes: tuple[int, ...] = (1, 2)


def test_an_enum_a_nested_dataclass_and_none():
    keys = workload_keys(Odd)
    assert check_value("model.kind", keys["kind"].type, "moe") is Kind.MOE
    with pytest.raises(ConfigError, match=r'model.kind must be one of dense, moe, got "mo"'):
        check_value("model.kind", keys["kind"].type, "mo")
    with pytest.raises(ConfigError) as info:
        check_value("model.inner", keys["inner"].type, {"depth": 2})
    assert str(info.value).startswith("model.inner has type Inner, which no TOML value sets")
    assert "leave it out to keep its default" in str(info.value)
    assert keys["limit"].shown_default == "none (leave the key out)"
    assert keys["limit"].type_name == "int | None" and keys["sizes"].type_name == "array of int"


def test_annotations_that_do_not_resolve_are_one_line():
    @dataclasses.dataclass
    class Broken:
        width: NotDefinedAnywhere = 3  # type: ignore[name-defined] # noqa: F821

    with pytest.raises(ConfigError, match=r"Broken: its annotations do not resolve \(NameError"):
        workload_keys(Broken)


@dataclasses.dataclass
class Documented:
    width: int = 32  # features per layer
    depth: int = dataclasses.field(default=2, metadata={"doc": "layers"})  # not this
    heads: int = 4
    """attention heads"""
    bare: int = 1


def test_a_keys_doc_is_its_metadata_its_comment_or_its_docstring():
    docs = {k: v.doc for k, v in workload_keys(Documented).items()}
    assert docs == {"width": "features per layer", "depth": "layers", "heads": "attention heads",
                    "bare": ""}  # fmt: skip
    # a subclass's fields keep the docs written on its base's
    from rrfp.models.vit_vlm import ViTVLMConfig

    vit = workload_keys(ViTVLMConfig)
    assert vit["n_kv_head"].doc.startswith("key/value heads") and vit["enc_layers"].type is int


def test_loading_a_config_reads_no_source_for_the_docs():
    """The docs are the reference pages' (read from the source when asked); a load that checks the
    keys only has every rank pay no tokenizing."""
    from rrfp.app.config import workload_fields

    workload_fields._comment_docs.cache_clear()
    TrainConfig.load(str(ROOT / "configs" / "moe-tiny.toml"), ["model.n_layer=3"], world_size=4)
    assert workload_fields._comment_docs.cache_info().misses == 0


# ---- every built-in model, and a user's Workload ----


def _builtin_models() -> list[str]:
    """Every rrfp/models/*.py that defines a workload, read from the files (so that none is left
    out for failing to import)."""
    files = sorted((ROOT / "rrfp" / "models").glob("*.py"))
    return [p.stem for p in files if re.search(r"^workload = ", p.read_text(), re.M)]


WRONG = {int: 16.5, float: '"fast"', bool: 1, str: 2, list: '"x"'}


def _wrong(tp) -> tuple[str, str]:
    """A --set value of another type than ``tp``, and how the message shows it."""
    base = typing.get_origin(tp) or tp
    value = WRONG[base]
    return str(value), str(value)


def test_every_built_in_model_is_found():
    assert _builtin_models() == known() and len(known()) >= 5


@pytest.mark.parametrize("model", _builtin_models())
def test_every_key_of_a_built_in_model_refuses_a_wrong_type(model):
    wl = find_workload(model)
    for section, kind in (("model", wl.model_config), ("data", wl.data_config)):
        for key in workload_keys(kind).values():
            raw, shown = _wrong(key.type)
            with pytest.raises(ConfigError) as info:
                TrainConfig.load(None, [f"run.model={model}", f"{section}.{key.name}={raw}"], 1)
            assert str(info.value) == (
                f"--set {section}.{key.name} = {shown} has the wrong type "
                f"(expected {key.type_name})"
            )


@pytest.mark.parametrize("model", _builtin_models())
def test_a_built_in_models_wrong_typed_key_is_one_line_and_exit_2(model, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nmodel = "{model}"\n')
    ints = [k for k in workload_keys(find_workload(model).model_config).values() if k.type is int]
    res = rrfp_in_process(
        "train", "--config", str(cfg), "--set", f"model.{ints[0].name}=16.5", "--dry-run"
    )
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr == (
        f"rrfp: error: --set model.{ints[0].name} = 16.5 has the wrong type (expected int)\n"
    )


def test_the_example_workloads_keys_are_checked_from_the_file_too(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nmodel = "examples.my_model"\n[model]\nlayers = "two"\n')
    with pytest.raises(ConfigError) as info:
        TrainConfig.load(cfg, [], world_size=2)
    assert str(info.value) == (f'{cfg}: model.layers = "two" has the wrong type (expected int)')
    cfg.write_text('[run]\nmodel = "examples.my_model"\n[data]\nrows = 16.0\n')
    with pytest.raises(ConfigError, match=r"data.rows = 16.0 has the wrong type"):
        TrainConfig.load(cfg, [], world_size=2)


def test_the_resolved_config_prints_as_toml_that_reads_back(tmp_path, monkeypatch):
    """A path and a None (left out: TOML has no null) in --dry-run's TOML."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the resolver puts tmp_path there
    monkeypatch.setitem(sys.modules, "odd_model", None)  # not imported before: restored after
    del sys.modules["odd_model"]
    source = (ROOT / "examples" / "my_model.py").read_text()
    source = source.replace(
        "class DataConfig:  # the config's [data] section\n",
        "class DataConfig:  # the config's [data] section\n"
        "    path: pathlib.Path = pathlib.Path('a.bin')\n    limit: int | None = None\n",
    )
    (tmp_path / "odd_model.py").write_text("import pathlib\n" + source)
    cfg = TrainConfig.load(None, ["run.model=odd_model.py", "data.path=b.bin"], world_size=2)
    assert cfg.data.path == pathlib.Path("b.bin")
    back = tomllib.loads(toml_text(cfg.as_toml()))
    assert back["data"]["path"] == "b.bin" and "limit" not in back["data"]
    assert fingerprint(cfg)["data"]["path"] == "b.bin"  # what a checkpoint keeps, as JSON


def test_rrfp_config_lists_a_configs_model_and_data_keys():
    res = rrfp_in_process("config", "--config", "examples/my_model.toml")
    assert res.returncode == 0, res.stderr
    tail = res.stdout.split("[model]  ", 1)[1]
    assert tail.startswith("run.model = 'examples.my_model': its examples.my_model.ModelConfig\n")
    assert (
        "  width (int, default 32; examples/my_model.toml sets 32)\n      features of every" in tail
    )
    assert "[data]  run.model = 'examples.my_model': its examples.my_model.DataConfig\n" in tail
    assert "  rows (int, default 16; examples/my_model.toml sets 16)\n" in tail
    res = rrfp_in_process("config", "--config", "configs/gpt-tiny.toml")
    assert "  dropout (float, default 0.0)\n" in res.stdout
    assert '  tokens (str, default "")\n      a token file: nanoGPT\'s flat' in res.stdout
    md = rrfp_in_process("config", "--markdown", "--config", "configs/gpt-tiny.toml").stdout
    assert "| `n_layer` | int | `4` | `4` |  |" in md, md[-2000:]
    bad = rrfp_in_process("config", "--config", "nope.toml")
    assert (bad.returncode, bad.stderr.count("\n")) == (2, 1) and "cannot read config" in bad.stderr
