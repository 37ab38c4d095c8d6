"""The planned hint plans on honest inputs: a real-time run without a cost model is
refused, the planner never sees the noise it cannot know (whatever path plans it),
a replay of a planned run replays its plans, and calibration measures where the
run computes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch
from harness.cli_run import CONFIG, assert_usage_error, rrfp, rrfp_in_process
from harness.synthetic_costs import synthetic

import rrfp.core.variability as variability
from rrfp.app.cli.calibrate_command import calibration_device
from rrfp.app.config.sections import ComputeSection
from rrfp.app.config.train_config import ConfigError, TrainConfig
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.pipeline.plan_ahead import IterationPlanner
from rrfp.sim import SimConfig, simulate
from rrfp.sim.planned_hint import plan_iteration, planned_config
from rrfp.sim.replay import replay


def test_train_refuses_plan_on_made_up_costs_in_real_time(tmp_path):
    """unit_ms = 0 and no cost model: the preset's lengths have nothing to do with the compute."""
    res = rrfp("--config", CONFIG, "--set", "hint=plan", world=4)
    assert_usage_error(
        res,
        "schedule.hint = plan",
        "emulation.unit_ms = 0",
        "rrfp calibrate",
        "emulation.cost = FILE",
    )
    with pytest.raises(ConfigError, match="schedule.hint = plan"):
        TrainConfig.load(CONFIG, ["hint=plan", "preset=lang"], world_size=4)
    TrainConfig.load(CONFIG, ["hint=plan", "unit_ms=2"], world_size=4)  # a deliberate emulation
    cost = tmp_path / "cost.json"
    cost.write_text(CostModel.fit(synthetic(stages=4)[1]).to_json())
    TrainConfig.load(
        CONFIG, ["hint=plan", f"cost={cost}"], world_size=4
    )  # real time, planned on the cost model


S, M, SEED, STEP = 5, 10, 7, 3


def _plans(var: Variability, cost: CostModel, features: list[dict]) -> dict:
    """Every way a plan is made, and what it decided."""
    out = {}
    for dispatch in ("ready", "fixed"):  # rrfp sim and its sweep
        cfg, made = planned_config(
            SimConfig(S, M, "plan", dispatch, "2x", var, seed=SEED, iteration=STEP)
        )
        out[f"sim {dispatch}"] = (made.order, made.predicted_makespan, cfg.hint.fixed_rank_orders)

    async def runtime(times: TaskTimes, feats) -> tuple:  # the executor's planner thread
        planner = IterationPlanner(times, S, M, Budget.parse("2x"), Dispatch.READY)
        try:
            hint, report = await planner.hint(STEP, feats)
            return report.plan.order, report.plan.predicted_makespan
        finally:
            planner.close()

    out["runtime, preset"] = asyncio.run(runtime(TaskTimes(var, SEED, True), None))
    out["runtime, cost model"] = asyncio.run(runtime(TaskTimes(var, SEED, True, cost), features))
    # rrfp sim --replay and the bench's simulated column plan through this
    made = plan_iteration(
        TaskTimes(var, SEED, True, cost), STEP, S, M, Budget.parse("1x"), Dispatch.FIXED, features
    )[1]
    out["replay, bench"] = (made.order, made.predicted_makespan)
    return out


def test_hidden_noise_never_reaches_the_plan(monkeypatch):
    """Change only what cannot be known before an iteration runs (the jitter, straggler and
    link-jitter draws and how large they are): the realized durations change, every plan stays the
    same."""
    var = Variability.preset("lang", slow_stage=2, slow_factor=1.5, comm_jitter=0.2)
    cost = CostModel.fit(synthetic(stages=S)[1])
    features = [
        {"tokens": 40.0 * (1 + m % 4), "attn": 1600.0 * (1 + m % 4) ** 2, "patches": 0.0}
        for m in range(M)
    ]
    before = _plans(var, cost, features)
    realized = TaskTimes(var, SEED, True, cost).realized(STEP, S, M, features)

    for salt, value in (("_S_JITTER_A", 101), ("_S_STRAGGLE", 102), ("_S_COMM_A", 103)):
        monkeypatch.setattr(variability, salt, value)
    noisier = replace(var, jitter=0.9, straggler_p=0.4, straggler_x=6.0, comm_jitter=0.8)
    assert not np.allclose(
        TaskTimes(noisier, SEED, True, cost).realized(STEP, S, M, features), realized
    )
    assert not np.allclose(
        TaskTimes(noisier, SEED, True).latencies(STEP, S, M)[0],
        TaskTimes(var, SEED, True).latencies(STEP, S, M)[0],
    )
    after = _plans(noisier, cost, features)
    assert after == before
    assert len({v[0] for v in before.values()}) > 1, (
        "the paths plan different inputs: each is a real check"
    )


def test_a_config_that_carries_durations_is_not_planned_from_them():
    cfg = SimConfig(3, 6, "plan", "ready", "2x", Variability.preset("lang"), seed=1)
    dur = TaskTimes(cfg.variability, 1, True).realized(0, 3, 6)
    with pytest.raises(ValueError, match="carries its own durations"):
        planned_config(replace(cfg, durations=dur.tolist()))


def test_replay_of_a_planned_run_follows_each_steps_plan():
    """`rrfp sim --replay` of a hint = plan run: each step planned from its features as the ranks
    planned it, then simulated on the realized durations; not the plain BFW order."""
    model = CostModel.fit(synthetic(stages=2)[1])
    var = Variability.preset("lang")
    steps = [
        [{"tokens": float(t), "attn": float(t * t), "patches": 0.0} for t in sizes]
        for sizes in ([64, 512, 32, 480, 96, 400, 48, 320], [500, 40, 450, 60, 30, 420, 380, 20])
    ]
    doc = {
        "pp": 2,
        "n_microbatches": 8,
        "seed": 3,
        "preset": "lang",
        "hint": "plan",
        "dispatch": "ready",
        "budget": "2x",
        "split": True,
        "unit_ms": 10.0,
        "features": steps,
        "step_wall_s": [1.0, 1.0],
    }
    got = replay(doc, model)
    plain = replay({**doc, "hint": "bfw"}, model)
    budget, times = Budget.parse("2x"), TaskTimes(var, 3, True, model)
    differs = 0
    for (step, sim_ms, _), (_, bfw_ms, _), feats in zip(got, plain, steps):
        hint, made = plan_iteration(times, step, 2, 8, budget, Dispatch.READY, feats)
        realized = times.realized(step, 2, 8, feats)
        want = (
            simulate(
                SimConfig(
                    2,
                    8,
                    hint,
                    "ready",
                    budget,
                    var,
                    seed=3,
                    iteration=step,
                    durations=realized.tolist(),
                )
            ).makespan
            * 10.0
        )
        assert sim_ms == pytest.approx(want, rel=1e-12), step
        differs += made.order != tuple(range(8)) and sim_ms != pytest.approx(bfw_ms, rel=1e-9)
    assert differs, "the plans should move some step away from plain BFW, else this checks nothing"


def test_calibrate_measures_on_the_runs_device():
    assert calibration_device(ComputeSection()) == torch.device("cpu")
    assert calibration_device(ComputeSection(device="cpu")) == torch.device("cpu")
    assert calibration_device(ComputeSection(backend="nccl")) == torch.device("cuda")
    assert calibration_device(ComputeSection(backend="nccl", device="cuda")) == torch.device("cuda")
    if torch.cuda.is_available():
        # the CPU-only refusal below does not apply; scripts/gpu_check.py calibrates on the GPU
        return
    p = rrfp_in_process(
        "calibrate",
        "--config",
        "configs/gpt-tiny.toml",
        "--pp",
        "2",
        "--samples",
        "2",
        "--set",
        "backend=nccl",
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "needs CUDA" in p.stderr, p.stderr
