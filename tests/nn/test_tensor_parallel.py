"""Tensor-parallel split-aware linears and the TP GPT stage against unsharded references."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness.distributed import run_ranks

from rrfp.models.gpt import (
    GPT,
    GPTConfig,
    full_grad_slice,
    loss_fn,
    make_stage,
    tp_shard_spec,
    validate_tp,
)
from rrfp.nn.split_linear import SplitLinear, WeightGradQueue, collect_weight_grads
from rrfp.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_from_full

D = torch.float64
TOL = dict(rtol=0, atol=1e-10)


def _close(a, b, msg=""):
    torch.testing.assert_close(a, b, **TOL, msg=msg)


# -- no group: a plain split-aware linear --------------------------------------


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("use_queue", [False, True])
def test_tp1_is_split_linear(cls, bias, use_queue):
    torch.manual_seed(0)
    ref = nn.Linear(5, 7, bias=bias, dtype=D)
    torch.manual_seed(0)
    split = SplitLinear(5, 7, bias=bias, dtype=D)
    torch.manual_seed(0)
    lin = cls(5, 7, None, bias=bias, dtype=D)
    assert lin.tp == 1 and lin.group is None
    for a, b, c in zip(ref.parameters(), split.parameters(), lin.parameters()):
        assert torch.equal(a, c) and torch.equal(b, c)
    x, g = torch.randn(2, 3, 5, dtype=D), torch.randn(2, 3, 7, dtype=D)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    queue = WeightGradQueue()
    with collect_weight_grads(queue if use_queue else None):
        ys = lin(xs)
    assert torch.equal(yr, ys)
    yr.backward(g)
    ys.backward(g)
    _close(xs.grad, xr.grad)
    if use_queue:
        assert len(queue) == 1 and all(p.grad is None for p in lin.parameters())
        queue.run()
    else:
        assert len(queue) == 0
    for a, b in zip(ref.parameters(), lin.parameters()):
        _close(b.grad, a.grad)


def test_shard_from_full_fused_qkv():
    C = 8
    full = torch.arange(3 * C * 2, dtype=D).view(3 * C, 2)
    q, k, v = full.split(C)
    for r in range(2):
        want = torch.cat([q[r * 4 : (r + 1) * 4], k[r * 4 : (r + 1) * 4], v[r * 4 : (r + 1) * 4]])
        assert torch.equal(shard_from_full(full, 0, r, 2, chunks=3), want)
    assert torch.equal(shard_from_full(full, 1, 1, 2), full[:, 1:])
    assert torch.equal(shard_from_full(full, None, 1, 2), full)
    with pytest.raises(ValueError, match="tp=5"):
        shard_from_full(full, 0, 0, 5, chunks=3)


def test_full_grad_slice_names():
    assert tp_shard_spec("transformer.h.3.attn.c_attn.weight") == (0, 3)
    assert tp_shard_spec("transformer.h.3.attn.c_attn.bias") == (0, 3)
    assert tp_shard_spec("transformer.h.0.attn.c_proj.weight") == (1, 1)
    assert tp_shard_spec("transformer.h.0.mlp.c_fc.bias") == (0, 1)
    for replicated in (
        "transformer.h.0.mlp.c_proj.bias",
        "transformer.h.0.attn.c_proj.bias",
        "lm_head.weight",
        "transformer.wte.weight",
        "transformer.h.1.ln_1.weight",
    ):
        assert tp_shard_spec(replicated) is None, replicated
    w = torch.randn(4 * 8, 8, dtype=D)
    assert torch.equal(full_grad_slice("transformer.h.1.mlp.c_fc.weight", w, 1, 2), w[16:])
    assert full_grad_slice("lm_head.weight", w, 1, 2) is w


def test_from_full_uses_no_random_numbers():
    lin = SplitLinear(4, 6, dtype=D)
    torch.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    col = ColumnParallelLinear.from_full(lin, None, chunks=3)
    assert torch.equal(torch.rand(3), a)
    assert torch.equal(col.weight, lin.weight) and torch.equal(col.bias, lin.bias)


def test_validate_tp():
    cfg = GPTConfig(n_head=4, n_embd=32)
    for tp in (1, 2, 4):
        validate_tp(cfg, tp)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_head=4"):
        validate_tp(cfg, 3)
    with pytest.raises(ValueError, match=r"tp=8 does not divide n_head=4"):
        validate_tp(cfg, 8)
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            validate_tp(cfg, bad)


# -- real gloo TP groups ---------------------------------------------------------


def _mlp_ranks(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(t, *a, **kw):
        calls.append(tuple(t.shape))
        return real_all_reduce(t, *a, **kw)

    dist.all_reduce = counting_all_reduce
    in_f, hid, out_f = 6, 8, 5
    torch.manual_seed(0)
    ref1, ref2 = nn.Linear(in_f, hid, dtype=D), nn.Linear(hid, out_f, dtype=D)
    torch.manual_seed(0)
    col = ColumnParallelLinear(in_f, hid, group, dtype=D)
    row = RowParallelLinear(hid, out_f, group, dtype=D)
    part = hid // world
    # same seed: the exact slices of the reference
    assert (
        col.weight.shape == (part, in_f)
        and row.weight.shape == (out_f, part)
        and row.bias.shape == (out_f,)
    )
    assert torch.equal(col.weight, ref1.weight[rank * part : (rank + 1) * part])
    assert torch.equal(col.bias, ref1.bias[rank * part : (rank + 1) * part])
    assert torch.equal(row.weight, ref2.weight[:, rank * part : (rank + 1) * part])
    assert torch.equal(row.bias, ref2.bias)

    x, g = torch.randn(2, 3, in_f, dtype=D), torch.randn(2, 3, out_f, dtype=D)  # same on every rank
    xr = x.clone().requires_grad_()
    yr = ref2(F.gelu(ref1(xr)))
    yr.backward(g)
    for use_queue in (False, True):
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        calls.clear()
        xs = x.clone().requires_grad_()
        queue = WeightGradQueue()
        with collect_weight_grads(queue if use_queue else None):
            ys = row(F.gelu(col(xs)))
        assert calls == [(2, 3, out_f)], calls  # F: one all-reduce, of the row output
        _close(ys, yr, f"output queue={use_queue}")
        ys.backward(g)
        assert calls == [(2, 3, out_f), (2, 3, in_f)], calls  # B: one, of the column input grad
        _close(xs.grad, xr.grad, f"input grad queue={use_queue}")
        if use_queue:
            assert len(queue) == 2
            assert all(p.grad is None for p in (*col.parameters(), *row.parameters()))
            queue.run()
            assert len(calls) == 2  # W launches no collective
        sl = slice(rank * part, (rank + 1) * part)
        _close(col.weight.grad, ref1.weight.grad[sl])
        _close(col.bias.grad, ref1.bias.grad[sl])
        _close(row.weight.grad, ref2.weight.grad[:, sl])
        _close(row.bias.grad, ref2.bias.grad)
    with torch.no_grad():
        _close(row(F.gelu(col(x))), yr)

    # load_full / from_full of a fused qkv projection
    full = SplitLinear(4, 12, dtype=D)
    qkv = ColumnParallelLinear.from_full(full, group, chunks=3)
    want = torch.cat([z[rank * 2 : (rank + 1) * 2] for z in full.weight.split(4)])
    assert torch.equal(qkv.weight, want)

    # divisibility errors name the layer and the numbers
    for make, pattern in [
        (
            lambda: ColumnParallelLinear(4, 5, group),
            "ColumnParallelLinear: out_features=5 .* size 2",
        ),
        (
            lambda: RowParallelLinear(5, 4, group, name="blk.c_proj"),
            "RowParallelLinear 'blk.c_proj': in_features=5 .* size 2",
        ),
        (lambda: ColumnParallelLinear(4, 9, group, chunks=3), "out_features=9 in 3 blocks of 3"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            make()

    # a group of size 1 launches nothing
    singles = [dist.new_group([r]) for r in range(world)]
    calls.clear()
    c1, r1 = (
        ColumnParallelLinear(in_f, hid, singles[rank], dtype=D),
        RowParallelLinear(hid, out_f, singles[rank], dtype=D),
    )
    assert c1.tp == 1 and c1.group is None
    with collect_weight_grads(WeightGradQueue()):
        r1(c1(x.clone().requires_grad_())).sum().backward()
    assert calls == []
    dist.all_reduce = real_all_reduce
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.multirank
def test_column_row_mlp_matches_reference():
    assert run_ranks(_mlp_ranks, 2, timeout=60) == {0: "ok", 1: "ok"}


GPT_CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=16)


def _gpt_ranks(rank, world):
    import torch.distributed as dist

    from rrfp.pipeline.worker import StageWorker

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = GPT(GPT_CFG).double()
    stage = make_stage(model, 0, 1, tp_group=group)
    assert stage.tp == world and stage.tp_rank == rank
    C = GPT_CFG.n_embd
    blk = stage.transformer.h["0"]
    assert isinstance(blk.attn.c_attn, ColumnParallelLinear) and isinstance(
        blk.mlp.c_proj, RowParallelLinear
    )
    assert blk.attn.n_head == GPT_CFG.n_head // world
    assert blk.attn.c_attn.weight.shape == (3 * C // world, C)
    full_params = dict(model.named_parameters())
    params = dict(stage.named_parameters())
    assert set(params) == set(full_params)
    for n, p in params.items():
        assert p.grad is None
        assert torch.equal(p, full_grad_slice(n, full_params[n], rank, world)), n

    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 64, (2, T), generator=gen), torch.randint(0, 64, (2, T), generator=gen))
        for T in (12, 20)
    ]
    M = len(data)
    with torch.no_grad():
        for idx, _ in data:
            _close(stage(idx), model(idx), "logits")
    ref_losses = [loss_fn(model(i), t) for i, t in data]
    (sum(ref_losses) / M).backward()

    worker = StageWorker(stage, 0, 1, M, loss_fn, split=True)
    for m, (idx, tgt) in enumerate(data):
        assert abs(worker.forward(m, idx, tgt) - ref_losses[m].item()) < 1e-10
    worker.backward(1)
    worker.backward(0)
    for (
        n,
        p,
    ) in params.items():  # B done: every weight gradient waits for W (queued or autograd-split)
        assert p.grad is None, n
    worker.weight(0)
    worker.weight(1)
    assert worker.inflight == ()
    replicated = {}
    for n, p in params.items():
        _close(p.grad, full_grad_slice(n, full_params[n].grad, rank, world), n)
        if tp_shard_spec(n) is None:
            replicated[n] = (
                p.grad.tolist()
            )  # plain data: tensors would travel through shared memory
    dist.barrier()
    dist.destroy_process_group()
    return replicated


@pytest.mark.multirank
def test_gpt_tp2_matches_reference():
    results = run_ranks(_gpt_ranks, 2, timeout=60)
    # replicated parameters: the same gradient on every TP rank
    assert results[0].keys() == results[1].keys() and "lm_head.weight" in results[0]
    assert "transformer.h.1.mlp.c_proj.bias" in results[0]
    for n, g in results[0].items():
        assert g == results[1][n], n


def test_make_stage_rejects_bad_tp(monkeypatch):
    import rrfp.models.gpt as gpt

    fake = object()  # a "group of size 3": validation fails before any collective or shard
    monkeypatch.setattr(gpt, "group_size_rank", lambda g: (3, 0) if g is fake else (1, 0))
    with pytest.raises(ValueError, match="tp=3 does not divide n_head=4"):
        make_stage(GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16)), 0, 1, tp_group=fake)
