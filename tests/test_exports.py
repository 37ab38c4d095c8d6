"""rrfp's public surface (rrfp/__init__.py) is pinned: every name in ``__all__``
resolves to the object its home module defines, ``dir(rrfp)`` lists it, static
tools see it, and the list equals PUBLIC below, so adding or dropping a name is
a decision made here, not an accident (after trio's test_exports.py).
Exported names are a promise: one that is renamed keeps a deprecated alias."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rrfp

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "ColumnParallelLinear",
    "CostModel",
    "Dispatch",
    "IterationResult",
    "PeerFailure",
    "PipelineError",
    "PipelineRuntime",
    "RowParallelLinear",
    "ScheduleReady",
    "SimConfig",
    "SimResult",
    "SplitLinear",
    "SplitSummary",
    "StageExecutor",
    "StageTracker",
    "StageWorker",
    "StepReport",
    "TrainConfig",
    "TrainSummary",
    "Variability",
    "Workload",
    "choose",
    "group_size_rank",
    "planned_config",
    "run",
    "shard_from_full",
    "simulate",
    "stage_main",
    "token_features",
    "calibrate",
    "HFStage",
    "build_hf_model",
    "build_hf_stage",
    "hf_config",
    "hf_layer_ranges",
    "hf_ties",
]


def test_all_is_the_pinned_list():
    assert len(set(rrfp.__all__)) == len(rrfp.__all__), "a name is listed twice in rrfp.__all__"
    added, dropped = (
        sorted(set(rrfp.__all__) - set(PUBLIC)),
        sorted(set(PUBLIC) - set(rrfp.__all__)),
    )
    assert not added and not dropped, f"rrfp.__all__ changed: added {added}, dropped {dropped}"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_to_its_home(name):
    home = importlib.import_module(rrfp._HOMES[name])
    assert getattr(rrfp, name) is getattr(home, name)
    namespace = {}
    exec(f"from rrfp import {name}", namespace)
    assert namespace[name] is getattr(home, name)


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
RANK_MODULES = ("rrfp.app.train", "rrfp.app.cli", "rrfp.pipeline", "rrfp.pipelining")
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
        "import json, sys, rrfp; rrfp.simulate, rrfp.SimConfig, rrfp.SimResult, rrfp.Variability, "
        "rrfp.CostModel, rrfp.Dispatch, rrfp.choose, rrfp.StageTracker, rrfp.run, "
        "rrfp.PipelineError; pure = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'); "
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
