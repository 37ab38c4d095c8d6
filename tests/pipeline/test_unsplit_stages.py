"""Stages left unsplit in a split schedule (schedule.unsplit_stages): B runs the stage's whole
backward, W nothing, and the results are the reference's."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from harness.whole_model import as_tensors, small_gpt, small_gpt_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rrfp.pipeline.schedule_settings import ScheduleSettings, unsplit_stages_of
from rrfp.pipeline.worker import WHOLE_STAGE, StageWorker


def _mlp(width: int, depth: int) -> nn.Module:
    return nn.Sequential(
        *[
            m
            for _ in range(depth)
            for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
        ]
    )


def _reference_grads(module: nn.Module, x, g, loss_fn, y):
    ref = _mlp(x.shape[-1], len(module) // 3).double()
    ref.load_state_dict(module.state_dict())
    xr = x.clone().requires_grad_(True)
    out = ref(xr)
    if loss_fn is not None:
        loss_fn(out, y).backward()
    else:
        out.backward(g)
    return xr.grad, {n: p.grad for n, p in ref.named_parameters()}


@settings(max_examples=25, deadline=None)
@given(
    position=st.sampled_from(["first", "middle", "last"]),
    weight_split=st.sampled_from(["autograd", "functions"]),
    width=st.integers(1, 24),
    depth=st.integers(1, 3),
    rows=st.integers(1, 6),
)
def test_a_whole_stage_has_every_gradient_after_b_and_w_adds_nothing(
    position, weight_split, width, depth, rows
):
    torch.manual_seed(width * 31 + depth)
    module = _mlp(width, depth).double()
    stage = {"first": 0, "middle": 1, "last": 2}[position]
    x = torch.randn(rows, width, dtype=torch.float64)
    y = torch.randn(rows, width, dtype=torch.float64)
    g = torch.randn(rows, width, dtype=torch.float64)
    loss_fn = (lambda out, t: ((out - t) ** 2).mean()) if position == "last" else None
    ref_in, ref_grads = _reference_grads(module, x, g, loss_fn, y)

    w = StageWorker(module, stage, 3, 1, loss_fn, split=True, weight_split=weight_split, whole=True)
    w.forward(0, x, y if position == "last" else None)
    grad_in = w.backward(0, None if position == "last" else g)
    if position == "first":
        assert grad_in is None
    else:
        torch.testing.assert_close(grad_in, ref_in, rtol=0, atol=1e-12)
    after_b = {n: p.grad.clone() for n, p in module.named_parameters()}
    for n, grad in after_b.items():
        # the reference divides its loss by nothing; the worker's last stage by M = 1
        torch.testing.assert_close(grad, ref_grads[n], rtol=0, atol=1e-12, msg=n)
    with pytest.raises(RuntimeError, match="in flight"):
        w.reset()  # W is still a task of the schedule: the microbatch is not done without it
    w.weight(0)
    for n, p in module.named_parameters():
        assert torch.equal(p.grad, after_b[n]), f"W changed {n}'s gradient"
    w.reset()
    summary = w.split_summary()
    assert set(summary.in_b) == {n for n, _ in module.named_parameters()}
    assert set(summary.in_b.values()) == {WHOLE_STAGE}


def test_a_whole_stage_runs_no_split_function():
    """The split's own cost in F (the split-aware functions, the graph's analysis) is what an
    unsplit stage saves: its graph holds plain autograd nodes only."""
    module = _mlp(8, 2).double()
    names = set()
    for whole in (False, True):
        w = StageWorker(module, 1, 3, 1, None, split=True, weight_split="functions", whole=whole)
        out = module_output = w.forward(0, torch.randn(4, 8, dtype=torch.float64))
        assert out is not None
        slot = w._slots[0]
        node, seen, stack = slot.output.grad_fn, set(), [slot.output.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(c for c, _ in node.next_functions)
        names.add((whole, frozenset(n.name() for n in seen)))
        w.backward(0, torch.ones_like(module_output))
        w.weight(0)
        w.reset()
    split_nodes = dict(names)
    assert "_LayerNormFnBackward" in split_nodes[False]
    assert not any("Fn" in n for n in split_nodes[True]), split_nodes[True]


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.out = _mlp(6, 2), nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.out(h) + h


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("count_bytes", [False, True])
def test_a_whole_stage_with_activation_checkpointing(reentrant, count_bytes):
    """A checkpointed region is recomputed once, in B, as in an unsplit run; counting the saved
    bytes (a byte budget) changes nothing of it."""
    torch.manual_seed(0)
    module = _Checkpointed(reentrant).double()
    ref = _Checkpointed(reentrant).double()
    ref.load_state_dict(module.state_dict())
    x, g = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    w = StageWorker(
        module,
        1,
        3,
        1,
        None,
        split=True,
        weight_split="functions",
        whole=True,
        measure_activations=count_bytes,
    )
    w.forward(0, x)
    assert (w.activation_bytes(0) > 0) == count_bytes
    torch.testing.assert_close(w.backward(0, g), xr.grad, rtol=0, atol=1e-12)
    w.weight(0)
    for (n, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=n)


def test_whole_needs_a_split_worker():
    with pytest.raises(ValueError, match="split=False"):
        StageWorker(_mlp(4, 1), 0, 2, 1, None, split=False, whole=True)


@pytest.mark.parametrize(
    "stages,n,expected",
    [((), 4, set()), ((-1,), 4, {3}), ((0, -1), 2, {0, 1}), ((2, -4), 4, {2, 0})],
)
def test_unsplit_stages_resolve_from_the_last(stages, n, expected):
    assert unsplit_stages_of(stages, n) == expected


@pytest.mark.parametrize(
    "stages,match",
    [((4,), "out of range"), ((-5,), "out of range"), ((1, -3), "twice"), ((True,), "not a")],
)
def test_unsplit_stages_refuse_what_is_not_a_stage(stages, match):
    with pytest.raises(ValueError, match=match):
        unsplit_stages_of(stages, 4)


def test_unsplit_stages_need_a_split_schedule():
    with pytest.raises(ValueError, match="needs a split backward"):
        ScheduleSettings.of(4, hint="1f1b", unsplit_stages=[-1])
    assert ScheduleSettings.of(4, hint="bfw", unsplit_stages=[-1]).unsplit_stages == (-1,)


# -- on real gloo ranks, against one process -----------------------------------------------

M = 4
CONFIGS = [
    ("ready", "bfw", (-1,)),
    ("fixed", "zbh1", (0,)),
    ("ready", "plan", (-1,)),
    ("fixed", "plan", (0, 1)),
]


def _one_iteration(rank, world, configs, ref):
    import torch

    from rrfp.loop import run
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    torch.set_default_dtype(torch.float64)
    model_cfg, data_cfg = small_gpt()
    batches = make_batches(data_cfg, 0, M)
    ref_loss, ref_grads = ref[0], as_tensors(ref[1])

    async def main():
        rt = PipelineRuntime.start(pp=world, timeout_s=60)
        out = {}
        try:
            for dispatch, hint, unsplit in configs:
                torch.manual_seed(0)
                module = make_stage(GPT(model_cfg), rt.stage, rt.num_stages)
                settings = ScheduleSettings.of(
                    M, dispatch=dispatch, hint=hint, unsplit_stages=unsplit
                )
                e = rt.stage_executor(module, loss_fn, settings=settings)
                res = await e.run_iteration(0, batches)
                worker = e.workers[0]
                out[(dispatch, hint, unsplit)] = (
                    max(
                        (p.grad - ref_grads[n]).abs().max().item()
                        for n, p in module.named_parameters()
                    ),
                    None if res.loss is None else abs(res.loss - ref_loss),
                    [str(t) for t in res.order],
                    worker.whole,
                )
        finally:
            await rt.aclose()
        return out

    return run(main())


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_unsplit_stages_match_the_reference():
    pp = 2
    results = run_ranks(_one_iteration, pp, CONFIGS, small_gpt_reference(M), timeout=160)
    for cfg in CONFIGS:
        whole = unsplit_stages_of(cfg[2], pp)
        for rank in range(pp):
            grad_err, loss_err, order, is_whole = results[rank][cfg]
            assert grad_err < 1e-10, f"{cfg} rank {rank}: gradient differs by {grad_err}"
            if rank == pp - 1:
                assert loss_err < 1e-12, f"{cfg}: loss differs by {loss_err}"
            assert is_whole == (rank in whole), (cfg, rank)
            assert len(order) == 3 * M, "an unsplit stage still runs its W tasks"


def _with_emulated_time(rank, world):
    from rrfp.loop import run
    from rrfp.models.gpt import GPT, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    async def main():
        async with PipelineRuntime.start(pp=world, timeout_s=60, unit_ms=1.0) as rt:
            module = make_stage(GPT(small_gpt()[0]), rt.stage, rt.num_stages)
            settings = ScheduleSettings.of(M, hint="bfw", unsplit_stages=[-1])
            try:
                rt.stage_executor(module, loss_fn, settings=settings)
            except ValueError as e:
                return str(e)
            return None

    return run(main())


@pytest.mark.multirank
@pytest.mark.timeout(100)
def test_unsplit_stages_are_refused_with_emulated_time():
    """The emulation draws a split W for every stage: an unsplit one would be timed wrongly."""
    for said in run_ranks(_with_emulated_time, 2, timeout=80).values():
        assert said is not None and "emulated time" in said, said
