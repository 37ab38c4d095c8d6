"""TP and DP under readiness dispatch, on real gloo process groups: losses and
gradients match the single-process reference, and TP ranks of a stage run the
same task sequence even when their messages arrive skewed."""

from __future__ import annotations

import functools

import pytest
from harness.distributed import run_ranks, started_waits, timed_iteration, timed_outcome
from harness.whole_model import as_tensors, one_iteration

pytestmark = pytest.mark.multirank

M = 4
CONFIGS = [(e, h) for e in ("ready", "fixed") for h in ("bf", "bfw")]


class DelayedChannel:
    """Hands each message over late by a per-message delay: arrival skew."""

    def __init__(self, inner, delays):
        self.inner, self.delays, self.name, self.peer = inner, delays, inner.name, inner.peer
        self.count = 0

    async def recv(self):
        import asyncio

        msg = await self.inner.recv()
        await asyncio.sleep(self.delays[self.count % len(self.delays)])
        self.count += 1
        return msg

    async def send(self, msg):
        await self.inner.send(msg)

    async def aclose(self):
        await self.inner.aclose()


def _model_and_data():
    from rrfp.models.data import DataConfig
    from rrfp.models.gpt import GPTConfig

    return (
        GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=64),
        DataConfig(seed=3, microbatch_size=2, min_seq_len=8, max_seq_len=40),
    )


@functools.cache
def _reference(dp: int) -> tuple[float, dict]:
    """The whole model's loss and gradients over every replica's microbatches."""

    def setup():
        from rrfp.models.data import batches
        from rrfp.models.gpt import GPT, loss_fn

        model_cfg, data_cfg = _model_and_data()
        return GPT(model_cfg), loss_fn, batches(data_cfg, 0, M * dp)

    return one_iteration(setup)


def _parallel(rank, world, pp, tp, dp, ref, configs, skew, use_tp_layers, virtual=1):
    import random

    import torch

    from rrfp.loop import run
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    torch.set_default_dtype(torch.float64)
    model_cfg, data_cfg = _model_and_data()
    data = make_batches(data_cfg, 0, M * dp)
    ref_loss, ref_grads = ref[0], as_tensors(ref[1])

    async def main():
        rt = PipelineRuntime.start(
            pp=pp,
            tp=tp,
            dp=dp,
            timeout_s=60,
            unit_ms=2.0 if skew else 0.0,
            virtual=virtual,
            placement="v" if virtual == 2 else "interleaved",
        )
        if skew and rt.tp_rank == 1:
            rng = random.Random(rank)
            for channels in rt.channels.stages.values():  # every stage's, with virtual stages
                for name in ("fwd_in", "bwd_in"):
                    ch = getattr(channels, name)
                    if ch is not None:
                        setattr(
                            channels,
                            name,
                            DelayedChannel(
                                ch, [rng.choice([0, 0.002, 0.01, 0.03]) for _ in range(17)]
                            ),
                        )
        out = {}
        try:
            for cfg in configs:
                ex, hint, unsplit = (*cfg, ())[:3]  # (dispatch, hint[, unsplit stages])
                torch.manual_seed(0)
                full = GPT(model_cfg)
                modules = [
                    make_stage(
                        full, s, rt.num_stages, tp_group=rt.tp_group if use_tp_layers else None
                    )
                    for s in rt.stages
                ]
                module = modules[0] if virtual == 1 else torch.nn.ModuleList(modules)
                settings = ScheduleSettings.of(M, dispatch=ex, hint=hint, unsplit_stages=unsplit)
                e = rt.stage_executor(modules, loss_fn, settings=settings)
                sync = rt.grad_sync(module, e)
                mine = data[rt.dp_rank * M : (rt.dp_rank + 1) * M]
                res = await e.run_iteration(0, mine)
                await sync.sync()
                errs = {}
                for n, p in (p for m in modules for p in m.named_parameters()):
                    want = ref_grads[n]
                    if p.shape != want.shape:
                        from rrfp.models.gpt import full_grad_slice

                        want = full_grad_slice(n, want, rt.tp_rank, tp)
                    errs[n] = (p.grad - want).abs().max().item()
                out[cfg] = {
                    "grad_err": max(errs.values()),
                    "order": [f"{t}@{s}" for s, t in res.ran],
                    "loss": res.loss,
                    "coords": (rt.stage, rt.tp_rank, rt.dp_rank),
                    "rounds": e.agreement.rounds if e.agreement else 0,
                    "launched_early": sync.launched_early,
                    "weight_split": e.workers[0].weight_split,
                    "whole": dict(zip(rt.stages, (w.whole for w in e.workers))),
                }
        finally:
            await rt.aclose()
        return out, ref_loss

    return run(main())


def _check(results, pp, tp, dp, configs=CONFIGS):
    for cfg in configs:
        per_stage = {}
        for rank, (out, ref_loss) in results.items():
            r = out[cfg]
            assert r["grad_err"] < 1e-10, (
                f"{cfg} rank {rank} {r['coords']}: gradient differs by {r['grad_err']}"
            )
            # the default weight_split (auto): the split-aware functions, the generic split with TP
            want = "autograd" if tp > 1 else "functions"
            assert r["weight_split"] == want, f"{cfg} rank {rank}: weight_split {r['weight_split']}"
            stage, tp_rank, dp_rank = r["coords"]
            per_stage.setdefault((stage, dp_rank), []).append(r["order"])
            if r["loss"] is not None and dp == 1:
                assert abs(r["loss"] - ref_loss) < 1e-12
        for key, orders in per_stage.items():
            assert all(o == orders[0] for o in orders), (
                f"{cfg} stage/replica {key}: TP ranks ran different orders"
            )


@pytest.mark.timeout(300)
def test_dp2_pp2_matches_reference():
    results = run_ranks(_parallel, 4, 2, 1, 2, _reference(2), CONFIGS, False, False, timeout=240)
    _check(results, 2, 1, 2)
    # every bucket's all-reduce was launched from inside the iteration, as its gradients became
    # final
    assert all(r["launched_early"] > 0 for out, _ in results.values() for r in out.values())


@pytest.mark.timeout(300)
def test_tp2_pp2_replicated_agreement_under_skew():
    """Replicated layers (no TP collectives inside): shows the agreement alone
    keeps TP ranks in lockstep when one rank's messages arrive late."""
    results = run_ranks(_parallel, 4, 2, 2, 1, _reference(1), CONFIGS, True, False, timeout=240)
    _check(results, 2, 2, 1)
    rounds = [out[("ready", "bfw")]["rounds"] for out, _ in results.values()]
    assert min(rounds) >= 3 * M, "every ready decision is agreed"
    assert all(out[("fixed", "bfw")]["rounds"] == 0 for out, _ in results.values()), (
        "fixed needs no agreement"
    )


@pytest.mark.timeout(300)
def test_tp2_pp2_tensor_parallel_layers_under_skew():
    """Megatron TP layers (collectives inside F and B) with skewed arrivals:
    TP ranks agree on every task, so their collectives pair up and training
    matches the reference; without agreement they would deadlock or diverge."""
    results = run_ranks(_parallel, 4, 2, 2, 1, _reference(1), CONFIGS, True, True, timeout=240)
    _check(results, 2, 2, 1)


@pytest.mark.timeout(400)
def test_tp2_pp2_dp2_matches_reference():
    results = run_ranks(
        _parallel,
        8,
        2,
        2,
        2,
        _reference(2),
        [("ready", "bfw"), ("fixed", "bfw")],
        False,
        True,
        timeout=360,
    )
    for cfg in [("ready", "bfw"), ("fixed", "bfw")]:
        for rank, (out, _) in results.items():
            assert out[cfg]["grad_err"] < 1e-10, f"{cfg} rank {rank}: {out[cfg]['grad_err']}"


V_CONFIGS = [("ready", "bfw"), ("fixed", "zbv")]


@pytest.mark.timeout(300)
def test_virtual_stages_tp2_dp_and_agreement():
    """Two stages per rank (v placement, the turn local) with Megatron TP layers and skewed
    arrivals on pp=2 x tp=2, then DP buckets on pp=2 x dp=2: the TP ranks agree on every
    (stage, task) and run one sequence, DP averages both stages' gradients, and every
    gradient matches the one-process model."""
    results = run_ranks(_parallel, 4, 2, 2, 1, _reference(1), V_CONFIGS, True, True, 2, timeout=240)
    _check(results, 2, 2, 1, V_CONFIGS)
    assert all(out[("ready", "bfw")]["rounds"] >= 2 * 3 * M for out, _ in results.values())
    results = run_ranks(
        _parallel, 4, 2, 1, 2, _reference(2), V_CONFIGS, False, False, 2, timeout=240
    )
    _check(results, 2, 1, 2, V_CONFIGS)
    assert all(r["launched_early"] > 0 for out, _ in results.values() for r in out.values())


def _tp_peer_stuck(rank, world, progress_s, heartbeat, stuck_s):
    """tp = 2: rank 1 is stuck (alive, beating) for ``stuck_s`` before the TP all-reduce of its
    first forward; rank 0 waits there, in its task, on the lane's thread."""
    import time

    import torch

    import rrfp
    from rrfp.nn.tensor_parallel import RowParallelLinear
    from rrfp.pipeline.timeouts import Timeouts

    class Stuck(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if rank == 1:
                time.sleep(stuck_s)
            return self.inner(x[:, 4 * rank : 4 * rank + 4])  # a row-parallel layer takes a shard

    async def main(mark):
        # with the heartbeat the subject follows start-up, which is bounded apart; without it the
        # groups' 2 s is the subject, start-up's included
        waits = (
            started_waits(2.0, progress_s=progress_s)
            if heartbeat
            else Timeouts.derive(2.0, progress_s=progress_s)
        )
        async with rrfp.PipelineRuntime.start(
            pp=1, tp=2, timeout_s=2.0, timeouts=waits, heartbeat=heartbeat
        ) as rt:
            torch.manual_seed(0)
            layer = RowParallelLinear.from_full(torch.nn.Linear(8, 8), rt.tp_group)
            ex = rt.stage_executor(
                Stuck(layer), lambda y, t: ((y - t) ** 2).mean(), n_microbatches=2
            )
            await timed_iteration(ex, mark)

    return timed_outcome(main)


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_tp_peer_stuck_before_its_all_reduce_is_named_after_progress_s():
    """A TP collective waits on the lane's thread, in a task, where the heartbeat's watcher does
    not look: its group's own timeout is timeouts.progress_s, and the rank that waited names the
    peer whose heartbeat is not at the collective (rrfp/pipeline/task_collectives.py)."""
    progress_s = 4.0
    results = run_ranks(_tp_peer_stuck, 2, progress_s, True, 3 * progress_s, timeout=70)
    error, took = results[0]["error"], results[0]["took"]
    at = "the row-parallel all-reduce of inner in task F0 of stage 0"
    assert error is not None and error.startswith(f"PeerStuck: rank 0: {at}: "), results[0]
    assert "rank 1 (alive, in task F0 for " in error and "never reached it" in error, error
    assert "(timeouts.progress_s = 4 s)" in error and "\n" not in error, error
    assert progress_s - 0.5 <= took <= progress_s + 5, results[0]
    print(f"rank 0 after {took:.1f} s: {error}")


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_without_a_heartbeat_a_tp_collective_that_times_out_says_what_and_the_bound():
    """No heartbeat: the TP group's timeout is the process group's (run.timeout_s = 2 s here), and
    the line says which collective timed out and that bound, naming no one."""
    results = run_ranks(_tp_peer_stuck, 2, 4.0, False, 3 * 2.0, timeout=70)
    error, took = results[0]["error"], results[0]["took"]
    at = "the row-parallel all-reduce of inner in task F0 of stage 0"
    assert error is not None and error.startswith(f"PeerTimeout: rank 0: {at}: "), results[0]
    assert "(run.timeout_s = 2 s)" in error and "(no heartbeat to tell which)" in error, error
    assert 1.5 <= took <= 2 + 5, results[0]
    print(f"rank 0 after {took:.1f} s: {error}")


# (dispatch, hint, unsplit stages): a split schedule with a stage whose B runs its whole backward
UNSPLIT = [("ready", "bfw", (-1,)), ("fixed", "zbh1", (0,))]


def _check_whole(results, configs=UNSPLIT, num_stages=2):
    from rrfp.pipeline.schedule_settings import unsplit_stages_of

    for cfg in configs:
        unsplit = unsplit_stages_of(cfg[2], num_stages)
        for rank, (out, _) in results.items():
            whole = out[cfg]["whole"]
            assert whole == {s: s in unsplit for s in whole}, (cfg, rank, whole)


@pytest.mark.timeout(300)
def test_unsplit_stages_with_tensor_parallel_layers_match_reference():
    """A stage left unsplit runs its Megatron TP layers' whole backward in B, their collectives
    included, and its TP ranks still run one sequence and match the one-process gradients."""
    results = run_ranks(_parallel, 4, 2, 2, 1, _reference(1), UNSPLIT, False, True, timeout=240)
    _check(results, 2, 2, 1, UNSPLIT)
    _check_whole(results)


# two stages per rank (v: rank 0 holds stages 0 and 3): the unsplit one named by global number
V_UNSPLIT = [("ready", "bfw", (1,)), ("fixed", "zbv", (-1, 0))]


@pytest.mark.timeout(300)
def test_unsplit_stages_with_dp_match_reference():
    """DP's buckets launch as an unsplit stage's gradients become final in B, as a split stage's
    do in W, and average to the one-process gradients over both replicas; with two stages per
    rank, only the stages named by global number run whole."""
    results = run_ranks(_parallel, 4, 2, 1, 2, _reference(2), UNSPLIT, False, False, timeout=240)
    _check(results, 2, 1, 2, UNSPLIT)
    _check_whole(results)
    assert all(r["launched_early"] > 0 for out, _ in results.values() for r in out.values())
    results = run_ranks(
        _parallel, 4, 2, 1, 2, _reference(2), V_UNSPLIT, False, False, 2, timeout=240
    )
    _check(results, 2, 1, 2, V_UNSPLIT)
    _check_whole(results, V_UNSPLIT, num_stages=4)
