"""Imports point down the layers, and no module imports itself in a circle.

Every import in rrfp/ and models/ is read with ast (function-level ones
included), so a lazy import cannot hide an upward edge. The layers and what
each may import are written down once, here and in docs/design.md.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers it may import (its own modules always)
ALLOWED = {
    "rrfp.core": set(),
    "rrfp.observe": {"rrfp.core"},
    "rrfp.sim": {"rrfp.core", "rrfp.observe"},
    "rrfp.loop": set(),
    "rrfp.comm": {"rrfp.core", "rrfp.loop"},
    "rrfp.nn": set(),
    "rrfp.pipeline": {"rrfp.core", "rrfp.observe", "rrfp.sim", "rrfp.loop", "rrfp.comm", "rrfp.nn"},  # sim: planning
    "rrfp.app": {"rrfp.core", "rrfp.observe", "rrfp.sim", "rrfp.loop", "rrfp.comm", "rrfp.nn", "rrfp.pipeline"},
    "rrfp": {"rrfp.core", "rrfp.observe", "rrfp.sim", "rrfp.loop", "rrfp.comm", "rrfp.nn", "rrfp.pipeline",
             "rrfp.app"},  # the package's own __init__ and __main__: the public surface
    "models": {"rrfp.core", "rrfp.nn", "rrfp.pipeline"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The longest ALLOWED key that is ``module`` or a package above it."""
    best = None
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
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
    return {m for m in found if m.split(".")[0] in ("rrfp", "models")}


SOURCES = sorted([*ROOT.joinpath("rrfp").rglob("*.py"), *ROOT.joinpath("models").rglob("*.py")])
MODULES = {module_name(p) for p in SOURCES}
GRAPH = {module_name(p): {m for m in imports(p) if m in MODULES} for p in SOURCES}


def test_every_module_has_a_layer():
    assert SOURCES, "no sources found"
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, f"modules outside every layer: {missing}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    mine = layer_of(module)
    bad = sorted(dep for dep in GRAPH[module]
                 if layer_of(dep) != mine and layer_of(dep) not in ALLOWED[mine]
                 and not (mine == "rrfp" and dep == "rrfp"))
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
                return stack[stack.index(dep):] + [dep]
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
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "rrfp.pipeline" not in ALLOWED[layer_of("rrfp.core.tracker")]
    assert layer_of("models.gpt") == "models" and layer_of("rrfp.app.cli") == "rrfp.app"


def test_core_and_sim_load_without_torch():
    """The pure core and the simulator answer what-if questions on a machine without torch."""
    import subprocess
    import sys

    code = "import sys, rrfp.core, rrfp.sim; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
