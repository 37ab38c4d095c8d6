"""torch.distributed.pipelining anchors (rrfp/app/bench/torch_schedules.py) on real gloo ranks:
torch's schedules train the same parameters as a single-process reference, and hold every
task for its emulated time, so an iteration lasts at least what its durations allow."""

from __future__ import annotations

import functools

import pytest
import torch
from harness.distributed import run_ranks
from harness.whole_model import float64

from rrfp.app.bench import torch_schedules as ts
from rrfp.core.tasks import Kind

WORLD = 2  # the properties hold at any size: the smallest with a message between ranks
M = 4  # torch's two-stage-per-rank schedules take at least as many microbatches as stages


def _model_and_data():
    """8 layers: the two-stage-per-rank schedules split the model into 2 x WORLD stages.
    Iteration 0's microbatches are shorter than iteration 1's, so the envelope must grow."""
    from rrfp.models.data import DataConfig
    from rrfp.models.gpt import GPTConfig

    return (
        GPTConfig(n_layer=8, n_embd=32, n_head=4, block_size=64),
        [
            DataConfig(seed=1, microbatch_size=2, min_seq_len=8, max_seq_len=16),
            DataConfig(seed=1, microbatch_size=2, min_seq_len=24, max_seq_len=40),
        ],
    )


@functools.cache
def _reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The whole model's two iterations in this process, in float64 (the SGD step between them):
    each microbatch's loss per iteration, and the second iteration's gradients by name. Computed
    once for the schedules that are compared with it."""
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, loss_fn

    with float64():
        model_cfg, data_cfgs = _model_and_data()
        data = [make_batches(cfg, step, M) for step, cfg in enumerate(data_cfgs)]
        torch.manual_seed(0)
        ref = GPT(model_cfg)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        ref_losses = []
        for batches in data:
            ref_opt.zero_grad()
            losses = [loss_fn(ref(x), y) for x, y in batches]
            (sum(losses) / M).backward()
            ref_losses.append([loss.item() for loss in losses])
            if len(ref_losses) < len(data):
                ref_opt.step()
        return ref_losses, {n: p.grad for n, p in ref.named_parameters()}


def _train_two_iterations(rank, world, schedule, reference):
    import torch.distributed as dist

    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import loss_fn, workload

    torch.set_default_dtype(torch.float64)
    model_cfg, data_cfgs = _model_and_data()
    data = [make_batches(cfg, step, M) for step, cfg in enumerate(data_cfgs)]
    ref_losses, ref_grads = reference

    dist.init_process_group("gloo")
    try:
        runner = ts.TorchScheduleRunner(
            schedule,
            ts.workload_stage_builder(workload, model_cfg, seed=0),
            loss_fn,
            rank,
            world,
            M,
            unit_s=0.0,
        )
        opt = torch.optim.SGD(runner.parameters(), lr=0.5)
        losses, capacities = [], []
        for it, batches in enumerate(data):
            opt.zero_grad()
            res = runner.run_iteration(it, batches)
            losses.append(res.losses)
            capacities.append(runner.capacity)
            if it < len(data) - 1:
                opt.step()
        named = list(runner.named_parameters())
        missing = [n for n, p in named if p.grad is None]
        grad_err = max(
            (p.grad - ref_grads[n]).abs().max().item() for n, p in named if p.grad is not None
        )
        owned = {n for n, _ in named}
        needed = [
            ts.probe_capacity(ts.workload_stage_builder(workload, model_cfg), runner.num_stages, b)
            for b in data
        ]
        counts = {}
        for sp in res.spans:
            counts[(sp.stage, sp.name[0])] = counts.get((sp.stage, sp.name[0]), 0) + 1
        dist.barrier()
    finally:
        dist.destroy_process_group()
    loss_err = None
    if any(losses):
        loss_err = max(
            abs(losses[i][mb] - ref_losses[i][mb]) for i in range(len(data)) for mb in range(M)
        )
    return dict(
        grad_err=grad_err,
        missing=missing,
        loss_err=loss_err,
        owned=owned,
        all=set(ref_grads),
        capacities=capacities,
        needed=needed,
        stages=runner.stage_indices,
        counts=counts,
        split=runner.split,
    )


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_two_iterations_match_single_process_reference(schedule):
    out = run_ranks(_train_two_iterations, WORLD, schedule, _reference(), timeout=90)
    with_loss = [r for r, o in out.items() if o["loss_err"] is not None]
    assert len(with_loss) == 1, "exactly one rank holds the last stage and reports losses"
    assert out[with_loss[0]]["loss_err"] < 1e-9
    stages = sorted(k for o in out.values() for k in o["stages"])
    assert stages == list(range(WORLD * ts.stages_per_rank(schedule)))
    owned = set().union(*(o["owned"] for o in out.values()))
    assert owned == out[0]["all"], "the ranks' stages hold every parameter of the model once"
    for rank, o in out.items():
        assert not o["missing"], (rank, o["missing"])
        assert o["grad_err"] < 1e-9, (rank, o["grad_err"])
        # the envelope grew with iteration 1's longer microbatches, to exactly what they need
        assert o["needed"][1] > o["needed"][0] and o["capacities"] == o["needed"], o
        kinds = "FBW" if o["split"] else "FB"
        assert o["counts"] == {(k, kind): M for k in o["stages"] for kind in kinds}, o["counts"]


VARIABILITY = dict(
    slow_stage=1, slow_factor=2.0, comm=1.0
)  # rank 1 twice as slow; one unit per message


def _emulated(rank, world, schedule, unit_s):
    import torch.distributed as dist

    from rrfp.core.variability import Variability
    from rrfp.models.data import DataConfig
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPTConfig, loss_fn, workload

    var = Variability.preset("none", **VARIABILITY)
    model_cfg = GPTConfig(n_layer=8, n_embd=16, n_head=2, block_size=32)
    data_cfg = DataConfig(seed=0, microbatch_size=1, min_seq_len=8, max_seq_len=16)
    dist.init_process_group("gloo")
    try:
        runner = ts.TorchScheduleRunner(
            schedule,
            ts.workload_stage_builder(workload, model_cfg),
            loss_fn,
            rank,
            world,
            M,
            unit_s=unit_s,
        )
        calls = []

        def units(stage, mb, kind):
            calls.append((stage, mb, kind))
            return var.duration(0, 1, stage, mb, kind, split=runner.split)

        def latency(stage, mb, kind):
            return var.latency(0, 1, stage, mb, kind)

        runner.run_iteration(
            0, make_batches(data_cfg, 0, M), units, latency
        )  # warm-up: groups and buffers
        dist.barrier()
        res = runner.run_iteration(1, make_batches(data_cfg, 1, M), units, latency)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return dict(
        start=res.start,
        wall=res.wall_s,
        spans=res.spans,
        stages=runner.stage_indices,
        asked=sorted({s for s, _, _ in calls}),
        split=runner.split,
    )


def _lower_bound(
    S: int, rank_of: dict[int, int], per_rank: int, split: bool, dur, lat: float
) -> float:
    """Units no schedule can beat: a rank's own work, plus microbatch 0's forwards (and messages)
    before its first task and, unsplit, the backwards after its last; and microbatch 0's chain
    through every stage and back."""
    d = {(k, kind): dur(k, kind) / per_rank for k in range(S) for kind in Kind}
    hop = [lat if rank_of[k] != rank_of[k + 1] else 0.0 for k in range(S - 1)]  # message k -> k+1
    bound = 0.0
    for r in set(rank_of.values()):
        mine = [k for k in range(S) if rank_of[k] == r]
        work = sum(
            d[(k, kind)]
            for k in mine
            for kind in ((Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B))
        )
        head = min(sum(d[(j, Kind.F)] + hop[j] for j in range(k)) for k in mine)
        tail = 0.0 if split else min(sum(d[(j, Kind.B)] + hop[j] for j in range(k)) for k in mine)
        bound = max(bound, head + M * work + tail)
    chain = (
        sum(d[(k, Kind.F)] + d[(k, Kind.B)] for k in range(S))
        + 2 * sum(hop)
        + (d[(0, Kind.W)] if split else 0)
    )
    return max(bound, chain)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_emulated_time_bounds_the_iteration(schedule):
    from rrfp.core.variability import Variability

    unit_s = 0.02  # emulated time well above the per-task cost on a loaded 2-core machine
    out = run_ranks(_emulated, WORLD, schedule, unit_s, timeout=90)
    var = Variability.preset("none", **VARIABILITY)
    _, per_rank, _, split = ts.SCHEDULES[ts.resolve_schedule(schedule)]
    S = WORLD * per_rank
    rank_of = {k: r for r, o in out.items() for k in o["stages"]}

    def dur(k, kind):  # no jitter: every microbatch alike; torch stage k runs on rank_of[k]
        return var.duration(0, 1, rank_of[k], 0, kind, split=split)

    for r, o in out.items():
        assert o["asked"] == [r], "units are asked in rrfp's numbering: this rank's stage"
        for sp in o["spans"]:
            if sp.name[0] == "F":
                want = var.duration(0, 1, r, int(sp.name[1:]), Kind.F) / per_rank * unit_s
                assert sp.end - sp.start >= want, (r, sp, want)
    start = min(o["start"] for o in out.values())
    spans = {
        (sp.stage, sp.name): (o["start"] + sp.start - start, o["start"] + sp.end - start)
        for o in out.values()
        for sp in o["spans"]
    }
    makespan = max(o["start"] + o["wall"] for o in out.values()) - start
    lat = var.comm * unit_s
    bound = _lower_bound(S, rank_of, per_rank, split, dur, var.comm) * unit_s
    assert makespan >= bound, (makespan, bound)
    # a message to another rank leaves the link latency after its task ends
    for k in range(S - 1):
        gap = lat if rank_of[k] != rank_of[k + 1] else 0.0
        for mb in range(M):
            assert spans[(k + 1, f"F{mb}")][0] >= spans[(k, f"F{mb}")][1] + gap, (k, mb)
            assert spans[(k, f"B{mb}")][0] >= spans[(k + 1, f"B{mb}")][1] + gap, (k, mb)
    # the slow rank (1) spends at least twice the emulated time of the others in its tasks; only
    # lower bounds are asserted, since other jobs on the machine can lengthen any rank's spans
    busy = {r: sum(sp.end - sp.start for sp in o["spans"]) for r, o in out.items()}
    for r in out:
        assert busy[r] >= (2 if r == 1 else 1) * M * 3 * unit_s, (r, busy)
    # the memory the bench reports beside torch's speedups, read off the spans: 1F1B holds S - r
    from rrfp.app.bench.runners import held_peak

    for r, o in out.items():
        peak = held_peak(o["spans"], 1.0 / per_rank)
        if schedule == "1f1b":
            assert peak == min(M, WORLD - r), (r, peak)
        else:
            assert 0 < peak <= M and peak * 2 == int(peak * 2), (r, peak)  # ZB-V: two half stages


def test_envelope_round_trip_carries_gradients():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(4, dtype=torch.float32, requires_grad=True)
    payload, header = ts.pack((a, None, b), capacity=20, dtype=torch.float64)
    assert payload.shape == (20,) and payload.dtype == torch.float64
    leaf = payload.detach().requires_grad_(True)
    x, none, y = ts.unpack(leaf, header)
    assert none is None and torch.equal(x, a) and torch.equal(y, b) and y.dtype == torch.float32
    (x.sum() * 2 + y.sum() * 3).backward()
    assert torch.equal(
        leaf.grad, torch.tensor([2.0] * 6 + [3.0] * 4 + [0.0] * 10, dtype=torch.float64)
    )
    lone, _ = ts.pack(a, capacity=6, dtype=torch.float64)
    assert isinstance(ts.unpack(lone, _), torch.Tensor)
    with pytest.raises(RuntimeError, match="capacity"):
        ts.pack(a, capacity=5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="floating, integer or bool"):
        ts.pack([a, "mask"], capacity=20, dtype=torch.float64)


def test_envelope_carries_integer_and_bool_tensors_exactly():
    """A mask or lengths beside the activations (as the VLM sends) arrive with dtype and values."""
    h = torch.randn(2, 3, requires_grad=True)
    lengths = torch.tensor([[0, 7], [16777216, -3]])  # 2**24: the largest float32 holds exactly
    mask = torch.tensor([True, False, True])
    payload, header = ts.pack((h, lengths, mask), capacity=16, dtype=torch.float32)
    leaf = payload.detach().requires_grad_(True)
    x, got_lengths, got_mask = ts.unpack(leaf, header)
    assert got_lengths.dtype == torch.int64 and torch.equal(got_lengths, lengths)
    assert got_mask.dtype == torch.bool and torch.equal(got_mask, mask)
    assert not got_lengths.requires_grad and x.requires_grad and torch.equal(x, h)
    with pytest.raises(RuntimeError, match="cannot carry exactly"):
        ts.pack((h, torch.tensor([16777217])), capacity=16, dtype=torch.float32)
    payload, header = ts.pack((h, torch.tensor([16777217])), capacity=16, dtype=torch.float64)
    assert ts.unpack(payload, header)[1].item() == 16777217


def test_schedule_names():
    assert (
        ts.resolve_schedule("ZB") == "zbv"
        and ts.stages_per_rank("1f1b") == 1
        and ts.stages_per_rank("zb") == 2
    )
    with pytest.raises(ValueError, match="1f1b"):
        ts.resolve_schedule("gpipe-ish")


def test_two_stages_per_rank_hold_the_local_stage_draws_of_rrfps_virtual_stages():
    """torch's V-shape and interleaved rows (by_stage) hold each stage for rrfp's local-stage draw
    at that global stage (and wait its latency), as rrfp's executor at V = 2 of the same placement
    does; one stage per rank keeps the rank's draw times the share."""
    from rrfp.core.durations import TaskTimes
    from rrfp.core.placement import VirtualLayout
    from rrfp.core.variability import Variability

    assert [
        ts.placement_of(s) for s in ("zbv", "dualpipev", "interleaved-zb", "interleaved-1f1b")
    ] == ["v", "v", "interleaved", "interleaved"]
    torch_numbering = {
        "zbv": lambda r, w: (r, 2 * w - 1 - r),
        "interleaved-1f1b": lambda r, w: (r, r + w),
    }
    for schedule, stages_of in torch_numbering.items():  # torch's stage_index of rank r's stages
        layout = VirtualLayout(4, 2, ts.placement_of(schedule))
        assert all(tuple(layout.stages_of(r)) == stages_of(r, 4) for r in range(4)), "one numbering"
    times = TaskTimes(Variability.preset("lang"), 3, True, layout=VirtualLayout(4, 2, "v"))
    asked = []

    def units(stage, mb, kind):
        asked.append(stage)
        return times.units(5, stage, mb, kind)

    clock = ts._Clock(rank=1, unit_s=0.01, share=0.5, split=True, units=units, by_stage=True)
    assert clock.duration(6, 2, (Kind.B, Kind.W)) == times.units(5, 6, 2, Kind.B) + times.units(
        5, 6, 2, Kind.W
    )
    assert asked == [6, 6]
    old = ts._Clock(
        rank=1, unit_s=0.01, share=0.5, split=True, units=lambda st, mb, k: 4.0 if st == 1 else 0.0
    )
    assert old.duration(6, 2, (Kind.F,)) == 2.0, "one stage per rank: the rank's draw, halved"


def _moe_grads_against_reference(rank, world):
    """torch's 1F1B over the MoE workload's two stages in float64: each rank's gradients against
    the whole model's in one process, whose loss adds the layers' auxiliary losses (mean over the
    microbatches, as the pipeline scales each microbatch's loss by 1 / M)."""
    import os

    import torch.distributed as dist

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.nn.moe_aux_loss import collect_aux_losses

    torch.set_default_dtype(torch.float64)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    cfg = TrainConfig.load(
        os.path.join(root, "configs", "moe-tiny.toml"),
        ["parallel.dp=1", "data.min_seq_len=8", "data.max_seq_len=16", "data.microbatch_size=2"],
        world_size=world,
    )
    wl, m = cfg.workload, 4
    batches = wl.batches(cfg.data, 0, m)
    torch.manual_seed(0)
    ref = wl.build_stage(cfg.model, 0, 1, None)
    total = 0
    for x, y in batches:
        with collect_aux_losses() as found:
            out = ref(x)
        assert found, "the reference's MoE layers reported no auxiliary loss"
        total = total + wl.loss_fn(out, y) + sum(found)
    (total / m).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    dist.init_process_group("gloo")
    try:
        runner = ts.TorchScheduleRunner(
            "1f1b", ts.workload_stage_builder(wl, cfg.model, 0), wl.loss_fn, rank, world, m, 0.0
        )
        runner.run_iteration(0, batches)
        errs = {n: (p.grad - ref_grads[n]).abs().max().item() for n, p in runner.named_parameters()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return errs


@pytest.mark.multirank
def test_moe_stages_train_with_the_auxiliary_loss_scaled_as_the_reference():
    out = run_ranks(_moe_grads_against_reference, 2, timeout=120)
    routers = [n for o in out.values() for n in o if "router" in n or "gate" in n]
    assert routers, "the MoE stages hold router parameters, which only the auxiliary loss moves"
    for rank, errs in out.items():
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-9, (rank, worst, errs[worst])
