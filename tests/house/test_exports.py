"""rrfp's public surface (rrfp/__init__.py) is written once, in ``_HOMES``: every name resolves
to the object its home module defines, ``__all__`` and ``dir(rrfp)`` list it, static tools see it,
and the README and docs/embedding.md list exactly it, so adding or dropping a name is a decision
made in the docs too, not an accident (after trio's test_exports.py). Names an embedding user does
not need stay in their subpackages."""

import ast
import importlib
import json
import re
import subprocess
import sys

import pytest
from harness import ROOT

import rrfp

PUBLIC = list(rrfp._HOMES)
# the section of each doc that lists the surface, every name in backticks
LISTS = {"README.md": "## The public surface", "docs/embedding.md": "## The public surface"}


def test_all_is_the_table():
    assert rrfp.__all__ == PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_to_its_home(name):
    home = importlib.import_module(rrfp._HOMES[name])
    assert getattr(rrfp, name) is getattr(home, name)
    namespace = {}
    exec(f"from rrfp import {name}", namespace)
    assert namespace[name] is getattr(home, name)


def listed(doc: str, heading: str) -> set[str]:
    """The names in backticks (``name`` or ``name(args)``) in the bullet list of ``doc``'s section
    under ``heading``: from its first bullet up to the next heading of that level or above."""
    text = ROOT.joinpath(doc).read_text()
    assert heading in text, f"{doc} has no section {heading!r}"
    section = text.split(heading, 1)[1]
    level = heading.split()[0]
    section = re.split(rf"^#{{1,{len(level)}}} ", section, maxsplit=1, flags=re.M)[0]
    bullets = section[section.index("\n- ") :]
    return set(re.findall(r"`(\w+)(?:\([^`]*\))?`", bullets))


@pytest.mark.parametrize("doc", sorted(LISTS))
def test_the_docs_list_the_surface(doc):
    names = listed(doc, LISTS[doc])
    missing, extra = sorted(set(PUBLIC) - names), sorted(names - set(PUBLIC))
    assert not missing and not extra, f"{doc}: not listed {missing}, listed but not public {extra}"


def test_the_docs_check_can_fail():
    """A name dropped from the table is one the docs list and rrfp lacks."""
    assert "ScheduleReady" in listed("README.md", LISTS["README.md"])
    assert "StageTracker" not in listed("docs/embedding.md", LISTS["docs/embedding.md"])


@pytest.mark.parametrize(
    "name, home",
    [
        ("StageTracker", "rrfp.core"),
        ("choose", "rrfp.core"),
        ("Dispatch", "rrfp.core"),
        ("HFStage", "rrfp.hf"),
        ("hf_layer_ranges", "rrfp.hf"),
        ("SplitSummary", "rrfp.pipeline.worker"),
    ],
)
def test_a_name_not_public_stays_in_its_subpackage(name, home):
    assert name not in PUBLIC and not hasattr(rrfp, name)
    assert getattr(importlib.import_module(home), name).__name__ == name


@pytest.mark.e2e
def test_dir_lists_every_public_name():
    """In a fresh interpreter: here the names resolved by other tests are already module globals."""
    out = subprocess.run(
        [sys.executable, "-c", "import rrfp; print(' '.join(dir(rrfp)))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    missing = sorted(set(PUBLIC) - set(out.stdout.split()))
    assert out.returncode == 0 and not missing, f"dir(rrfp) misses {missing} {out.stderr}"


def test_static_tools_see_every_public_name():
    """The TYPE_CHECKING block is what IDEs and type checkers read: it imports every public name
    from the module the lazy table loads it from, and nothing else."""
    tree = ast.parse(ROOT.joinpath("rrfp", "__init__.py").read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    seen = {
        a.asname or a.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    assert seen == rrfp._HOMES


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'rrfp' has no attribute 'SplitLinar'"):
        rrfp.SplitLinar  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rrfp import SplitLinar", {})


# what a rank imports: `rrfp train`'s command and stage_main, and an embedding script's runtime
# and drop-in schedule
RANK_MODULES = ("rrfp.app.train.training", "rrfp.app.cli.main", "rrfp.pipeline", "rrfp.pipelining")
# loaded only by what uses them: saving, loading or checking a checkpoint (DCP), FSDP-sharded
# stages (FSDP, DTensor), torch's PipelineStage (pipelining, which loads dynamo)
UNUSED_BY_A_PLAIN_RANK = (
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch._dynamo",
)


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    """One fresh interpreter (a module already imported here would hide an import): the torch
    modules the pure names load, then the heavy modules a rank's imports load."""
    code = (
        "import json, sys, rrfp, rrfp.core; rrfp.simulate, rrfp.SimConfig, rrfp.SimResult, "
        "rrfp.Variability, rrfp.CostModel, rrfp.run, rrfp.PipelineError, rrfp.planned_config, "
        "rrfp.core.StageTracker, rrfp.core.choose; "
        "pure = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); "
        f"import {', '.join(RANK_MODULES)}; rrfp.PipelineRuntime, rrfp.ScheduleReady, "
        f"rrfp.stage_main; heavy = [m for m in {UNUSED_BY_A_PLAIN_RANK!r} if m in sys.modules]; "
        "print(json.dumps({'pure': pure, 'rank': heavy}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


@pytest.mark.e2e
def test_import_rrfp_loads_no_torch(fresh_imports):
    """The names of the pure core and the simulator answer on a machine without torch."""
    assert fresh_imports["pure"] == []


@pytest.mark.e2e
def test_a_rank_imports_no_checkpoint_fsdp_or_dtensor(fresh_imports):
    """A rank that saves no checkpoint and shards nothing pays for none of these at start-up:
    each is imported where it is used, and isinstance checks against their classes ask
    ``rrfp.comm.loaded_class`` instead."""
    assert fresh_imports["rank"] == [], f"{RANK_MODULES} import {fresh_imports['rank']}"
