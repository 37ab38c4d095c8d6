"""Global gradient clipping across the pipeline (PipelineRuntime.clip_grad_norm_), on real gloo
ranks in float64: the total norm and the clipped gradients are those of
torch.nn.utils.clip_grad_norm_ on the whole model in one process, with pipeline stages, TP shards
and replicated parameters, DP replicas and virtual stages; a non-finite norm is reported and not
applied."""

from __future__ import annotations

import functools
import math

import pytest
from harness.distributed import run_ranks
from harness.whole_model import float64

pytestmark = pytest.mark.multirank

M = 2
INF = float("inf")


def _model_and_data(dp: int):
    from rrfp.models.data import DataConfig, batches
    from rrfp.models.gpt import GPTConfig

    model_cfg = GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=32, vocab_size=256)
    data_cfg = DataConfig(seed=5, microbatch_size=2, min_seq_len=4, max_seq_len=12)
    return model_cfg, batches(data_cfg, 0, M * dp)


@functools.cache
def _reference(dp: int, norm_type: float) -> tuple[float, float, dict]:
    """torch.nn.utils.clip_grad_norm_ on the whole model in one process, in float64, once in the
    test process: (max_norm, the total norm, the clipped gradients as numpy arrays)."""
    import torch

    from rrfp.models.gpt import GPT, loss_fn

    with float64():
        model_cfg, data = _model_and_data(dp)
        torch.manual_seed(0)
        ref = GPT(model_cfg)
        (sum(loss_fn(ref(x), y) for x, y in data) / len(data)).backward()
        unclipped = torch.nn.utils.get_total_norm(
            [p.grad for p in ref.parameters()], norm_type
        ).item()
        max_norm = unclipped / 4  # small enough that clipping scales every gradient
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type).item()
        return max_norm, total, {n: p.grad.numpy() for n, p in ref.named_parameters()}


def _references(dp: int, norm_types: list[float]) -> dict:
    return {norm_type: _reference(dp, norm_type) for norm_type in norm_types}


def _clip(rank, world, pp, tp, dp, virtual, placement, references, poison):
    """``references``: ``_reference``'s for each norm type, run in that order."""
    import logging

    import torch

    from rrfp.loop import run
    from rrfp.models.gpt import GPT, full_grad_slice, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    model_cfg, data = _model_and_data(dp)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("rrfp.comm.grad_norm").addHandler(handler)

    async def main():
        rt = PipelineRuntime.start(
            pp=pp, tp=tp, dp=dp, timeout_s=60, virtual=virtual, placement=placement
        )
        out = []
        try:
            torch.manual_seed(0)
            full = GPT(model_cfg)
            modules = [make_stage(full, s, rt.num_stages, tp_group=rt.tp_group) for s in rt.stages]
            ex = rt.stage_executor(modules, loss_fn, n_microbatches=M)
            sync = rt.grad_sync(torch.nn.ModuleList(modules), ex)
            mine = data[rt.dp_rank * M : (rt.dp_rank + 1) * M]
            for norm_type, (max_norm, want_total, want) in references.items():
                for m in modules:
                    m.zero_grad(set_to_none=True)
                await ex.run_iteration(0, mine)
                await sync.sync()
                named = [(n, p) for m in modules for n, p in m.named_parameters()]
                if poison is not None:  # one element of one gradient on the last rank
                    if rank == world - 1:
                        named[-1][1].grad.view(-1)[0] = poison
                    before = {n: p.grad.clone() for n, p in named}
                total = await rt.clip_grad_norm_(max_norm, norm_type)
                if poison is not None:
                    same = all(
                        torch.allclose(p.grad, before[n], rtol=0, atol=0, equal_nan=True)
                        for n, p in named
                    )
                    out.append({"total": total, "unchanged": same, "warnings": list(warnings)})
                    continue
                err = max(
                    (p.grad - full_grad_slice(n, torch.from_numpy(want[n]), rt.tp_rank, tp))
                    .abs()
                    .max()
                    .item()
                    for n, p in named
                )
                out.append(
                    {"total": total, "want": want_total, "grad_err": err, "max_norm": max_norm}
                )
        finally:
            await rt.aclose()
        return out

    return run(main())


def _check(results, norm_types):
    for rank, out in results.items():
        for norm_type, r in zip(norm_types, out):
            assert r["total"] > r["max_norm"], "the test must clip"
            assert math.isclose(r["total"], r["want"], rel_tol=1e-12), (rank, norm_type, r)
            assert r["grad_err"] < 1e-12, (rank, norm_type, r)


def test_pp4_global_norm_and_clipped_grads():
    results = run_ranks(
        _clip, 4, 4, 1, 1, 1, "interleaved", _references(1, [2.0]), None, timeout=120
    )
    _check(results, [2.0])


def test_pp2_tp2_counts_shards_by_parts_and_replicated_once():
    results = run_ranks(
        _clip, 4, 2, 2, 1, 1, "interleaved", _references(1, [2.0, INF]), None, timeout=120
    )
    _check(results, [2.0, INF])


def test_pp2_dp2_counts_replicas_once():
    results = run_ranks(
        _clip, 4, 2, 1, 2, 1, "interleaved", _references(2, [2.0, 1.0]), None, timeout=120
    )
    _check(results, [2.0, 1.0])


@pytest.mark.parametrize("placement", ["interleaved", "v"])
def test_virtual_stages_every_stage_of_the_rank(placement):
    results = run_ranks(_clip, 2, 2, 1, 1, 2, placement, _references(1, [2.0]), None, timeout=120)
    _check(results, [2.0])


@pytest.mark.parametrize("poison", [float("nan"), INF])
def test_nonfinite_norm_reported_not_applied(poison):
    results = run_ranks(
        _clip, 2, 2, 1, 1, 1, "interleaved", _references(1, [2.0]), poison, timeout=120
    )
    for rank, (r,) in results.items():
        assert math.isnan(r["total"]) if math.isnan(poison) else r["total"] == INF, (rank, r)
        assert r["unchanged"], f"rank {rank}: a non-finite norm scaled the gradients"
        assert len(r["warnings"]) == 1 and "not clipped" in r["warnings"][0], r["warnings"]
