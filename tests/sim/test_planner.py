"""The planned hint: a valid order on every stage, never deadlocks, and never worse
than plain BFW on the durations it was planned for."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.durations import known
from rrfp.core.entry_order import candidate_orders, entry_order_hint
from rrfp.core.hints import Hint, resolve, validate
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import planned_config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 16),
    preset=st.sampled_from(["lang", "mm", "jitter"]),
    seed=st.integers(0, 10_000),
    budget=st.sampled_from(["1x", "2x", "3"]),
    dispatch=st.sampled_from(["ready", "fixed"]),
)
def test_plan_is_valid_and_never_worse_than_bfw_on_predicted_durations(
    S, M, preset, seed, budget, dispatch
):
    cfg = SimConfig(S, M, resolve("plan"), dispatch, budget, Variability.preset(preset), seed=seed)
    planned, made = planned_config(cfg)
    if dispatch == "fixed":  # plan, then replay: on the predicted durations the replay is the plan
        seen = known(cfg.variability)
        replayed = simulate(replace(planned, variability=seen)).makespan
        assert abs(replayed - made.predicted_makespan) < 1e-9, (replayed, made.predicted_makespan)
    assert sorted(made.order) == list(range(M))
    for s in range(S):
        validate(planned.hint.order(S, s, M, True), M, True, where=f"plan stage {s}")
    assert made.predicted_makespan <= made.bfw_makespan + 1e-9
    seen = known(cfg.variability)
    bfw = simulate(replace(cfg, hint=resolve("bfw"), dispatch="ready", variability=seen)).makespan
    assert abs(made.bfw_makespan - bfw) < 1e-9, (
        "the first candidate is plain BFW (scored under ready dispatch)"
    )
    simulate(planned)  # the real durations (jitter, stragglers): runs to the end, no deadlock


def test_candidates_start_plain_then_put_long_microbatches_in_the_middle():
    import numpy as np

    from rrfp.core.entry_order import pyramid

    cost = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    cands = candidate_orders(cost)
    assert cands[0] == (0, 1, 2, 3, 4)
    assert (0, 2, 1, 3, 4) in cands and pyramid(cost, 0.5) == (0, 2, 1, 3, 4)
    for order in cands[1:]:  # a pyramid: costs rise to the peak, then fall
        c = cost[list(order)]
        top = int(np.argmax(c))
        assert all(np.diff(c[: top + 1]) > 0) and all(np.diff(c[top:]) < 0), order
    hint = Hint("plan", entry_order_hint((2, 0, 1)), is_class=True)
    assert [str(t) for t in hint.fn(2, 0, 3, True)][:3] == ["B2", "B0", "B1"]


def test_sim_shows_the_planned_row_with_its_planning_time():
    import json

    from harness.cli_run import rrfp_in_process

    p = rrfp_in_process("sim", "--pp", "4", "--n-microbatches", "8", "--seeds", "2", "--json", "-")
    assert p.returncode == 0, p.stderr
    rows = {(r["dispatch"], r["hint"]): r for r in json.loads(p.stdout)["rows"]}
    assert rows[("ready", "plan")]["median_plan_ms"] > 0 and "plan" in p.stderr


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_train_plans_each_step_one_ahead_and_matches_bfw_losses(tmp_path):
    """`rrfp train` with hint = plan under lang: every step follows its own plan (made in a
    thread one step ahead), and the losses are BFW's: the order moves, the results do not."""
    import re
    import time

    from harness.train_rows import TrainJob

    def train(hint: str) -> TrainJob:
        sets = ["pp=2", f"hint={hint}", "preset=lang", "unit_ms=2", "steps=4", "log_every=1"]
        argv = ["--config", "configs/gpt-tiny.toml", "--set", "model.n_layer=2"]
        return TrainJob(tmp_path / hint, argv + [a for s in sets for a in ("--set", s)])

    planned, plain = jobs = train("plan"), train("bfw")
    try:
        for job in jobs:
            assert job.wait((0, 1), time.monotonic() + 170), job.err(0)[-2000:]
            assert [job.code(0), job.code(1)] == [0, 0], job.err(0)[-2000:] + job.err(1)[-2000:]
    finally:
        for job in jobs:
            job.kill()
    assert re.search(r"plan: \d+\.\d ms per step", planned.out(0)), planned.out(0)
    losses = [[float(x) for x in re.findall(r"loss (\d+\.\d+)", j.out(0))] for j in jobs]
    assert len(losses[0]) == 5 and losses[0] == losses[1], losses  # 4 steps and the done line
