"""The GPU path end to end on the fake CUDA/NCCL (tests/harness/fake_cuda.py): every rank a
thread with its own event loop, started the way PipelineRuntime starts a rank, then
training iterations of the GPT against a single-process reference.

What is shown here, and the mutation that shows each check can fail:
- sends go out when their producer ends, not when the task after it does (mutation:
  the gate recorded when the send coroutine runs, as before: every send late by the
  duration of the next task);
- no NCCL communicator is created, and no host synchronization happens, after start-up,
  on any path: pipeline channels, TP layers and agreement, DP buckets (mutation: a TP group
  left lazy: its communicator appears on the event loop in iteration 0);
- the lazy paths of real torch/NCCL deadlock, and the fake catches it by a timeout
  (mutations: bare isend/irecv on torch 2.8 without the warm-up; no warm-up at all);
- with two stages per rank (both placements, with TP) every channel of every local stage is a group
  of its own, created and connected at start-up (mutation: only each rank's first two
  channels warmed up: rank 0 blocks connecting 2->0 in the run, a FakeHang).
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness.fake_cuda import (
    FakeCudaOps,
    FakeHang,
    FakeWorld,
    restore_late_sends,
    run_ranks_in_threads,
)

from rrfp.comm.message import HEADER_LEN
from rrfp.core.layout import layout_for
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind
from rrfp.core.variability import Variability
from rrfp.pipeline.timeouts import Timeouts

DEVICE = torch.device("cuda", 0)
M = 4
PATCHED = [
    "rrfp.pipeline.runtime",
    "rrfp.comm.pipeline_channels",
    "rrfp.comm.stage_groups",
    "rrfp.comm.grad_sync",
    "rrfp.comm.collectives",
    "rrfp.comm.agreement",
    "rrfp.comm.channels",
    "rrfp.nn.tensor_parallel",
    "rrfp.pipeline.ties",
]


@pytest.fixture
def fake_dist(monkeypatch):
    """Make rrfp's torch.distributed calls go to a fake world's (created by the test)."""
    import importlib

    def install(world: FakeWorld) -> FakeWorld:
        for name in PATCHED:
            monkeypatch.setattr(importlib.import_module(name), "dist", world.dist)
        return world

    return install


def _reference(model_cfg, data):
    from rrfp.models.gpt import GPT, loss_fn

    torch.manual_seed(0)
    ref = GPT(model_cfg)
    loss = sum(loss_fn(ref(x), y) for x, y in data) / len(data)
    loss.backward()
    return {n: p.grad for n, p in ref.named_parameters()}, loss.item()


def run_pipeline(
    world: FakeWorld,
    pp: int,
    tp: int = 1,
    dp: int = 1,
    *,
    unit_ms: float = 20.0,
    split=False,
    hint="1f1b",
    iterations: int = 1,
    timeout: float = 120.0,
    timeout_s: float = 30.0,
    virtual: int = 1,
    placement: str = "interleaved",
):
    """``iterations`` iterations (no optimizer step) on every rank of a pp x tp x dp layout, with
    ``virtual`` stages per pipeline rank; per rank: the last one's gradient error against the
    reference, task order and loss, the (first) stage."""
    from rrfp.models.data import DataConfig, batches
    from rrfp.models.gpt import GPT, GPTConfig, full_grad_slice, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime

    layout = layout_for(world.size, pp, tp, dp)
    stages = VirtualLayout(pp, virtual, placement)
    model_cfg = GPTConfig(n_layer=2 * pp * virtual, n_embd=16, n_head=2, block_size=32)
    data = batches(DataConfig(seed=3, microbatch_size=2, min_seq_len=6, max_seq_len=24), 0, M * dp)
    ref_grads, ref_loss = _reference(model_cfg, data)
    torch.manual_seed(0)
    # built before the ranks start: they are threads sharing torch's one RNG, from which an executor
    # with virtual stages draws a seed every iteration and which it seeds around every forward
    # (executor.py), so a model built in a rank could draw another rank's seed
    template = GPT(model_cfg)

    async def rank_main(rank):
        rt = PipelineRuntime._build(
            layout,
            DEVICE,
            "nccl",
            Timeouts.derive(timeout_s),
            unit_ms,
            False,
            ops=FakeCudaOps(world, rank),
            torch_module=world.torch_for(rank),
            stages=stages,
        )
        world.started(rank)
        try:
            full = copy.deepcopy(template)
            modules = torch.nn.ModuleList(
                [make_stage(full, s, rt.num_stages, tp_group=rt.tp_group) for s in rt.stages]
            )
            ex = rt.stage_executor(
                list(modules) if virtual > 1 else modules[0],
                loss_fn,
                n_microbatches=M,
                hint=hint,
                split=split,
                variability=Variability(comm=0.0),
            )
            sync = rt.grad_sync(modules if virtual > 1 else modules[0], ex)
            for it in range(iterations):
                modules.zero_grad(set_to_none=True)
                res = await ex.run_iteration(it, data[rt.dp_rank * M : (rt.dp_rank + 1) * M])
                await sync.sync()
            err = 0.0
            for n, p in modules.named_parameters():
                n = n.split(".", 1)[1]  # ModuleList's index first
                want = ref_grads[n]
                if p.shape != want.shape:
                    want = full_grad_slice(n, want, rt.tp_rank, tp)
                err = max(err, (p.grad - want).abs().max().item())
            return {
                "err": err,
                "order": list(res.order),
                "loss": res.loss,
                "stage": rt.stage,
                "dp_group": rt.dp_group,
            }
        finally:
            await rt.aclose()

    return run_ranks_in_threads(world, rank_main, timeout=timeout), ref_loss


def hop_delays(world: FakeWorld, results: dict) -> list[tuple[str, str, float, float]]:
    """(message, the task enqueued after its producer, send start - producer end, gate - producer
    end) for every message of the last iteration (the first one also pays one-time host costs,
    such as a first backward through an embedding: 0.3 s here). The gate is the event the send
    waited for: unlike the send's start, host stalls on this shared machine cannot move it."""
    out = []
    for rank, r in results.items():
        order = r["order"]
        kernels = [k for k in world.kernels if k.rank == rank and k.phase == "run"][-len(order) :]
        assert len(kernels) == len(order), "one emulated kernel per task"
        ends = {task: k.end for task, k in zip(order, kernels)}
        kind = Kind.F if r["stage"] == 0 else Kind.B
        producers = [t for t in order if t.kind is kind]
        headers = [op for op in world.sends if op.rank == rank and op.tensor.numel() == HEADER_LEN][
            -len(producers) :
        ]
        assert len(headers) == len(producers)
        for task, header in zip(producers, headers):
            i = order.index(task)
            after = str(order[i + 1]) if i + 1 < len(order) else "none"
            out.append(
                (
                    f"{task} of stage {r['stage']}",
                    after,
                    header.posted_at - ends[task],
                    header.gated_by.done_at - ends[task],
                )
            )
    return out


@pytest.mark.timeout(120)
def test_sends_leave_when_their_producer_ends(fake_dist, monkeypatch):
    """Per-hop send delay under the fake clock (F 20 ms, unsplit B 40 ms), before and after."""
    measured = {}
    for variant in ("producer's event", "recorded when the send runs (before)"):
        if variant.startswith("recorded"):
            restore_late_sends(monkeypatch)  # the code before the fix
        world = fake_dist(FakeWorld(2))
        results, ref_loss = run_pipeline(world, pp=2, iterations=2)
        assert max(r["err"] for r in results.values()) < 1e-5
        assert abs(results[1]["loss"] - ref_loss) < 1e-5
        measured[variant] = hop_delays(world, results)
    for variant, rows in measured.items():  # shown with pytest -s
        print(f"\nper-hop send delay, gate = {variant}:")
        for msg, after, d, gate in rows:
            print(
                f"  {msg:<16} next task {after:<4} send starts {d * 1e3:+6.1f} ms after its "
                f"producer ends (its gate {gate * 1e3:+6.1f} ms)"
            )
    # fixed: every send is gated by its producer's own end; before: several by the end of the task
    # enqueued after the producer (the send starts no earlier than its gate)
    assert all(gate == 0.0 for *_, gate in measured["producer's event"]), measured[
        "producer's event"
    ]
    duration = {"F": 0.020, "B": 0.040}
    before = measured["recorded when the send runs (before)"]
    behind_next = [
        row for row in before if row[1] != "none" and row[3] >= 0.9 * duration[row[1][0]]
    ]
    assert len(behind_next) >= 2 and all(row[2] >= row[3] for row in before), before


@pytest.mark.timeout(180)
def test_no_communicator_or_host_sync_after_startup_on_any_path(fake_dist):
    """pp 2 x tp 2 x dp 2 with TP layers: channels, TP collectives, TP agreement, DP buckets."""
    world = fake_dist(FakeWorld(8, hang_s=5.0))
    results, _ = run_pipeline(world, pp=2, tp=2, dp=2, unit_ms=2.0, split=True, hint="bfw")
    assert max(r["err"] for r in results.values()) < 1e-5
    assert world.inits and all(i.phase == "startup" for i in world.inits), world.after_startup(
        world.inits
    )
    assert {i.key[0] for i in world.inits} == {"group"}, "a communicator other than a group's own"
    assert world.after_startup(world.host_syncs) == []
    # each DP bucket waits for the stage's last W, and for no task after it (its gate: the lane as
    # it was when the bucket was issued; the gate's time is the W's end, or the issue, if the host
    # was late)
    for rank, r in results.items():
        kernels = [k for k in world.kernels if k.rank == rank and k.phase == "run"]
        last_w = kernels[max(i for i, t in enumerate(r["order"]) if t.kind is Kind.W)]
        dp = world.comms[("group", r["dp_group"].index)]
        first_bucket = next(
            op
            for n in sorted(dp.collectives)
            for op in dp.collectives[n]
            if op.rank == rank and op.tensor.numel() > 1
        )
        assert first_bucket.gate.done_at >= last_w.end
        assert not [k for k in kernels if last_w.end < k.end <= first_bucket.gate.done_at]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("placement", ["interleaved", "v"])
def test_virtual_stages_create_and_connect_nothing_after_startup(fake_dist, placement):
    """Two stages per rank, pp 2 x tp 2: every boundary between ranks is a channel with its own
    group (the v turn none), all warmed up at start-up in one global order, with TP layers and
    agreement over both local stages; gradients and loss as one process."""
    world = fake_dist(FakeWorld(4, hang_s=5.0))
    results, ref_loss = run_pipeline(
        world, pp=2, tp=2, unit_ms=2.0, split=True, hint="bfw", virtual=2, placement=placement
    )
    assert max(r["err"] for r in results.values()) < 1e-5
    last = VirtualLayout(2, 2, placement).rank_of(
        3
    )  # the pipeline rank that holds the loss (its first stage)
    losses = [r["loss"] for r in results.values() if r["stage"] == last]
    assert len(losses) == 2 and all(abs(loss - ref_loss) < 1e-5 for loss in losses), losses
    assert world.inits and all(i.phase == "startup" for i in world.inits), world.after_startup(
        world.inits
    )
    assert world.after_startup(world.host_syncs) == []
    # a channel's group joins two pipeline ranks; interleaved: boundaries 0-1, 1-2, 2-3 all cross
    # ranks; v: 0-1 and 2-3 (1-2 is the local turn); two groups (fwd, bwd) each, per TP rank
    pp_of = layout_for(4, 2, 2, 1).coords
    channels = [
        g for g in world.groups if g.backend == "nccl" and len({pp_of(r).pp for r in g.ranks}) == 2
    ]
    assert len(channels) == 2 * 2 * (3 if placement == "interleaved" else 2), len(channels)


@pytest.mark.timeout(120)
def test_a_lazy_tp_group_shows_up_as_a_communicator_created_on_the_loop(fake_dist, monkeypatch):
    """Mutation: the TP group created without device_id, unchecked and not warmed up."""
    import rrfp.comm.stage_groups as stage_groups

    class ForgetsTheDevice:
        def __init__(self, dist):
            self.dist = dist

        def __getattr__(self, name):
            return getattr(self.dist, name)

        def new_group(self, ranks=None, device_id=None, **kw):
            return self.dist.new_group(ranks, **kw)

    world = fake_dist(FakeWorld(4, hang_s=5.0))
    monkeypatch.setattr(stage_groups, "dist", ForgetsTheDevice(world.dist))
    monkeypatch.setattr(stage_groups, "require_eager", lambda *a, **k: None)
    monkeypatch.setattr(stage_groups, "warm_up_collective", lambda *a, **k: None)
    results, _ = run_pipeline(world, pp=2, tp=2, unit_ms=2.0)
    assert max(r["err"] for r in results.values()) < 1e-5
    late = world.after_startup(world.inits)
    tp_groups = {
        ("group", g.index)
        for g in world.groups
        if g.backend == "nccl" and g.bound_device_id is None
    }
    assert late and {i.key for i in late} == tp_groups, late


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", [(2, 8), (2, 9)])
def test_the_lazy_paths_deadlock_and_the_fake_catches_them(fake_dist, monkeypatch, version):
    """The fixed start-up passes on either torch's P2P semantics; without the warm-up, bare
    P2P ops hang on torch 2.8's two-rank communicators and batched ones on NCCL's
    first connection, both in iteration 0."""
    from rrfp.comm.device_ops import CudaOps
    from rrfp.comm.nccl_channel import NcclChannel

    results, _ = run_pipeline(fake_dist(FakeWorld(2, torch_version=version)), pp=2, unit_ms=2.0)
    assert max(r["err"] for r in results.values()) < 1e-5

    hung = dict(pp=2, unit_ms=2.0, timeout_s=3.0)  # the rank that is not blocked gives up soon too
    monkeypatch.setattr(NcclChannel, "warm_up", lambda self: None)
    with pytest.raises(FakeHang, match=r"connecting 1->0|connecting 0->1"):
        run_pipeline(fake_dist(FakeWorld(2, torch_version=version, hang_s=1.0)), **hung)

    if version < (2, 9):
        monkeypatch.setattr(
            CudaOps, "_batch_of_one", lambda self, op, t, peer, group: op(t, peer, group=group)
        )
        with pytest.raises(FakeHang, match=r"creating NCCL communicator \('pair'"):
            run_pipeline(fake_dist(FakeWorld(2, torch_version=version, hang_s=1.0)), **hung)
