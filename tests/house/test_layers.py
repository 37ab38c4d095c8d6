"""Imports point down the layers, no module imports itself in a circle, and
what sits on top of rrfp (rrfp/models/, examples/, benchmarks/) uses only
its public surface, ``rrfp/__init__.py``, and the built-in models.

Every import in rrfp/ is read with ast (function-level ones
included), so a lazy import cannot hide an upward edge. The layers and what
each may import are written down once, here and in docs/design.md.
"""

import ast
import functools
from pathlib import Path

import pytest
from harness import ROOT

# the library layers, below the app
LIBRARY = {
    "rrfp.core",
    "rrfp.observe",
    "rrfp.sim",
    "rrfp.loop",
    "rrfp.comm",
    "rrfp.nn",
    "rrfp.pipeline",
    "rrfp.hf",
}
APP_ROOMS = {"rrfp.app", "rrfp.app.config", "rrfp.app.job", "rrfp.app.train", "rrfp.app.bench"}

# layer -> the layers it may import (its own modules always)
ALLOWED = {
    "rrfp.core": set(),
    "rrfp.observe": {"rrfp.core"},
    "rrfp.sim": {"rrfp.core", "rrfp.observe"},
    "rrfp.loop": set(),
    "rrfp.comm": {"rrfp.core", "rrfp.loop"},
    "rrfp.nn": set(),
    "rrfp.pipeline": {
        "rrfp.core",
        "rrfp.observe",
        "rrfp.sim",
        "rrfp.loop",
        "rrfp.comm",
        "rrfp.nn",
    },  # sim: planning
    # HuggingFace causal LMs as stages: above the pipeline (nothing of it needed yet), below the app
    "rrfp.hf": {
        "rrfp.core",
        "rrfp.observe",
        "rrfp.sim",
        "rrfp.loop",
        "rrfp.comm",
        "rrfp.nn",
        "rrfp.pipeline",
    },
    # the app, in rooms: its root (errors, fault injection) is shared by every room; each room
    # imports the rooms below it: config < job < train < bench < cli
    "rrfp.app": LIBRARY,
    "rrfp.app.config": LIBRARY | {"rrfp.app"},
    "rrfp.app.job": LIBRARY | {"rrfp.app", "rrfp.app.config"},
    "rrfp.app.train": LIBRARY | {"rrfp.app", "rrfp.app.config", "rrfp.app.job"},
    "rrfp.app.bench": LIBRARY
    | {"rrfp.pipelining", "rrfp.app", "rrfp.app.config", "rrfp.app.job"},  # the drop-in
    "rrfp.app.cli": LIBRARY | {"rrfp.pipelining", *APP_ROOMS},
    # torch.distributed.pipelining's schedule surface over the runtime: user-facing glue beside app
    "rrfp.pipelining": {"rrfp.core", "rrfp.loop", "rrfp.comm", "rrfp.pipeline"},
    "rrfp": LIBRARY
    | {
        "rrfp.pipelining",
        "rrfp.app.cli",
        *APP_ROOMS,
    },  # the package's own __init__ and __main__: the public surface
    # the built-in models: the public surface only (test_top_uses_only_the_public_surface); no
    # layer imports them (the registry finds them by name at run time)
    "rrfp.models": {"rrfp"},
}
TOP = ("rrfp/models", "examples", "benchmarks")  # code on top of rrfp: the public surface only
MODELS = "rrfp.models"  # what the top may import besides the public surface


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The longest ALLOWED key that is ``module`` or a package above it."""
    best = None
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and (
            best is None or len(layer) > len(best)
        ):
            best = layer
    return best


def imports(path: Path) -> set[str]:
    """Absolute names of the project modules ``path`` imports."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] == "rrfp"}


SOURCES = sorted(ROOT.joinpath("rrfp").rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES}


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports of rrfp's modules. Read on first use, not at collection, where every
    test process of `make test` would parse all of rrfp (about 1.7 CPU-s) for the one that runs
    these tests."""
    return {module_name(p): {m for m in imports(p) if m in MODULES} for p in SOURCES}


def test_every_module_has_a_layer():
    assert SOURCES, "no sources found"
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"modules outside every layer: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = layer_of(module)
    bad = sorted(
        dep
        for dep in graph()[module]
        if layer_of(dep) != mine
        and layer_of(dep) not in ALLOWED[mine]
        and not (mine == "rrfp" and dep == "rrfp")
    )
    assert not bad, f"{module} ({mine}) imports from a higher or unrelated layer: {bad}"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path, or None. An edge from a module to its own
    package (``rrfp.loop.lane`` -> ``rrfp.loop``) is not a cycle of files."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if dep == m or m.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "rrfp.pipeline" not in ALLOWED[layer_of("rrfp.core.tracker")]
    assert layer_of("rrfp.models.gpt") == "rrfp.models"
    assert layer_of("rrfp.app.cli.main") == "rrfp.app.cli"
    assert layer_of("rrfp.app.errors") == "rrfp.app"
    assert "rrfp.app.cli" not in ALLOWED[layer_of("rrfp.app.train.training")]


def _assigned(path: Path, name: str):
    """The literal value of the module-level ``name = ...`` in ``path`` (read, not imported), or
    None."""
    tree = ast.parse(path.read_text())
    return next(
        (
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ),
        None,
    )


def public_names() -> set[str]:
    """rrfp's public surface, the keys of ``rrfp._HOMES`` (``__all__`` is made from it)."""
    return set(_assigned(ROOT / "rrfp" / "__init__.py", "_HOMES"))


def subpackage_surfaces() -> dict[str, set[str]]:
    """Each subpackage's own surface, ``rrfp.core`` -> its ``__all__``: where the names that
    ``rrfp`` does not export stay reachable."""
    found = {}
    for init in sorted(ROOT.joinpath("rrfp").glob("*/__init__.py")):
        names = _assigned(init, "__all__")
        if names is not None:
            found[f"rrfp.{init.parent.name}"] = set(names)
    return found


def _deep(module: str) -> bool:
    """``module`` is inside rrfp and neither its root nor the built-in models."""
    return module.startswith("rrfp.") and not (module == MODELS or module.startswith(MODELS + "."))


def deep_uses(
    source: str, public: set[str], subpackages: dict[str, set[str]] | None = None
) -> list[str]:
    """Where ``source`` reaches past rrfp's public surface: ``import rrfp.x``, ``from rrfp.x import
    y``, ``from rrfp import name`` for a name not in ``public``, and ``rrfp.name`` for one not in
    it. No such reach: the built-in models (``rrfp.models``), and ``from rrfp.sub import name`` for
    a name in ``subpackages["rrfp.sub"]``, a subpackage's own surface."""
    subpackages = subpackages or {}
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [(line, f"import {a.name}") for a in node.names if _deep(a.name)]
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "rrfp"
        ):
            if node.module in subpackages:
                found += [
                    (line, f"from {node.module} import {a.name}")
                    for a in node.names
                    if a.name not in subpackages[node.module]
                ]
            elif _deep(node.module):
                found.append((line, f"from {node.module} import ..."))
            elif node.module == "rrfp":
                found += [
                    (line, f"from rrfp import {a.name}") for a in node.names if a.name not in public
                ]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "rrfp"
            and node.attr not in public
            and node.attr != "models"
            and not node.attr.startswith("__")
        ):
            found.append((line, f"rrfp.{node.attr}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


# the GPU acceptance check drives the runtime's parts (lane, poller, channels) on a real device, as
# the tests drive them on the CPU: it sits beside the benchmarks, but reaches where the tests reach
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
TOP_SOURCES = sorted(
    p for folder in TOP for p in ROOT.joinpath(folder).rglob("*.py") if p != GPU_CHECK
)


@pytest.mark.parametrize("path", TOP_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_top_uses_only_the_public_surface(path):
    """Models, examples and benchmarks use ``import rrfp; rrfp.X`` or ``from rrfp import X``, X in
    ``rrfp.__all__``, or a subpackage's own surface (``from rrfp.core import StageTracker``): what
    they need is what an embedding user gets, and the internals stay free to move."""
    deep = deep_uses(path.read_text(), public_names(), subpackage_surfaces())
    assert not deep, f"{path.relative_to(ROOT)} reaches past rrfp's public surface: {deep}"


def test_the_surface_check_can_fail():
    public = public_names()
    assert {"SplitLinear", "PipelineRuntime", "simulate"} <= public and "StageTracker" not in public
    assert TOP_SOURCES and {p.parts[-2] for p in TOP_SOURCES} >= {Path(t).name for t in TOP}
    deep = deep_uses(
        "import rrfp\nimport rrfp.sim\nfrom rrfp.nn.split_linear import SplitLinear\n"
        "from rrfp import SplitLinear, _HOMES\nx = rrfp.pipeline.worker\ny = rrfp.simulate\n"
        "z = rrfp.__file__\nfrom rrfp.models.gpt import GPT\nimport rrfp.models.data\n"
        "w = rrfp.models\nfrom rrfp.core import StageTracker, RankTracker\n"
        "from rrfp.core import drive\n",
        public,
        {"rrfp.core": {"StageTracker", "RankTracker"}},
    )
    assert deep == [
        "line 2: import rrfp.sim",
        "line 3: from rrfp.nn.split_linear import ...",
        "line 4: from rrfp import _HOMES",
        "line 5: rrfp.pipeline",
        "line 12: from rrfp.core import drive",
    ], deep
    assert {"StageTracker", "choose"} <= subpackage_surfaces()["rrfp.core"]


@pytest.mark.e2e
def test_core_and_sim_load_without_torch():
    """The pure core and the simulator answer what-if questions on a machine without torch."""
    import subprocess
    import sys

    code = (
        "import sys, rrfp, rrfp.core, rrfp.sim; rrfp.simulate, rrfp.SimConfig, rrfp.Variability, "
        "rrfp.core.choose; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
