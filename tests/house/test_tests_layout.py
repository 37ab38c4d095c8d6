"""tests/ as the package's mirror: each test file sits in the folder of the rrfp/ folder it tests
(or house/, for the repository itself), code shared between test files lives in tests/harness/,
never in a test file another one imports, and test file names are unique (pytest imports a test
file by its name, its folder put first on sys.path)."""

from __future__ import annotations

import ast
from collections import Counter

from harness import ROOT

TESTS = ROOT / "tests"
OWN = {"harness", "house", "fixtures", "golden", "__pycache__"}


def _test_files():
    return sorted(TESTS.rglob("test_*.py"))


def _imported(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_file_imports_another():
    tests = {p.stem for p in _test_files()}
    shared = sorted(TESTS.glob("harness/*.py"))
    found = {
        str(p.relative_to(ROOT)): sorted(n for n in _imported(p) if n.split(".")[-1] in tests)
        for p in [*_test_files(), *shared]
    }
    found = {path: names for path, names in found.items() if names}
    assert not found, f"test files imported (move what they share to tests/harness/): {found}"


def test_test_file_names_are_unique():
    twice = [name for name, n in Counter(p.name for p in _test_files()).items() if n > 1]
    assert not twice, f"test file names used twice: {twice}"


def test_every_test_folder_mirrors_a_package_folder():
    package = {p.relative_to(ROOT / "rrfp") for p in (ROOT / "rrfp").rglob("*") if p.is_dir()}
    folders = {p.parent.relative_to(TESTS) for p in _test_files()}
    stray = sorted(
        str(f) for f in folders if f.parts and f.parts[0] not in OWN and f not in package
    )
    assert not stray, f"test folders with no rrfp/ folder of that name: {stray}"
    assert not any(p.parent == TESTS for p in _test_files()), "a test file at the top of tests/"
