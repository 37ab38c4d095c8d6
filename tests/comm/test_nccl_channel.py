"""NcclChannel and CudaOps against the fake CUDA/NCCL of tests/harness/fake_cuda.py.

Two ranks share one fake world. ``connected_pair`` does what start-up does (an eager
group, a warm-up over the channel, in two threads); the tests then drive both ends
from one event loop, which only works because nothing blocks the host after start-up.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from harness.fake_cuda import (
    DEVICE,
    FakeCudaOps,
    FakeHang,
    FakeWorld,
    connected_pair,
    run_ranks_in_threads,
)

from rrfp.comm.channels import PeerError
from rrfp.comm.message import Message
from rrfp.comm.nccl_groups import require_eager
from rrfp.core.errors import StartupError


def message(mb: int, length: int) -> Message:
    return Message(0, mb, 0, [torch.randn(2, length, 8), torch.arange(length), torch.zeros(0, 3)])


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_variable_messages_arrive_whole_and_in_order():
    tx, rx, world, poller = connected_pair()
    sent = [message(0, 5), message(1, 11), message(2, 3)]
    got = []

    async def receive_all():
        for _ in sent:
            got.append(await rx.recv())

    async with asyncio.TaskGroup() as tg:  # a send completes only once its receive is posted
        tg.create_task(receive_all())
        for msg in sent:
            await tx.send(msg)
    for msg, g in zip(sent, got):
        assert (g.iteration, g.microbatch, g.kind) == (msg.iteration, msg.microbatch, msg.kind)
        for a, b in zip(g.tensors, msg.tensors):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert world.after_startup(world.host_syncs) == [], "a send or receive blocked the host"
    await poller.aclose()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_send_completes_only_once_its_receive_is_posted():
    tx, rx, world, poller = connected_pair()
    sending = asyncio.ensure_future(tx.send(message(4, 7)))
    await asyncio.sleep(0.05)
    assert not sending.done(), "the send finished before the receiver posted anything"
    got = await asyncio.wait_for(rx.recv(), 5)
    await asyncio.wait_for(sending, 5)
    assert got.microbatch == 4
    await poller.aclose()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_send_waits_for_its_producer_and_not_for_later_tasks():
    """Sends on time: the message's ``ready`` event gates it, not the compute stream at send."""
    tx, rx, world, poller = connected_pair()
    compute = tx.compute_stream
    delays = {}
    for gate in ("ready", "record at send time"):
        with world.use_stream(compute):
            world.kernel(0, 0.03)  # the producer
        produced = FakeCudaOps(world, 0).record_event(compute)
        with world.use_stream(compute):
            world.kernel(0, 0.03)  # the next task, enqueued before the send coroutine runs
        msg = message(0, 4)
        msg.ready = produced if gate == "ready" else None
        before = len(world.sends)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(rx.recv())
            await tx.send(msg)
        header = world.sends[before]
        delays[gate] = header.posted_at - produced.done_at
    print(
        f"send start after its producer's end: {delays['ready'] * 1e3:.2f} ms with the producer's "
        f"event, {delays['record at send time'] * 1e3:.2f} ms recording at send time (a 30 ms task "
        "enqueued between)"
    )
    assert -1e-4 <= delays["ready"] < 0.01, delays
    assert delays["record at send time"] > 0.025, delays
    await poller.aclose()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_receiver_allocates_from_headers_and_compute_waits_for_every_payload():
    tx, rx, world, poller = connected_pair()
    async with asyncio.TaskGroup() as tg:
        receiving = tg.create_task(rx.recv())
        await tx.send(message(0, 9))
    got = receiving.result()
    assert [tuple(t.shape) for t in got.tensors] == [(2, 9, 8), (9,), (0, 3)], (
        "exactly the header's shapes"
    )
    payload_works = [w for w in rx.compute_stream.waited if hasattr(w, "ops")]
    assert len(payload_works) == 2, "the compute stream waits on each non-empty payload receive"
    assert all(
        w.ops[0].kind == "recv" and w.ops[0].tensor is t for w, t in zip(payload_works, got.tensors)
    )
    await poller.aclose()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_failed_receive_names_channel_and_peer():
    world = FakeWorld(2)
    # rank 1's receives: 0 the warm-up, 1 the header, 2 the first payload
    world.failures[(1, "recv", 2)] = RuntimeError(
        "NCCL communicator was aborted: remote process exited"
    )
    tx, rx, world, poller = connected_pair(world)
    sending = asyncio.ensure_future(tx.send(message(0, 4)))
    with pytest.raises(PeerError) as info:
        await rx.recv()
    line = str(info.value)
    assert "rank 1: channel fwd 0->1" in line and "from rank 0" in line and "tensor 1/3" in line
    assert "remote process exited" in line and "\n" not in line
    with pytest.raises(PeerError, match="failed earlier"):
        await rx.recv()
    sending.cancel()
    await poller.aclose()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_peer_that_never_receives_ends_the_send_with_one_line():
    """The NCCL watchdog would only fire after its (longer) timeout: rrfp's deadline comes first."""
    tx, rx, world, poller = connected_pair(deadline_s=0.2)
    with pytest.raises(PeerError) as info:
        await tx.send(message(3, 4))
    line = str(info.value)
    assert (
        line.startswith("rank 0: channel fwd 0->1: send of the header of") and "to rank 1" in line
    )
    assert "nothing within 0.2 s" in line and "\n" not in line and info.value.peer == 1
    await poller.aclose()


def test_a_group_without_its_device_is_refused_at_startup():
    world = FakeWorld(2)

    async def main(rank):
        group = world.dist_for(rank).new_group([0, 1], backend="nccl")  # no device_id: lazy
        require_eager(group, DEVICE, "channel fwd 0->1", rank)

    with pytest.raises(
        StartupError,
        match="rank [01]: channel fwd 0->1: the NCCL group is bound to None, not "
        "cuda:0: its communicator would be created at first use",
    ):
        run_ranks_in_threads(world, main, timeout=10)


@pytest.mark.timeout(30)
def test_fake_blocks_a_bare_p2p_before_torch_2_9_until_the_peer_creates_its_pair_communicator():
    """The fake itself: the torch 2.6-2.8 lazy path (ProcessGroupNCCL::pointToPoint's two-rank
    communicator) blocks the caller until the peer creates it; CudaOps' batch of one does not."""
    world = FakeWorld(2, hang_s=0.5)

    async def bare_first_receive(rank):
        dist = world.dist_for(rank)
        fwd = dist.new_group([0, 1], backend="nccl", device_id=DEVICE)
        bwd = dist.new_group([0, 1], backend="nccl", device_id=DEVICE)
        # each rank's first operation is a receive, on different groups: the pipeline's iteration 0
        dist.irecv(torch.zeros(1), 1 - rank, group=bwd if rank == 0 else fwd)

    with pytest.raises(FakeHang, match=r"creating NCCL communicator \('pair'"):
        run_ranks_in_threads(world, bare_first_receive, timeout=10)
    assert [i.key[0] for i in world.inits].count("group") == 4, "both groups were eager"
