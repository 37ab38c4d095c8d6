"""``output.routing``: a short moe-tiny run (pp 2 x dp 2 on 4 gloo ranks) records every MoE layer's
tokens per expert by step, stage, microbatch and replica, and ``rrfp sim --routing`` replays it.

Each row's copies are its microbatch's tokens times top-k (the layers are dropless), so a row
filed under the wrong microbatch (of another length) or the wrong replica fails here."""

from __future__ import annotations

import json

import pytest
from harness.distributed import run_ranks
from harness.moe_tiny_run import CONFIG, short_run

from rrfp.app.cli.main import main

pytestmark = pytest.mark.multirank

STEPS, M, DP = 2, 4, 2
SETS = [*short_run(STEPS), "output.dir="]


def _train(rank, world, path):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    cfg = TrainConfig.load(CONFIG, [*SETS, f"output.routing={path}"], world_size=world)
    run(stage_main(cfg))


@pytest.mark.timeout(400)
def test_a_recorded_routing_is_every_microbatchs_and_replays(tmp_path):
    from rrfp.app.config.train_config import TrainConfig

    path = tmp_path / "routing.jsonl"
    run_ranks(_train, 4, str(path), timeout=240)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cfg = TrainConfig.load(CONFIG, SETS, world_size=4)
    k, experts = cfg.model.moe_top_k, cfg.model.moe_experts
    # the first block is dense: stage 0 holds one MoE layer, stage 1 two
    layers = {0: 1, 1: 2}
    assert len(rows) == STEPS * M * DP * sum(layers.values())
    seen = {(r["step"], r["stage"], r["microbatch"], r["layer"], r["replica"]) for r in rows}
    assert len(seen) == len(rows)
    for r in rows:
        assert r["layer"] < layers[r["stage"]] and r["ep"] == 1 and len(r["tokens"]) == experts
    lengths = set()
    for step in range(STEPS):
        data = cfg.workload.microbatches(cfg.data, step, M * DP)
        for r in (r for r in rows if r["step"] == step):
            x, _ = data[r["replica"] * M + r["microbatch"]]
            lengths.add(x.numel())
            assert sum(r["tokens"]) == x.numel() * k, r
    assert len(lengths) > 1  # microbatches of several lengths: a misfiled row would show

    out = tmp_path / "sim.json"
    assert main(["sim", "--routing", str(path), "--ep", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["pp"], doc["n_microbatches"], doc["seeds"], doc["preset"]) == (2, M, STEPS, "moe")
    base = next(r for r in doc["rows"] if (r["dispatch"], r["hint"]) == ("fixed", "1f1b"))
    assert base["speedups"] == [1.0] * STEPS
    # recorded loads over 4 EP ranks: microbatches differ, so the replayed makespans are not the
    # balanced pipeline's
    assert main(["sim", "--routing", str(path), "--ep", "1", "--json", str(out)]) == 0
    balanced = next(
        r
        for r in json.loads(out.read_text())["rows"]
        if (r["dispatch"], r["hint"]) == ("fixed", "1f1b")
    )
    assert base["makespans"] != balanced["makespans"]
