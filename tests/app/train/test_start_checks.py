"""The checks at start (issue 17, point 2): the memory estimate is a lower bound
of what a run really holds (so it refuses only what cannot fit), every config in
configs/ passes both checks, and a timeout below 3 x the predicted step gets a
line that says what to raise it to."""

from __future__ import annotations

import pytest
import torch
from harness import ROOT

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.train.start_checks import (
    check_byte_budget,
    check_memory,
    check_timeout,
    footprints,
    predicted_step_s,
)
from rrfp.core.placement import VirtualLayout
from rrfp.pipeline.worker import StageWorker

SHIPPED = sorted((ROOT / "configs").glob("*.toml"))
# configs for GPUs (bf16 autocast, the auto backend), too big for this machine's checks
GPU = [p for p in SHIPPED if p.name in ("llama-1b.toml", "moe-1b.toml")]
CONFIGS = [p for p in SHIPPED if p not in GPU]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_passes_both_checks(path):
    cfg = TrainConfig.load(path, [], world_size=4)
    prints = check_memory(cfg)  # this machine's memory: no refusal; the footprints it checked
    assert prints is not None and all(f.state > 0 and f.activations > 0 for f in prints), prints
    assert check_timeout(cfg) is None
    emulated = TrainConfig.load(path, ["unit_ms=20"], world_size=4)  # as the examples emulate time
    assert predicted_step_s(emulated) is not None and check_timeout(emulated) is None


@pytest.mark.parametrize("path", GPU, ids=[p.name for p in GPU])
def test_every_gpu_config_measures_on_meta(path):
    """A GPU config's stages build on the meta device (no memory of this machine) and hold
    parameters; without CUDA its auto backend is gloo (so a laptop's --dry-run shows it), and
    nccl asked for outright is refused in one line."""
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="compute.backend = nccl needs CUDA"):
            TrainConfig.load(path, ["compute.backend=nccl"], world_size=2)
    cfg = TrainConfig.load(path, [], world_size=2)
    assert cfg.compute.backend == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    prints = footprints(cfg)
    assert prints is not None and all(f.state > 0 and f.activations > 0 for f in prints), prints


def test_the_estimate_is_a_lower_bound_of_what_the_stages_hold():
    """Parameters: exactly the real stages'. Activations of one microbatch: at most what the
    worker measures on the real CPU forward of that microbatch (the run's own count)."""
    cfg = TrainConfig.load(
        ROOT / "configs/gpt-tiny.toml",
        ["model.n_layer=2", "n_microbatches=4", "model.dropout=0.1"],
        world_size=2,
    )
    prints = footprints(cfg)
    wl, S = cfg.workload, cfg.layout.pp
    sample = wl.batches(cfg.data, 0, 4)
    smallest = min(range(4), key=lambda m: sample[m][0].numel())
    x, y = sample[smallest]
    torch.manual_seed(0)
    for s in range(S):
        module = wl.build_stage(cfg.model, s, S, None)
        assert 4 * sum(p.numel() * p.element_size() for p in module.parameters()) == prints[s].state
        worker = StageWorker(module, s, S, 4, wl.loss_fn, split=True, measure_activations=True)
        out = worker.forward(smallest, x, y if s == S - 1 else None)
        real = worker.activation_bytes(smallest)
        estimate = prints[s].activations // prints[s].in_flight
        assert 0.3 * real <= estimate <= real, (s, estimate, real)
        x = out
    assert [f.in_flight for f in prints] == [
        4,
        2,
    ]  # budget 2x: 2 * (S - s), at most the 4 microbatches


def test_with_virtual_stages_a_rank_counts_its_local_stages():
    """V = 2, v: a rank's parameters are exactly its two local stages', in flight its rank limit in
    local-stage microbatches (2x: 2 x S x V = 8, of the M x V = 16 it could hold), each one's
    activations at most its smaller local stage's real ones; under fixed dispatch, its order's peak
    (fixed applies no budget)."""
    from rrfp.core.hints import peak_in_flight

    sets = ["model.n_layer=4", "n_microbatches=8", "virtual=2", "placement=v"]
    cfg = TrainConfig.load(ROOT / "configs/gpt-tiny.toml", sets, world_size=2)
    one = TrainConfig.load(
        ROOT / "configs/gpt-tiny.toml", ["model.n_layer=4", "n_microbatches=8"], world_size=2
    )
    prints, wl, lay = footprints(cfg), cfg.workload, VirtualLayout(2, 2, "v")
    sample = wl.batches(cfg.data, 0, 8)
    smallest = min(range(8), key=lambda m: sample[m][0].numel())
    x, y = sample[smallest]
    params, real = (
        [],
        [],
    )  # per global stage: the real chunk's parameter bytes (x 4: AdamW) and saved activations
    torch.manual_seed(0)
    for g in range(4):
        module = wl.build_stage(cfg.model, g, 4, None)
        params.append(4 * sum(p.numel() * p.element_size() for p in module.parameters()))
        worker = StageWorker(module, g, 4, 8, wl.loss_fn, split=True, measure_activations=True)
        x = worker.forward(smallest, x, y if g == 3 else None)
        real.append(worker.activation_bytes(smallest))
    for r, f in enumerate(prints):
        mine = lay.stages_of(r)
        assert f.state == sum(params[g] for g in mine), (r, f)
        assert f.in_flight == cfg.schedule.budget.rank_limit(lay, r).count == 8, (r, f)
        smaller = min(real[g] for g in mine)
        assert 0.3 * smaller <= f.activations // f.in_flight <= smaller, (r, f, real)
    # the two ranks hold all the layers between them, as with one stage per rank
    assert sum(f.state for f in prints) == sum(f.state for f in footprints(one))
    fixed = TrainConfig.load(
        ROOT / "configs/gpt-tiny.toml", sets + ["dispatch=fixed", "hint=zbv"], world_size=2
    )
    orders = [fixed.schedule.hint.rank_order(lay, r, 8, True) for r in range(2)]
    assert (
        [f.in_flight for f in footprints(fixed)]
        == [peak_in_flight([t for _, t in o], True) for o in orders]
        == [4, 4]
    )


def test_a_config_that_cannot_fit_is_refused_in_one_line_naming_what_to_lower():
    cfg = TrainConfig.load(ROOT / "configs/gpt-tiny.toml", [], world_size=4)
    need = sum(f.total for f in footprints(cfg))
    check_memory(cfg, available=need)  # exactly enough: no refusal
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, available=need - 1)
    line = str(e.value)
    assert (
        "\n" not in line
        and "above the" in line
        and "lower schedule.n_microbatches, schedule.budget" in line
    ), line
    assert f"{need / 2**20:.1f} MiB of memory" in line, line


def test_timeout_below_three_steps_says_what_to_raise_it_to():
    cfg = TrainConfig.load(
        ROOT / "configs/gpt-tiny.toml",
        ["unit_ms=1000", "timeout_s=5", "n_microbatches=4"],
        world_size=4,
    )
    assert predicted_step_s(cfg) == pytest.approx(
        12.0
    )  # 4 microbatches x (F + B + W) of 1 unit each
    assert "raise run.timeout_s to 36 or more" in check_timeout(cfg, bounds_waits=True)
    assert check_timeout(cfg) is None, "on gloo the heartbeat bounds silence, not the step"
    assert (
        check_timeout(
            TrainConfig.load(
                ROOT / "configs/gpt-tiny.toml",
                ["unit_ms=1000", "timeout_s=36", "n_microbatches=4"],
                world_size=4,
            ),
            bounds_waits=True,
        )
        is None
    )
    # real compute without a cost model: no prediction, no line; an injected slow task is a known
    # part
    assert (
        predicted_step_s(TrainConfig.load(ROOT / "configs/gpt-tiny.toml", [], world_size=4)) is None
    )
    slow = TrainConfig.load(
        ROOT / "configs/gpt-tiny.toml",
        ["fault=slow:step=2:stage=1:task=F0:seconds=60"],
        world_size=4,
    )
    assert predicted_step_s(slow) == 60.0 and "raise run.timeout_s to 180" in check_timeout(
        slow, bounds_waits=True
    )


def test_measuring_leaves_the_run_generator_alone():
    cfg = TrainConfig.load(ROOT / "configs/gpt-tiny.toml", [], world_size=4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    footprints(cfg)
    assert torch.equal(before, torch.get_rng_state())


def test_byte_budget_below_one_microbatch_gets_a_warning():
    """budget = 1B (one byte, not a billion) runs, one microbatch at a time (a microbatch larger
    than the budget runs alone), so it is no error; the start says so, where the budget applies."""
    tiny = ROOT / "configs/gpt-tiny.toml"
    cfg = TrainConfig.load(tiny, ["budget=1B"], world_size=4)
    prints = check_memory(
        cfg
    )  # what rrfp train passes on; one microbatch's bytes do not depend on the budget

    def line(*sets):
        return check_byte_budget(TrainConfig.load(tiny, list(sets), world_size=4), prints)

    warning = check_byte_budget(cfg, prints)
    assert warning.startswith(
        "schedule.budget = 1B is a byte budget below one microbatch's activations on every rank"
    )
    assert "runs alone" in warning and "\n" not in warning
    smallest = min(f.one for f in prints)
    assert (
        smallest > 0
        and line(f"budget={smallest}B") is None
        and line(f"budget={smallest - 1}B") is not None
    )
    for sets in (
        ["budget=64MiB"],
        ["budget=2x"],
        ["budget=1"],
        ["budget=1B", "dispatch=fixed", "hint=1f1b"],
    ):
        assert line(*sets) is None, (
            sets
        )  # enough, a count, or fixed dispatch, which applies no budget
    assert (
        line("budget=1B", "dispatch=fixed", "hint=plan", "unit_ms=1") is not None
    )  # a plan keeps the budget
    assert check_byte_budget(cfg, None) is None  # not measurable: no claim
    virtual = TrainConfig.load(tiny, ["budget=1B", "virtual=2", "model.n_layer=8"], world_size=4)
    assert "one local-stage microbatch's activations" in check_byte_budget(
        virtual, footprints(virtual)
    )
