"""rrfp.comm: layout arithmetic, message headers, and channels over real gloo.

The multi-process tests start plain processes (not torchrun), forkserver children with torch already
imported (tests/harness/distributed.py), on a free loopback port; each child reports through a queue
and the parent kills any child still running at the deadline, so a hang fails the test instead of
the whole run."""

from __future__ import annotations

import asyncio
import datetime
import functools
import os
import queue
import time
import traceback

import pytest
import torch
from harness.distributed import _context, free_port
from harness.messages import _header_with_none, _set
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.comm.message import (
    DTYPE_CODES,
    HEADER_LEN,
    MAGIC,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_KIND,
    MAX_MESSAGE_BYTES,
    MAX_TENSORS,
    VERSION,
    Message,
    MessageError,
    TensorSpec,
    decode_header,
    encode_header,
)
from rrfp.core.layout import Coords, Layout

LAYOUTS = [(1, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (3, 2, 2), (2, 3, 4), (1, 4, 2)]


# -- layout --------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pp,tp,dp", LAYOUTS)
def test_layout_rank_coords_round_trip(pp, tp, dp):
    layout = Layout(pp * tp * dp, pp, tp, dp)
    seen = set()
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert c == Coords(c.pp, c.tp, c.dp)
        assert layout.rank_of(c.pp, c.tp, c.dp) == rank
        assert rank == c.pp * dp * tp + c.dp * tp + c.tp  # tp fastest, then dp, then pp
        seen.add(c)
    assert len(seen) == layout.world_size


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pp,tp,dp", LAYOUTS)
def test_layout_groups_partition_ranks(pp, tp, dp):
    layout = Layout(pp * tp * dp, pp, tp, dp)
    world = list(range(layout.world_size))
    for groups, size, axis in (
        (layout.tp_groups(), tp, "tp"),
        (layout.dp_groups(), dp, "dp"),
        (layout.pp_groups(), pp, "pp"),
    ):
        assert sorted(r for g in groups for r in g) == world
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only along their own axis
            others = {
                tuple(v for k, v in layout.coords(r)._asdict().items() if k != axis) for r in g
            }
            assert len(others) == 1
            assert [getattr(layout.coords(r), axis) for r in g] == list(range(size))
        assert (
            groups == getattr(layout, f"{axis}_groups")()
        )  # deterministic: same call, same answer
    assert layout.pp_groups()[0] == [layout.rank_of(s, 0, 0) for s in range(pp)]


@pytest.mark.timeout(10)
def test_layout_rejects_bad_numbers():
    with pytest.raises(ValueError, match=r"pp=3 x tp=1 x dp=1 = 3 does not match world size 4"):
        Layout(4, 3)
    with pytest.raises(ValueError, match=r"pp=2 x tp=2 x dp=2 = 8 does not match world size 4"):
        Layout(4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"pp >= 1, got pp=0"):
        Layout(4, 0)
    with pytest.raises(ValueError, match=r"tp >= 1, got tp=-2"):
        Layout(4, 2, -2, -1)
    with pytest.raises(TypeError, match="pp must be an int"):
        Layout(4, 2.0)
    layout = Layout(4, 2, 2)
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        layout.coords(4)
    with pytest.raises(ValueError, match="tp index 2"):
        layout.rank_of(0, 2, 0)


@pytest.mark.timeout(10)
def test_layout_describe_lists_every_rank():
    text = Layout(4, 2, 2).describe()
    lines = text.splitlines()
    assert "pp=2 x tp=2 x dp=1" in lines[0]
    assert lines[1].split() == ["rank", "stage", "tp", "dp"]
    assert [line.split() for line in lines[2:]] == [
        ["0", "0", "0", "0"],
        ["1", "0", "1", "0"],
        ["2", "1", "0", "0"],
        ["3", "1", "1", "0"],
    ]


# -- message headers -------------------------------------------------------------

_shapes = st.one_of(
    st.lists(
        st.integers(0, 24), max_size=MAX_DIMS
    ),  # 8 tensors * 24**6 * 8 bytes < MAX_MESSAGE_BYTES
    st.lists(st.integers(0, MAX_MESSAGE_BYTES // (8 * MAX_TENSORS)), max_size=1),
).map(tuple)
_specs = st.lists(st.tuples(st.sampled_from(list(DTYPE_CODES)), _shapes), max_size=MAX_TENSORS)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(
    iteration=st.integers(0, 1 << 40),
    microbatch=st.integers(0, 1 << 20),
    kind=st.integers(0, MAX_KIND - 1),
    specs=_specs,
)
def test_header_round_trip(iteration, microbatch, kind, specs):
    # meta tensors: headers only read dtype and shape, so huge shapes cost nothing
    tensors = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in specs]
    grads = [
        dtype.is_floating_point and (microbatch >> i) & 1 == 1 for i, (dtype, _) in enumerate(specs)
    ]
    header = encode_header(Message(iteration, microbatch, kind, tensors, grads))
    assert header.dtype == torch.int64 and tuple(header.shape) == (HEADER_LEN,)
    decoded = decode_header(header)
    assert (decoded.iteration, decoded.microbatch, decoded.kind) == (iteration, microbatch, kind)
    assert decoded.specs == tuple(
        TensorSpec(dtype, shape, g) for (dtype, shape), g in zip(specs, grads)
    )
    assert decoded.requires_grad == (grads if any(grads) else None)
    buffers = decoded.empty_tensors(device="meta")
    assert [(b.dtype, tuple(b.shape)) for b in buffers] == [(d, s) for d, s in specs]


@pytest.mark.timeout(10)
def test_header_total_size_is_bounded_before_any_allocation():
    """Each tensor within the per-tensor limit, checksum valid, yet 8 of them claim far more than a
    message may carry: refused by decoding, before a buffer is made."""
    big = [
        torch.empty(MAX_ELEMENTS, dtype=torch.float64, device="meta") for _ in range(MAX_TENSORS)
    ]
    with pytest.raises(
        MessageError,
        match=f"claim {8 * MAX_TENSORS * MAX_ELEMENTS} bytes in all, more than the "
        f"{MAX_MESSAGE_BYTES}",
    ):
        decode_header(encode_header(Message(1, 0, 0, big)))
    fits = [torch.empty(MAX_MESSAGE_BYTES // 8, dtype=torch.uint8, device="meta") for _ in range(8)]
    assert (
        decode_header(encode_header(Message(1, 0, 0, fits))).specs[0].numel
        == MAX_MESSAGE_BYTES // 8
    )
    one_more = [
        *fits[:-1],
        torch.empty(MAX_MESSAGE_BYTES // 8 + 1, dtype=torch.uint8, device="meta"),
    ]
    with pytest.raises(MessageError, match="in all"):  # one byte more than the bound
        decode_header(encode_header(Message(1, 0, 0, one_more)))


@pytest.mark.timeout(10)
def test_header_allocates_zero_dim_and_zero_size_tensors():
    tensors = [
        torch.tensor(3.5),
        torch.zeros(0, 4, dtype=torch.bfloat16),
        torch.ones(2, 0, 3, dtype=torch.bool),
    ]
    header = decode_header(encode_header(Message(1, 2, 1, tensors)))
    out = header.empty_tensors()
    assert [(t.dtype, tuple(t.shape)) for t in out] == [(t.dtype, tuple(t.shape)) for t in tensors]
    assert header.label() == "B message (iteration 1, microbatch 2)"


def _valid_header() -> torch.Tensor:
    return encode_header(Message(3, 4, 0, [torch.zeros(2, 5), torch.zeros(7, dtype=torch.int64)]))


_SLOT0, _SLOT1, _SLOT2 = (
    6,
    6 + 3 + MAX_DIMS,
    6 + 2 * (3 + MAX_DIMS),
)  # a slot: code, ndim, dims, flags
_FLAGS0, _FLAGS1 = _SLOT1 - 1, _SLOT2 - 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "corrupt,match",
    [
        (_set(0, 0x1234), "bad header magic 0x1234"),
        (_set(1, VERSION + 1), f"unknown header version {VERSION + 1}"),
        (_set(3, 5, seal=False), "checksum mismatch"),  # a microbatch number that is still valid
        (_set(_SLOT0 + 2, 3, seal=False), "checksum mismatch"),  # a dim that is still valid
        (_set(HEADER_LEN - 1, 0), "checksum mismatch"),
        (_set(2, -1), "negative iteration -1"),
        (_set(4, MAX_KIND), f"kind {MAX_KIND} is outside"),
        (_set(5, MAX_TENSORS + 1), f"claims {MAX_TENSORS + 1} tensors"),
        (_set(5, -1), "claims -1 tensors"),
        (_set(5, 1), "slot 1 is beyond its 1 tensor"),
        (_set(_SLOT0, 99), "unknown dtype code 99"),
        (_set(_SLOT0, 0), "unknown dtype code 0"),
        (_set(_SLOT1 + 1, MAX_DIMS + 1), f"has {MAX_DIMS + 1} dims"),
        (_set(_SLOT1 + 1, -3), "has -3 dims"),
        (_set(_SLOT0 + 2, -5), r"negative dim in shape \[-5, 5\]"),
        (_set(_SLOT0 + 2, 1 << 41), "more than"),
        (_set(_SLOT0 + 5, 1), "nonzero dims past its ndim 2"),
        (_set(_SLOT2, 1), "slot 2 is beyond"),
        (
            _set(_FLAGS0, 2),
            r"tensor 0 \(float32\) has flags 2; expected 0 or, for a floating tensor, 1",
        ),
        (_set(_FLAGS0, -1), "tensor 0 .* has flags -1"),
        (_set(_FLAGS1, 1), r"tensor 1 \(int64\) has flags 1"),  # only floats carry gradients
        (_set(_FLAGS0, 1, seal=False), "checksum mismatch"),  # a bit flipped in transit
        (lambda h: h[:-1], f"shape \\[{HEADER_LEN}\\]"),
        (lambda h: h.to(torch.int32), "int64 tensor"),
    ],
)
def test_corrupt_header_raises_message_error(corrupt, match):
    decode_header(_valid_header())  # the uncorrupted one is fine
    with pytest.raises(MessageError, match=match):
        decode_header(corrupt(_valid_header()))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [_valid_header, _header_with_none], ids=["tensors", "with-none"])
@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, HEADER_LEN - 1), value=st.integers(-(1 << 63), (1 << 63) - 1))
def test_any_single_corruption_decodes_or_raises_message_error(make, index, value):
    try:  # re-sealed: a sender that wrote a bad value
        decode_header(_set(index, value)(make()))
    except MessageError:
        pass
    original = make()
    if original[index].item() != value:  # in transit: any changed word is an error
        with pytest.raises(MessageError):
            decode_header(_set(index, value, seal=False)(original))


@pytest.mark.timeout(10)
def test_encode_rejects_what_a_header_cannot_describe():
    with pytest.raises(MessageError, match="9 tensors"):
        encode_header(Message(0, 0, 0, [torch.zeros(1)] * 9))
    with pytest.raises(MessageError, match="complex64"):
        encode_header(Message(0, 0, 0, [torch.zeros(1, dtype=torch.complex64)]))
    with pytest.raises(MessageError, match="7 dims"):
        encode_header(Message(0, 0, 0, [torch.zeros([1] * 7)]))
    with pytest.raises(MessageError, match="microbatch must be >= 0"):
        encode_header(Message(0, -1, 0, []))
    with pytest.raises(
        MessageError, match="payload 0 has dtype torch.int64 but is marked as requiring grad"
    ):
        encode_header(Message(0, 0, 0, [torch.zeros(1, dtype=torch.int64)], [True]))
    with pytest.raises(MessageError, match="payload 1 is None but marked as requiring grad"):
        encode_header(Message(0, 0, 0, [torch.zeros(1), None], [True, True]))
    with pytest.raises(
        MessageError, match=r"requires_grad must be one bool per tensor \(2\), got \[True\]"
    ):
        encode_header(Message(0, 0, 0, [torch.zeros(1), None], [True]))
    assert isinstance(MessageError("x"), ValueError)
    assert decode_header(encode_header(Message(0, 0, 0, []))).specs == ()
    assert _valid_header()[0].item() == MAGIC


# -- channels over real gloo ------------------------------------------------------

ORDER = [3, 0, 4, 1, 2]  # microbatches go out in this order; receivers must see it unchanged
ITERATION = 7


def _child(rank, world, port, results, scenario, pg_timeout_s):
    """Run one rank; report (rank, status, value); leave without gloo teardown."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    status = "ok"
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = scenario(rank, world, pg_timeout_s)
    except BaseException:
        status, value = "error", traceback.format_exc()
    results.put((rank, status, value))
    results.close()
    results.join_thread()  # flush before os._exit skips the queue's feeder thread
    os._exit(0 if status == "ok" else 1)


def _run_ranks(scenario, world, *, pg_timeout_s, reporters=None, deadline_s=45.0):
    """Start ``world`` ranks running ``scenario``; return ({rank: value}, exit codes)."""
    reporters = set(range(world)) if reporters is None else set(reporters)
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child, args=(r, world, port, results, scenario, pg_timeout_s), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    values, deadline = {}, time.monotonic() + deadline_s
    try:
        while len(values) < len(reporters):
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(reporters - values.keys())
                pytest.fail(f"ranks {missing} did not report within {deadline_s} s (hang?)")
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    return values, [p.exitcode for p in procs]


def _message(stage: int, mb: int, kind: int) -> Message:
    """What ``stage`` sends for microbatch ``mb``: variable length, mixed dtypes."""
    length = 2 + (5 * mb + 3 * stage) % 7
    g = torch.Generator().manual_seed(1000 * kind + 10 * stage + mb)
    if kind == 0:  # activations and token ids
        tensors = [
            torch.randn(length, 3, generator=g),
            torch.randint(-1000, 1000, (length,), generator=g),
        ]
        if mb == 2:
            tensors.append(torch.zeros(0, 4, dtype=torch.uint8))  # zero-size: header only
    else:  # gradients and a 0-dim scale
        tensors = [
            torch.randn(length, 3, generator=g, dtype=torch.float64).to(torch.bfloat16),
            torch.randn((), generator=g).to(torch.float16),
        ]
        if mb == 4:
            tensors += [
                torch.rand(length, generator=g) > 0.5,
                torch.arange(length, dtype=torch.int32),
            ]
    return Message(ITERATION, mb, kind, tensors)


def _check(msg: Message, sender_stage: int, mb: int, kind: int) -> None:
    want = _message(sender_stage, mb, kind)
    assert (msg.iteration, msg.microbatch, msg.kind) == (
        want.iteration,
        want.microbatch,
        want.kind,
    ), f"got {msg.label()}, expected {want.label()} (FIFO order broken?)"
    assert len(msg.tensors) == len(want.tensors)
    for got, exp in zip(msg.tensors, want.tensors):
        assert got.dtype == exp.dtype and got.shape == exp.shape, (
            got.dtype,
            got.shape,
            exp.dtype,
            exp.shape,
        )
        assert torch.equal(got, exp), f"{want.label()}: values differ"


def _pipeline_scenario(rank, world, pg_timeout_s):
    import torch.distributed as dist
    import uvloop

    from rrfp.comm.pipeline_channels import create_pipeline_channels

    layout = Layout(world, world)
    channels = create_pipeline_channels(layout, rank, pg_timeout_s)
    stage, last = layout.coords(rank).pp, layout.pp - 1
    received: list[str] = []
    timed_out_first = None

    async def forward(to_backward: asyncio.Queue) -> None:
        nonlocal timed_out_first
        if stage == 0:
            await asyncio.sleep(0.3)  # so stage 1's first, short-deadline recv times out
        for i, mb in enumerate(ORDER):
            if channels.fwd_in is not None:
                msg = None
                if stage == 1 and i == 0:  # a timed-out recv must not lose its message
                    try:
                        async with asyncio.timeout(0.05):
                            msg = await channels.fwd_in.recv()
                        timed_out_first = False
                    except TimeoutError:
                        timed_out_first = True
                if msg is None:
                    msg = await channels.fwd_in.recv()
                _check(msg, stage - 1, mb, 0)
                received.append(f"F{mb}")
            if channels.fwd_out is not None:
                await channels.fwd_out.send(_message(stage, mb, 0))
            if stage == last:
                to_backward.put_nowait(mb)

    async def backward(to_backward: asyncio.Queue) -> None:
        for mb in ORDER:
            if channels.bwd_in is not None:
                msg = await channels.bwd_in.recv()
                _check(msg, stage + 1, mb, 1)
                received.append(f"B{mb}")
            else:
                assert await to_backward.get() == mb
            if channels.bwd_out is not None:
                await channels.bwd_out.send(_message(stage, mb, 1))

    async def main() -> None:
        async with channels:
            to_backward: asyncio.Queue = asyncio.Queue()
            async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
                tg.create_task(forward(to_backward))
                tg.create_task(backward(to_backward))

    uvloop.run(main())
    ends = ("fwd_in", "fwd_out", "bwd_in", "bwd_out")
    names = {k: getattr(channels, k).name if getattr(channels, k) else None for k in ends}
    whole = {k: getattr(channels, k).whole for k in ends if getattr(channels, k)}
    dist.destroy_process_group()  # clean teardown works once the channels are closed
    return {
        "received": received,
        "names": names,
        "timed_out_first": timed_out_first,
        "whole": whole,
    }


def _whole_messages(stage: int, kind: int) -> int:
    """How many of ``stage``'s messages of ``kind`` fit the largest payload before them: those
    travel in one operation (rrfp/comm/packed.py)."""
    from rrfp.comm.packed import payload_bytes

    count, capacity = 0, 0
    for mb in ORDER:
        size = payload_bytes(_message(stage, mb, kind).tensors)
        count += 0 < size <= capacity
        capacity = max(capacity, size)
    return count


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_pipeline_channels_fifo_exact_values_pp4():
    values, exit_codes = _run_ranks(_pipeline_scenario, 4, pg_timeout_s=30)
    assert exit_codes == [0, 0, 0, 0]
    assert values[0]["received"] == [f"B{mb}" for mb in ORDER]
    assert values[3]["received"] == [f"F{mb}" for mb in ORDER]
    for rank in (1, 2):
        got = values[rank]["received"]
        assert [x for x in got if x[0] == "F"] == [f"F{mb}" for mb in ORDER]
        assert [x for x in got if x[0] == "B"] == [f"B{mb}" for mb in ORDER]
    assert values[1]["timed_out_first"] is True
    assert values[1]["names"] == {
        "fwd_in": "fwd 0->1 (rank 0 -> rank 1)",
        "fwd_out": "fwd 1->2 (rank 1 -> rank 2)",
        "bwd_in": "bwd 2->1 (rank 2 -> rank 1)",
        "bwd_out": "bwd 1->0 (rank 1 -> rank 0)",
    }
    assert values[0]["names"]["fwd_in"] is None and values[0]["names"]["bwd_out"] is None
    assert values[3]["names"]["fwd_out"] is None and values[3]["names"]["bwd_in"] is None
    # a message up to the largest before it comes in one operation, counted alike at both ends
    for rank in range(4):
        whole = values[rank]["whole"]
        if rank < 3:
            assert (
                whole["fwd_out"] == values[rank + 1]["whole"]["fwd_in"] == _whole_messages(rank, 0)
            )
        if rank > 0:
            assert (
                whole["bwd_out"] == values[rank - 1]["whole"]["bwd_in"] == _whole_messages(rank, 1)
            )
    senders = [(s, 0) for s in range(3)] + [(s, 1) for s in range(1, 4)]
    assert all(_whole_messages(s, k) for s, k in senders), "the test packs no message"


# rows of a message that rank 0 posts, in batches posted back to back, each batch awaited before
# the next: a new largest payload goes in parts on the channel's thread, one that fits the largest
# so far whole, begun on the loop's thread when nothing of the channel's is ahead of it
POSTED = [[6], [2, 9, 3], [4, 5], [12, 1, 2], [14, 13], [3]]


def _posted(mb: int, rows: int) -> Message:
    g = torch.Generator().manual_seed(mb)
    return Message(ITERATION, mb, 0, [torch.randn(rows, 3, generator=g)])


def _posting_scenario(rank, world, pg_timeout_s, prepared: bool = False):
    import threading

    import uvloop

    import rrfp.comm.channels as channels_module
    from rrfp.comm.pipeline_channels import create_pipeline_channels

    channels = create_pipeline_channels(Layout(world, world), rank, pg_timeout_s)
    flat = [rows for batch in POSTED for rows in batch]
    packed_on: list[str] = []  # the thread that packed each whole message
    pack = channels_module.pack

    def packing(*args):
        packed_on.append(threading.current_thread().name)
        return pack(*args)

    channels_module.pack = packing

    async def main():
        async with channels:
            if rank == 0:
                stamps = []
                for batch in POSTED:
                    start = len(stamps)
                    msgs = [_posted(start + i, rows) for i, rows in enumerate(batch)]
                    # with ``prepared``, a batch's messages are all made off the loop before the
                    # first is posted: a later one was made for the capacity before an earlier
                    # one of the batch raised it
                    made = [
                        await asyncio.to_thread(channels.fwd_out.prepare, msg) if prepared else None
                        for msg in msgs
                    ]
                    posted = []
                    for msg, ready in zip(msgs, made):
                        msg.times = {"posted": time.time()}
                        stamps.append(msg.times)
                        posted.append(channels.fwd_out.post(msg, prepared=ready))
                    await asyncio.gather(*posted)
                    assert all("taken" in t for t in stamps[start:])
                return {"stamps": stamps, "whole": channels.fwd_out.whole, "packed_on": packed_on}
            got = []
            for mb, rows in enumerate(flat):
                msg = await channels.fwd_in.recv()
                want = _posted(mb, rows)
                assert msg.microbatch == mb, f"got {msg.label()}, expected {want.label()}"
                assert torch.equal(msg.tensors[0], want.tensors[0])
                got.append(msg.times["received"])
            return {"received": got, "whole": channels.fwd_in.whole}

    return uvloop.run(main())


@pytest.mark.multirank
@pytest.mark.timeout(90)
@pytest.mark.parametrize("prepared", [False, True])
def test_posted_messages_keep_their_order_where_the_loop_begins_them(prepared):
    """``Channel.post``: a whole message with nothing ahead begins on the loop's thread, the
    others queue on the channel's thread; messages posted back to back still arrive in order,
    exact, and each carries its stamps in the order of its way. ``prepared``: each message made
    by ``Channel.prepare`` on another thread first (the lane's, in the executor), and a whole
    one then sent from the buffer packed there, also when made before the capacity grew."""
    scenario = functools.partial(_posting_scenario, prepared=prepared)
    values, exit_codes = _run_ranks(scenario, 2, pg_timeout_s=30)
    assert exit_codes == [0, 0]
    sender, receiver = values[0], values[1]
    flat = [rows for batch in POSTED for rows in batch]
    whole = sum(rows <= max(flat[:i], default=0) for i, rows in enumerate(flat))
    assert sender["whole"] == receiver["whole"] == whole
    for times, received in zip(sender["stamps"], receiver["received"]):
        assert times["posted"] <= times["sent"] <= times["taken"]
        assert times["sent"] <= received
    # each whole message is packed once: where it was made when it fitted the capacity then (the
    # batch's messages are made before any is posted); else, as the batch [14, 13]'s 13, which
    # fits only once its 14 went, on the loop's thread or the channel's
    made_fitting = sum(
        rows <= max(flat[: sum(map(len, POSTED[:b]))], default=0)
        for b, batch in enumerate(POSTED)
        for rows in batch
    )
    where = sender["packed_on"]
    made_there = [t for t in where if t != "MainThread" and "rrfp-waiter" not in t]
    assert len(where) == whole, where
    assert len(made_there) == (made_fitting if prepared else 0) < whole, where


DEAD_EXIT_CODE = 17


def _peer_failure_scenario(rank, world, pg_timeout_s, *, dies: bool):
    import torch.distributed as dist

    from rrfp.comm.channels import PeerError
    from rrfp.comm.pipeline_channels import create_pipeline_channels

    channels = create_pipeline_channels(Layout(world, world), rank, pg_timeout_s)
    dist.barrier()
    if rank == 1:
        if dies:
            os._exit(DEAD_EXIT_CODE)  # abrupt: no teardown, sockets closed by the kernel
        time.sleep(pg_timeout_s + 1.5)  # alive but silent until rank 0 has timed out
        os._exit(0)

    async def main():
        async with channels:
            start = time.monotonic()
            try:
                await channels.bwd_in.recv()
            except PeerError as e:
                elapsed, first = time.monotonic() - start, str(e)
            else:
                raise AssertionError("recv() from a dead or silent peer returned")
            try:  # the channel stays failed, and says so at once
                await channels.bwd_in.recv()
            except PeerError as e:
                again = str(e)
            return {"elapsed": elapsed, "error": first, "again": again}

    return asyncio.run(main())


def _dead_peer_scenario(rank, world, pg_timeout_s):
    return _peer_failure_scenario(rank, world, pg_timeout_s, dies=True)


def _silent_peer_scenario(rank, world, pg_timeout_s):
    return _peer_failure_scenario(rank, world, pg_timeout_s, dies=False)


@pytest.mark.multirank
@pytest.mark.timeout(60)
def test_dead_peer_surfaces_as_peer_error():
    timeout_s = 5
    values, exit_codes = _run_ranks(_dead_peer_scenario, 2, pg_timeout_s=timeout_s, reporters=[0])
    assert exit_codes[1] == DEAD_EXIT_CODE
    result = values[0]
    error = result["error"]
    assert error.startswith("rank 0: channel bwd 1->0 (rank 1 -> rank 0): receive of header")
    assert "from rank 1 failed" in error
    # gloo notices the closed socket at once; the PG timeout is only the upper bound
    assert result["elapsed"] < timeout_s + 3, result
    assert "failed earlier" in result["again"]


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(60)
def test_silent_peer_times_out_after_pg_timeout():
    timeout_s = 3
    values, _ = _run_ranks(_silent_peer_scenario, 2, pg_timeout_s=timeout_s, reporters=[0])
    result = values[0]
    assert "Timed out" in result["error"] and "process-group timeout" in result["error"]
    assert "channel bwd 1->0" in result["error"] and "rank 1" in result["error"]
    assert timeout_s - 0.5 < result["elapsed"] < timeout_s + 3, result
