"""The simulator's per-seed makespans are pinned: a refactor that changes one
decision of any executor x hint fails here. The file comes from
tests/golden/make_sim_golden.py, run on the commit before the state-machine
refactor; regenerate it only for an intended behaviour change."""

import json

import pytest
from harness import ROOT

from rrfp.app.cli.main import main

GOLDEN = json.loads((ROOT / "tests" / "golden" / "sim_makespans.json").read_text())


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: " ".join(c["args"][1::2]))
def test_makespans_match_golden(case, tmp_path):
    out = tmp_path / "r.json"
    assert main([*["sim"], *case["args"], "--json", str(out)]) == 0
    rows = {
        f"{r['dispatch']} {r['hint']}": r["makespans"] for r in json.loads(out.read_text())["rows"]
    }
    assert (
        case["makespans"].keys() <= rows.keys()
    )  # rows added since (the planned hint) are new, not changed
    for key, want in case["makespans"].items():
        assert rows[key] == pytest.approx(want, abs=1e-9, rel=0), key
