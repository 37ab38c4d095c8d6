"""Stage boundaries that carry several tensors: headers with None and mixed
dtypes, channels that skip None payloads, StageWorker with tuple inputs and
outputs, and a two-stage pipeline over real gloo that matches a
single-process reference whose boundary is (hidden, int64 mask, None, summary),
the receiving stage taking it as one tuple, as separate arguments or as *args.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from harness.distributed import run_ranks
from harness.messages import _header_with_none, _set
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rrfp.comm.message import (
    DTYPE_CODES,
    HEADER_LEN,
    MAX_DIMS,
    MAX_TENSORS,
    NONE_CODE,
    NONE_SPEC,
    Message,
    MessageError,
    TensorSpec,
    decode_header,
    encode_header,
)
from rrfp.pipeline.worker import StageWorker

_SLOT = 3 + MAX_DIMS  # dtype code, ndim, dims, flags
_SLOT0 = 6


def _slot(i: int) -> int:
    return _SLOT0 + i * _SLOT


# -- headers -------------------------------------------------------------------

_entries = st.lists(
    st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from(list(DTYPE_CODES)),
            st.lists(st.integers(0, 9), max_size=MAX_DIMS).map(tuple),
        ),
    ),
    max_size=MAX_TENSORS,
)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(entries=_entries, microbatch=st.integers(0, 1 << 20))
def test_header_round_trip_with_none_and_mixed_dtypes(entries, microbatch):
    tensors = [None if e is None else torch.empty(e[1], dtype=e[0], device="meta") for e in entries]
    decoded = decode_header(encode_header(Message(2, microbatch, 1, tensors)))
    assert decoded.microbatch == microbatch
    assert decoded.specs == tuple(NONE_SPEC if e is None else TensorSpec(*e) for e in entries)
    buffers = decoded.empty_tensors(device="meta")
    assert [None if b is None else (b.dtype, tuple(b.shape)) for b in buffers] == entries


@pytest.mark.timeout(10)
def test_none_takes_a_self_describing_slot():
    h = _header_with_none()
    assert h[5].item() == 3, "None counts as a payload"
    assert h[_slot(1) : _slot(2)].tolist() == [NONE_CODE] + [0] * (2 + MAX_DIMS)
    specs = decode_header(h).specs
    assert (
        specs[1].is_none
        and specs[1].numel == 0
        and specs[1].nbytes == 0
        and str(specs[1]) == "None"
    )
    assert not specs[0].is_none and str(specs[2]) == "int64[7]"
    out = decode_header(h).empty_tensors()
    assert out[1] is None and out[0].shape == (2, 5) and out[2].dtype == torch.int64
    all_none = decode_header(encode_header(Message(0, 0, 1, [None] * MAX_TENSORS)))
    assert (
        all_none.specs == (NONE_SPEC,) * MAX_TENSORS
        and all_none.empty_tensors() == [None] * MAX_TENSORS
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "corrupt,match",
    [
        (_set(_slot(1) + 1, 1), f"tensor 1 is None \\(dtype code {NONE_CODE}\\) but has ndim 1"),
        (_set(_slot(1) + 2, 4), "tensor 1 is None .* dims \\[4, 0"),
        (_set(_slot(1) + 2 + MAX_DIMS - 1, -1), "tensor 1 is None"),
        (
            _set(_slot(1) + 2 + MAX_DIMS, 1),
            "tensor 1 is None .* and flags 1",
        ),  # a None requires no gradient
        (_set(_slot(1), NONE_CODE + 1), f"tensor 1 has unknown dtype code {NONE_CODE + 1}"),
        (_set(_slot(1), 0), "tensor 1 has unknown dtype code 0"),
        (
            _set(_slot(3), NONE_CODE),
            "slot 3 is beyond its 3 tensor",
        ),  # a None past the count is not padding
        (_set(5, 2), "slot 2 is beyond its 2 tensor"),
    ],
)
def test_corrupt_none_slot_raises_message_error(corrupt, match):
    decode_header(_header_with_none())
    with pytest.raises(MessageError, match=match):
        decode_header(corrupt(_header_with_none()))


@pytest.mark.timeout(10)
def test_encode_rejects_non_tensor_payloads():
    with pytest.raises(MessageError, match="payload 1 is a list, not a tensor or None"):
        encode_header(Message(0, 0, 0, [torch.zeros(1), [torch.zeros(1)]]))
    with pytest.raises(MessageError, match="9 tensors"):
        encode_header(Message(0, 0, 0, [None] * 9))


# -- NCCL channel (fake ops) ---------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_nccl_channel_skips_none_payloads():
    from harness.fake_cuda import connected_pair

    tx, rx, world, poller = connected_pair()
    msg = Message(0, 1, 0, [torch.randn(2, 3), None, torch.arange(4), None, torch.zeros(0, 2)])
    before = len(world.sends)
    async with asyncio.TaskGroup() as tg:
        receiving = tg.create_task(rx.recv())
        await tx.send(msg)
    got = receiving.result()
    assert got.tensors[1] is None and got.tensors[3] is None
    assert torch.equal(got.tensors[0], msg.tensors[0]) and torch.equal(
        got.tensors[2], msg.tensors[2]
    )
    assert got.tensors[4].shape == (0, 2)
    assert [tuple(op.tensor.shape) for op in world.sends[before:]] == [
        (HEADER_LEN,),
        (2, 3),
        (4,),
    ], "None and empty payloads travel in the header alone"
    await poller.aclose()


# -- a two-stage model whose boundary carries several tensors ------------------------

C, D, M = 6, 3, 4


class First(nn.Module):
    """Sends (hidden [b,t,c], int64 mask [b,t], None, summary [b,d])."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.summary = nn.Linear(C, C), nn.Linear(C, D)

    def forward(self, x):
        mask = (x[..., 0] > 0).long()
        return torch.tanh(self.hidden(x)), mask, None, self.summary(x.mean(1))


class Second(nn.Module):
    """Takes the boundary as one tuple argument."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.mix = nn.Linear(C, C), nn.Linear(D, C)

    def forward(self, inputs):
        h, mask, nothing, s = inputs
        assert nothing is None and mask.dtype == torch.int64 and not mask.requires_grad
        return self.out(h) * (1 + mask.unsqueeze(-1)) + self.mix(s).unsqueeze(1)


class SecondArgs(Second):
    """Takes the boundary as separate positional arguments, as torch's pipelining calls a stage."""

    def forward(self, h, mask, nothing, s):
        return super().forward((h, mask, nothing, s))


class SecondStar(Second):
    def forward(self, *inputs):
        assert len(inputs) == 4, f"{len(inputs)} arguments"
        return super().forward(inputs)


SECONDS = {"tuple": Second, "args": SecondArgs, "star": SecondStar}


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def _model(second: str = "tuple") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(First(), SECONDS[second]()).double()


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(2, t, C, generator=g, dtype=torch.float64),
            torch.randn(2, t, C, generator=g, dtype=torch.float64),
        )
        for t in (3, 5, 7, 4)
    ]  # sequence length differs per microbatch


def _reference(second: str = "tuple") -> tuple[float, dict]:
    """One process, plain autograd, each stage called the way its forward is written."""
    first, last = _model(second)
    call = (lambda out: last(out)) if second == "tuple" else (lambda out: last(*out))
    loss = sum(loss_fn(call(first(x)), y) for x, y in _batches()) / M
    loss.backward()
    return loss.item(), {
        f"{i}.{n}": p.grad for i, m in enumerate((first, last)) for n, p in m.named_parameters()
    }


def _grad_error(stage: int, module: nn.Module, ref: dict) -> float:
    missing = [n for n, p in module.named_parameters() if p.grad is None]
    assert not missing, missing
    return max(
        (p.grad - ref[f"{stage}.{n}"]).abs().max().item() for n, p in module.named_parameters()
    )


def _through_a_header(tensors) -> tuple:
    """What the next stage receives: buffers allocated from the header, filled from the payload."""
    buffers = decode_header(encode_header(Message(0, 0, 0, list(tensors)))).empty_tensors()
    return tuple(None if b is None else b.copy_(t) for b, t in zip(buffers, tensors))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("second", list(SECONDS))
@pytest.mark.parametrize("split", [False, True])
def test_worker_tuple_boundary_matches_reference(split, second):
    ref_loss, ref = _reference(second)
    model = _model(second)
    w0 = StageWorker(model[0], 0, 2, M, loss_fn, split)
    w1 = StageWorker(model[1], 1, 2, M, loss_fn, split)
    losses = []
    for mb, (x, y) in enumerate(_batches()):
        out = w0.forward(mb, x)
        assert isinstance(out, tuple) and out[2] is None and out[1].dtype == torch.int64
        assert not any(t.requires_grad for t in out if t is not None), "outputs go out detached"
        losses.append(w1.forward(mb, _through_a_header(out), y))
        grad_in = w1.backward(mb)
        assert isinstance(grad_in, tuple) and len(grad_in) == 4
        assert grad_in[1] is None and grad_in[2] is None, "no gradient for the int mask or the None"
        assert grad_in[0].shape == out[0].shape and grad_in[3].shape == out[3].shape
        assert w0.backward(mb, _through_a_header(grad_in)) is None
        if split:
            w1.weight(mb)
            w0.weight(mb)
    assert abs(sum(losses).item() / M - ref_loss) < 1e-12
    assert _grad_error(0, model[0], ref) < 1e-12 and _grad_error(1, model[1], ref) < 1e-12
    assert w0.inflight == w1.inflight == ()


@pytest.mark.timeout(30)
def test_first_stage_takes_a_tuple_input_as_separate_arguments():
    """The first stage's own inputs (the batch's first element) obey a received boundary's rule."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(C, C)

        def forward(self, x, mask):
            return self.lin(x) * mask.unsqueeze(-1)

    torch.manual_seed(0)
    module = Masked().double()
    x, y = _batches()[0]
    mask = (x[..., 0] > 0).double()
    w = StageWorker(module, 0, 1, 1, loss_fn, split=True)
    loss = w.forward(0, (x, mask), y)
    w.backward(0)
    w.weight(0)
    got = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    want = loss_fn(module(x, mask), y)
    want.backward()
    assert loss.item() == want.item()
    assert all(torch.equal(got[n], p.grad) for n, p in module.named_parameters())


@pytest.mark.timeout(30)
def test_worker_tuple_boundary_checks_grad_output():
    model = _model()
    w0 = StageWorker(model[0], 0, 2, M, loss_fn, split=False)
    x, _ = _batches()[0]
    h, mask, _, s = w0.forward(0, x)
    with pytest.raises(
        RuntimeError, match=r"B0 grad_output 3 shape \(2, 4\) != output 3 shape \(2, 3\)"
    ):
        w0.backward(0, (torch.zeros_like(h), None, None, torch.zeros(2, 4, dtype=s.dtype)))
    with pytest.raises(
        RuntimeError, match="B0 got 2 grad_output tensor\\(s\\) for 4 output\\(s\\)"
    ):
        w0.backward(0, (torch.zeros_like(h), None))
    with pytest.raises(RuntimeError, match="B0 needs grad_output from stage 1"):
        w0.backward(0, None)
    bad = StageWorker(nn.Identity(), 0, 2, M, loss_fn, split=False)
    with pytest.raises(RuntimeError, match="F0 output must be a tensor or a non-empty tuple/list"):
        bad.forward(0, (torch.zeros(1), [torch.zeros(1)]))


# -- over real gloo ----------------------------------------------------------------

CONFIGS = [
    ("ready", "bfw", "tuple"),
    ("fixed", "1f1b", "tuple"),
    ("ready", "bfw", "args"),
    ("fixed", "1f1b", "args"),
    ("ready", "bfw", "star"),
]


def _pipeline_rank(rank, world):
    import torch

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    batches = _batches()

    async def main():
        out = {}
        async with PipelineRuntime.start(pp=world, timeout_s=60) as rt:
            for dispatch, hint, second in CONFIGS:
                ref_loss, ref = _reference(second)
                module = _model(second)[rt.stage]
                ex = rt.stage_executor(
                    module, loss_fn, n_microbatches=M, dispatch=dispatch, hint=hint
                )
                res = await ex.run_iteration(0, batches)
                loss_err = abs(res.loss - ref_loss) if res.loss is not None else None
                out[(dispatch, hint, second)] = (
                    _grad_error(rt.stage, module, ref),
                    loss_err,
                    ex.settings.split,
                )
        return out

    return run(main())


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_pipeline_boundary_with_several_tensors_matches_reference():
    """The receiving stage takes the boundary as one tuple, as separate arguments, or as *args."""
    results = run_ranks(_pipeline_rank, 2, timeout=150)
    for cfg in CONFIGS:
        for rank in range(2):
            grad_err, loss_err, split = results[rank][cfg]
            assert split == (cfg[1] == "bfw")
            assert grad_err < 1e-12, f"{cfg} rank {rank}: gradient differs by {grad_err}"
            if rank == 1:
                assert loss_err < 1e-12, f"{cfg}: loss differs by {loss_err}"


def test_received_inputs_count_in_activation_bytes():
    """A stage keeps what it received until B, even when autograd saves none of it (here it
    saves only the joined tensor's shape): the byte budget must count it."""
    from torch import nn

    from rrfp.pipeline.worker import StageWorker

    class Join(nn.Module):
        def forward(self, inputs):
            a, b = inputs
            return torch.cat([a, b], 1) * 2

    w = StageWorker(Join(), 1, 3, 1, None, split=False)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    out = w.forward(0, (a, b))
    assert w.activation_bytes(0) == a.nbytes + b.nbytes + out.nbytes
