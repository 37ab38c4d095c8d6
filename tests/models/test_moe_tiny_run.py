"""``configs/moe-tiny.toml`` trains as its comment says (4 CPU ranks, pp 2 x dp 2, experts
local): the loss falls, and every step's router statistics are in the step line and in
metrics.jsonl (the auxiliary loss, the expert load's max over mean, no dropped tokens). The ranks
are children of the preloaded forkserver (tests/harness/train_rows.py); the comment's command
line itself is tests/house/test_config_comments.py's."""

from __future__ import annotations

import json

import pytest
from harness.train_rows import TrainJob

pytestmark = pytest.mark.e2e

# enough for the loss to fall by more than 0.5 (5.57 to 4.71); each step's statistics are checked
# alike, so more steps repeat the same checks
STEPS = 4


@pytest.mark.timeout(400)
def test_moe_tiny_trains_with_its_router_statistics(tmp_path):
    sets = [f"run.steps={STEPS}", f"output.dir={tmp_path / 'runs' / '{model}'}"]
    args = [a for s in sets for a in ("--set", s)]
    job = TrainJob(tmp_path / "job", ["--config", "configs/moe-tiny.toml", *args], world=4)
    assert job.finish(390).codes() == [0, 0, 0, 0], job.tails()
    steps = [line for line in job.out(0).splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS and all("  aux loss " in s and "max/mean" in s for s in steps)
    (folder,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["dropped_tokens"] == 0
        assert 0 < r["aux_loss"] < 1, r  # coeff 0.01 x 3 MoE blocks x a balance >= 1
        assert 1 <= r["expert_load_max_over_mean"] <= 8 / 2, r  # at most E / k
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]
