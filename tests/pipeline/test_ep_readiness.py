"""Expert parallelism under readiness, on real gloo ranks: pp 2 x ep 2 (4 ranks, float64, 2 AdamW
steps, the auxiliary loss on), each replica drawing its task durations from a seed of its own and
its MoE tasks' experts and all-to-alls timed by their routing, so that the replicas pick different
orders; the EP agreement keeps their all-to-alls paired, and
losses, gradients and parameters equal one process running the whole model on both replicas'
data."""

from __future__ import annotations

import functools

import pytest
from harness.distributed import run_ranks
from harness.whole_model import float64

pytestmark = pytest.mark.multirank

M, DIM, STEPS = 4, 8, 2
UNIT_MS = 20.0  # emulated task lengths long against the compute, so that the seeds decide
# blocks: dense first, MoE after: with V = 2 (v placement) rank 0 holds stage 0 (no MoE layer)
# beside stage 3
BLOCKS = ("dense", "moe", "moe", "moe")


def _model(blocks=BLOCKS):
    import torch.nn as nn

    from rrfp.nn.moe_layer import MoELayer

    class Block(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.ffn = (
                MoELayer(DIM, 12, 4, 2, aux_loss_coeff=0.01)
                if kind == "moe"
                else nn.Sequential(nn.Linear(DIM, 12), nn.SiLU(), nn.Linear(12, DIM))
            )

        def forward(self, x):
            return x + self.ffn(x)

    return nn.Sequential(*(Block(k) for k in blocks))


def _loss(out, y):
    return (out - y).square().mean()


def _data(dp: int) -> list:
    """Each step's microbatches, every replica's: M per replica."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return [
        [
            (torch.randn(2, 5, DIM, generator=gen), torch.randn(2, 5, DIM, generator=gen))
            for _ in range(M * dp)
        ]
        for _ in range(STEPS)
    ]


@functools.cache
def _reference(blocks=BLOCKS, dp=2):
    """One process training the whole model on every replica's data, in float64, once in the test
    process: each step's loss and gradients, the final parameters (numpy arrays: they travel to
    the ranks by value)."""
    import torch

    from rrfp.nn.moe_aux_loss import collect_aux_losses

    with float64():
        data = _data(dp)
        torch.manual_seed(0)
        full = _model(blocks)
        opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
        losses, grads = [], []
        for step in range(STEPS):
            with (
                collect_aux_losses() as aux
            ):  # each layer's weighted auxiliary loss, per microbatch
                loss = sum(_loss(full(x), y) for x, y in data[step]) / (M * dp)
            (loss + sum(aux) / (M * dp)).backward()
            losses.append(loss.item())  # the trained loss is reported without them
            grads.append({n: p.grad.numpy().copy() for n, p in full.named_parameters()})
            opt.step()
            opt.zero_grad()
        return losses, grads, {n: p.detach().numpy() for n, p in full.named_parameters()}


def _pipeline(rank, world, pp, configs, virtual, ref, opts=None):
    """``ref``: ``_reference``'s for the model and data; ``opts``: ``slow`` (replica 1's stage 0
    that many times slower), ``fail_every`` (every n-th EP round fails), ``fsdp`` (the stages
    FSDP-sharded over the replicas), ``blocks`` (the model's), ``tight`` (replica 0's budget one
    microbatch), ``overlap`` (a ready W beside an all-to-all, made to happen by construction:
    tests/harness/overlap_holds.py)."""
    import torch

    from rrfp.core.budget import DEFAULT_BUDGET
    from rrfp.core.variability import Variability
    from rrfp.loop import run
    from rrfp.nn.expert_parallel import expert_parameters
    from rrfp.nn.expert_time import ExpertTimes
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings
    from rrfp.pipeline.sharded_stages import shard_stage

    opts = opts or {}
    slow, fail_every, fsdp = opts.get("slow", 0.0), opts.get("fail_every", 0), opts.get("fsdp")
    blocks, tight = opts.get("blocks", BLOCKS), opts.get("tight", False)
    overlap = opts.get("overlap", False)
    torch.set_default_dtype(torch.float64)
    dp = world // pp
    data = _data(dp)
    ref_losses = ref[0]
    ref_grads = [{n: torch.from_numpy(g) for n, g in step.items()} for step in ref[1]]
    ref_params = {n: torch.from_numpy(p) for n, p in ref[2].items()}

    async def main():
        rt = PipelineRuntime.start(
            pp=pp,
            dp=dp,
            ep=dp,
            timeout_s=60,
            unit_ms=UNIT_MS,
            virtual=virtual,
            placement="v" if virtual == 2 else "interleaved",
        )
        n = rt.num_stages
        per = len(blocks) // n
        out = {}
        try:
            for hint, split in configs:
                torch.manual_seed(0)
                full = _model(blocks)
                mods = [full[s * per : (s + 1) * per] for s in rt.stages]
                for m in mods:
                    rt.shard_experts(m)
                if fsdp:  # the rest FSDP-sharded over the replicas, the experts left out
                    mods = [shard_stage(m, rt.dp_group, "cpu") for m in mods]

                shards = set().union(*(expert_parameters(m) for m in mods))
                params = [p for m in mods for p in m.parameters()]
                # a slice of a Sequential keeps the whole model's names
                names = {id(p): n for m in mods for n, p in m.named_parameters()}
                settings = ScheduleSettings.of(
                    M,
                    hint=hint,
                    split=split,
                    # slow: replica 1's stage 0 that many times slower, so that its peers offer
                    # other classes than it does and rounds fail
                    variability=Variability.preset("lang", slow_stage=0, slow_factor=slow)
                    if slow and rt.dp_rank == 1
                    else Variability.preset("lang"),
                    seed=100 + rt.dp_rank,
                    # the MoE tasks' experts and all-to-alls take their time from the routing
                    experts=ExpertTimes(rows=2 * 5 * 2),
                    overlap=overlap,
                    budget=1 if tight and rt.dp_rank == 0 else DEFAULT_BUDGET,
                )
                ex = rt.stage_executor(mods, _loss, settings=settings)
                if overlap:
                    from harness.overlap_holds import hold_windows

                    hold_windows(ex, rt.lane)
                if fail_every:
                    _fail_rounds(ex.ep_agreement, fail_every)
                module = mods[0] if virtual == 1 else torch.nn.ModuleList(mods)
                sync = None if fsdp else rt.grad_sync(module, ex)
                opt = torch.optim.AdamW(params, lr=1e-2)
                k = 4 // dp  # experts per member
                errs, losses, orders = [], [], []
                for step in range(STEPS):
                    mine = data[step][rt.dp_rank * M : (rt.dp_rank + 1) * M]
                    res = await ex.run_iteration(step, mine)
                    if sync is not None:
                        await sync.sync()
                    losses.append(res.losses)
                    orders.append([f"{t}@{s}" for s, t in res.ran])
                    for p in params:
                        want = ref_grads[step][names[id(p)]]
                        if id(p) in shards:
                            want = want[rt.dp_rank * k : (rt.dp_rank + 1) * k]
                        errs.append((_whole(p.grad) - want).abs().max().item())
                    opt.step()
                    opt.zero_grad()
                perr = 0.0
                for p in params:
                    want = ref_params[names[id(p)]].detach()
                    if id(p) in shards:
                        want = want[rt.dp_rank * k : (rt.dp_rank + 1) * k]
                    perr = max(perr, (_whole(p.detach()) - want).abs().max().item())
                ep = ex.ep_agreement
                out[(hint, split)] = {
                    "grad_err": max(errs),
                    "param_err": perr,
                    "losses": losses,
                    "orders": orders,
                    "coords": (rt.stage, rt.dp_rank),
                    "rounds": (ep.rounds, ep.failed) if ep is not None else None,
                    "beside": rt.lane.tasks_beside,
                }
        finally:
            await rt.aclose()
        return out

    return run(main()), ref_losses


def _whole(t):
    """An FSDP shard's whole tensor (a collective over its replicas), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


CONFIGS = [("bfw", True), ("zbh1", True), ("plan", True), ("bfw", False)]
V_CONFIGS = [("bfw", True), ("zbv", True), ("plan", True)]


def _fail_rounds(agreement, every: int) -> None:
    """Every ``every``-th round agrees on nothing, on every member alike (a round's number is the
    same everywhere): the members must retry it, whatever they offered."""
    from rrfp.comm.ep_agreement import Outcome

    agree = agreement.agree

    async def failing(offered, preferred):
        outcome = await agree(offered, preferred)
        if agreement.rounds % every == 0:
            agreement.failed += 1
            return Outcome(None, outcome.somewhere)
        return outcome

    agreement.agree = failing


def _check(results, configs):
    """Every gradient and parameter equals the reference's; the replicas' mean loss its loss."""
    for cfg in configs:
        means = []
        for rank, (out, _) in results.items():
            r = out[cfg]
            assert r["grad_err"] < 1e-10, (cfg, rank, r["grad_err"])
            assert r["param_err"] < 1e-10, (cfg, rank, r["param_err"])
            if r["losses"][0]:  # the last stage's rank
                means.append([sum(ls.values()) / len(ls) for ls in r["losses"]])
        ref = next(iter(results.values()))[1]
        assert len(means) == 2
        for step in range(STEPS):
            assert abs(sum(m[step] for m in means) / 2 - ref[step]) < 1e-12, (cfg, step)


def _orders_differ(results, cfg) -> bool:
    """Whether the two replicas of some pipeline rank ran different task sequences."""
    by_rank = {}
    for out, _ in results.values():
        r = out[cfg]
        by_rank.setdefault(r["coords"][0], []).append(r["orders"])
    return any(a != b for a, b in by_rank.values())


def _exact(results, configs):
    _check(results, configs)
    for out, _ in results.values():
        assert all(out[c]["rounds"][0] >= 2 * M * STEPS for c in configs), "EP tasks are agreed"
    # each replica plans from its own durations: they run the microbatches in different orders, so
    # tokens of different microbatches meet at the experts (under BFW and ZB-H1 the orders differ
    # only where a stage without MoE layers leaves room: test_replicas_that_must_order_differently)
    assert _orders_differ(results, ("plan", True))


@pytest.mark.timeout(420)
def test_pp2_ep2_replicas_with_their_own_durations_equal_one_process():
    """ready BFW, ZB-H1 and plan with the split backward, and BFW without it."""
    _exact(run_ranks(_pipeline, 4, 2, CONFIGS, 1, _reference(), timeout=400), CONFIGS)


@pytest.mark.timeout(420)
def test_pp2_ep2_two_stages_per_rank_one_without_moe():
    """V = 2 (v placement): rank 0 holds the stage without a MoE layer (free of the agreement)
    beside the last stage."""
    _exact(run_ranks(_pipeline, 4, 2, V_CONFIGS, 2, _reference(), timeout=400), V_CONFIGS)


@pytest.mark.timeout(420)
def test_replicas_that_must_order_differently_stay_exact():
    """Ready BFW and ZB-H1 with orders that differ by construction, not by timing. With every
    stage holding a MoE layer the replicas' orders cannot differ under these hints: each stage's
    F and B (and the first stage's W) are agreed class by class, both rank microbatches by index
    alike, and the one free task, the last stage's W, runs as soon as its B is done, before the
    next round can agree. So stage 0 here is dense (free of the agreement) and replica 0 holds
    one microbatch at a time: its stage 0 can only run F0 B0 W0 F1 B1 W1 ..., while replica 1,
    whose budget admits F1 as soon as F0 is done, ranks F1 above W0 under both hints and so never
    runs W0 straight after B0 while F1 waits."""
    configs = [("bfw", True), ("zbh1", True)]
    opts = {"blocks": ("dense", "dense", "moe", "moe"), "tight": True}
    results = run_ranks(_pipeline, 4, 2, configs, 1, _reference(opts["blocks"]), opts, timeout=400)
    _check(results, configs)
    alone = [f"{k}{m}@0" for m in range(M) for k in "FBW"]
    for c in configs:
        first = {
            r["coords"][1]: r["orders"]
            for out, _ in results.values()
            if (r := out[c])["coords"][0] == 0
        }
        assert all(order == alone for order in first[0]), (c, first[0])
        assert all(order != alone for order in first[1]), (c, first[1])
        assert _orders_differ(results, c)


@pytest.mark.timeout(420)
def test_pp2_ep2_over_fsdp_replicas_equal_one_process():
    """FSDP2 (dp_shard 2 = ep 2): the stages fully_shard over the replicas, the experts left out
    (the EP group shards them), under ready BFW and ZB-H1 with the split backward."""
    configs = [("bfw", True), ("zbh1", True)]
    results = run_ranks(_pipeline, 4, 2, configs, 1, _reference(), {"fsdp": True}, timeout=400)
    _check(results, configs)
    for out, _ in results.values():
        assert all(out[c]["rounds"][0] >= 2 * M * STEPS for c in configs), "EP tasks are agreed"


@pytest.mark.timeout(420)
def test_rounds_that_agree_on_nothing_are_retried_and_stay_exact():
    """Every third round fails on every member (as a round fails when no class is offered
    everywhere), with replica 1's first stage four times slower: the members retry at once when
    their offer holds every class offered somewhere, else once it grew, and stay exact."""
    configs = [("bfw", True), ("zbh1", True)]
    results = run_ranks(
        _pipeline, 4, 2, configs, 1, _reference(), {"slow": 4.0, "fail_every": 3}, timeout=200
    )
    _check(results, configs)
    for out, _ in results.values():
        assert all(out[c]["rounds"][1] >= 2 * M * STEPS // 3 for c in configs), "rounds failed"


@pytest.mark.timeout(420)
def test_all_to_alls_with_a_w_beside_stay_exact():
    """The overlap: while an EP task waits at its all-to-all, the lane runs a ready W beside it
    (one that issues no EP collective), each replica with its own seeds and so its own W's in its
    own windows; ready BFW, ZB-H1 and plan stay exact. The holds (tests/harness/overlap_holds.py)
    make it happen in every iteration whatever the load: on the last stage W0 runs beside F1's
    all-to-all, and on the first stage, where every W issues all-to-alls, W0 is ready at B1's or
    a later forward's window and must not run beside it."""
    configs = [("bfw", True), ("zbh1", True), ("plan", True)]
    results = run_ranks(_pipeline, 4, 2, configs, 1, _reference(), {"overlap": True}, timeout=400)
    _exact(results, configs)
    for out, _ in results.values():
        last = out[configs[0]]["coords"][0] == 1
        beside = [out[c]["beside"] for c in configs]  # the lane's count, over the configs so far
        if last:  # at least W0 in each iteration
            assert all(b >= STEPS * (i + 1) for i, b in enumerate(beside)), beside
        else:
            assert beside[-1] == 0, beside
