"""The planned hint: a valid order on every stage, never deadlocks, and never worse
than plain BFW on the durations it was planned for."""
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp.core.hints import Hint, resolve, validate
from rrfp.core.planner import candidate_orders, entry_order_hint
from rrfp.core.variability import Variability
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planning import planned_config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=st.integers(1, 6), M=st.integers(1, 16), preset=st.sampled_from(["lang", "mm", "jitter"]),
       seed=st.integers(0, 10_000), budget=st.sampled_from(["1x", "2x", "3"]))
def test_plan_is_valid_and_never_worse_than_bfw_on_predicted_durations(S, M, preset, seed, budget):
    cfg = SimConfig(S, M, resolve("plan"), "ready", budget, Variability.preset(preset), seed=seed)
    planned, made = planned_config(cfg)
    assert sorted(made.order) == list(range(M))
    for s in range(S):
        validate(planned.hint.order(S, s, M, True), M, True, where=f"plan stage {s}")
    assert made.predicted_makespan <= made.bfw_makespan + 1e-9
    known = replace(cfg.variability, jitter=0.0, straggler_p=0.0, comm_jitter=0.0)
    bfw = simulate(replace(cfg, hint=resolve("bfw"), variability=known)).makespan
    assert abs(made.bfw_makespan - bfw) < 1e-9, "the first candidate is plain BFW"
    simulate(planned)  # the real durations (jitter, stragglers): runs to the end, no deadlock


def test_candidates_cover_the_cost_orders():
    import numpy as np

    cands = candidate_orders(np.array([1.0, 5.0, 3.0]))
    assert cands[0] == (0, 1, 2) and (1, 2, 0) in cands and (0, 2, 1) in cands
    hint = Hint("plan", entry_order_hint((2, 0, 1)), is_class=True)
    assert [str(t) for t in hint.fn(2, 0, 3, True)][:3] == ["B2", "B0", "B1"]


def test_sim_shows_the_planned_row_with_its_planning_time():
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "rrfp", "sim", "--pp", "4", "--mb", "8", "--seeds", "2", "--json", "-"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {(r["executor"], r["hint"]): r for r in json.loads(p.stdout)["rows"]}
    assert rows[("ready", "plan")]["median_plan_ms"] > 0 and "plan" in p.stderr
