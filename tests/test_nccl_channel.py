"""NcclChannel against a fake CUDA/NCCL layer that records the order of operations.

No GPU here: the fake keeps tensors on the CPU, models a stream as an
ordered queue whose copies run once the Works they wait on are complete, and
matches receives to sends in posting order, as NCCL does.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import deque

import pytest
import torch

import rrfp.comm.nccl_channel as nccl_channel
from rrfp.comm.channels import PeerError
from rrfp.comm.message import Message
from rrfp.comm.nccl_channel import NcclChannel
from rrfp.loop.completions import CompletionPoller


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque = deque()  # ("gate", work) or ("copy", fn), in issue order

    def flush(self) -> bool:
        """Run what may run; True when the queue is empty."""
        while self.queue:
            what, item = self.queue[0]
            if what == "gate" and not item.is_completed():
                return False
            if what == "copy":
                item()
            self.queue.popleft()
        return True


class FakeEvent:
    def __init__(self, stream: FakeStream, ident: int) -> None:
        self.stream, self.ident = stream, ident

    def query(self) -> bool:
        return self.stream.flush()


class FakeWork:
    def __init__(self, ident: int, done=lambda: True, error: BaseException | None = None) -> None:
        self.ident, self._done, self.error = ident, done, error

    def is_completed(self) -> bool:
        return self.error is not None or self._done()

    def exception(self):
        return self.error


class FakeOps:
    """The CudaOps surface. Every call is logged as (operation, current stream, detail)."""

    def __init__(self, log: list, wire: deque, fail_recv: int | None = None) -> None:
        self.log, self.wire, self.fail_recv = log, wire, fail_recv
        self.current = FakeStream("default")
        self.ids = 0
        self.recvs = 0

    def _id(self) -> int:
        self.ids += 1
        return self.ids

    def new_stream(self):
        return FakeStream(f"comm{self._id()}")

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def record_event(self, stream):
        ev = FakeEvent(stream, self._id())
        self.log.append(("record_event", stream.name, ev.ident))
        return ev

    def wait_event(self, stream, event) -> None:
        self.log.append(("wait_event", stream.name, event.ident))

    def wait_work(self, work) -> None:
        self.current.queue.append(("gate", work))
        self.log.append(("wait_work", self.current.name, work.ident))

    def record_stream(self, tensor, stream) -> None:
        self.log.append(("record_stream", stream.name, tuple(tensor.shape)))

    def pinned(self, host):
        return host.clone()

    def to_device(self, host):
        self.log.append(("h2d", self.current.name, None))
        return host.clone()

    def to_host(self, device_tensor, host) -> None:
        self.current.queue.append(("copy", lambda: host.copy_(device_tensor)))
        self.current.flush()  # a stream runs what it can at once, as a GPU does
        self.log.append(("d2h", self.current.name, None))

    def empty(self, shape, dtype):
        self.log.append(("empty", self.current.name, tuple(shape)))
        return torch.full(shape, 7, dtype=dtype)  # garbage until a receive fills it

    def isend(self, tensor, peer, group):
        self.wire.append(tensor.clone())
        work = FakeWork(self._id())
        self.log.append(("isend", self.current.name, tuple(tensor.shape)))
        return work

    def irecv(self, tensor, peer, group):
        ticket = self.recvs
        self.recvs += 1
        if ticket == self.fail_recv:
            work = FakeWork(self._id(), error=RuntimeError("NCCL communicator was aborted: remote process exited"))
        else:
            def arrived() -> bool:
                if len(self.wire) <= ticket:
                    return False
                sent = self.wire[ticket]
                assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, "buffer not from the header"
                tensor.copy_(sent)
                return True
            work = FakeWork(self._id(), done=arrived)
        self.log.append(("irecv", self.current.name, tuple(tensor.shape), work.ident))
        return work


def pair(fail_recv=None):
    log, wire = [], deque()
    compute = FakeStream("compute")
    poller = CompletionPoller(spin_rounds=4, backoff_s=1e-4, max_backoff_s=1e-3)
    tx = NcclChannel("fwd 0->1", 0, 1, None, outbound=True, ops=FakeOps(log, wire), poller=poller,
                     compute_stream=compute)
    # both ends share the wire; the receiver's tickets count from its own first irecv
    rx = NcclChannel("fwd 0->1", 1, 0, None, outbound=False, ops=FakeOps(log, wire, fail_recv), poller=poller,
                     compute_stream=compute)
    return tx, rx, log, poller


def message(mb: int, length: int) -> Message:
    return Message(0, mb, 0, [torch.randn(2, length, 8), torch.arange(length), torch.zeros(0, 3)])


@pytest.mark.asyncio
async def test_variable_messages_arrive_whole_and_in_order():
    tx, rx, log, poller = pair()
    sent = [message(0, 5), message(1, 11), message(2, 3)]
    for msg in sent:
        await tx.send(msg)
    for msg in sent:
        got = await rx.recv()
        assert (got.iteration, got.microbatch, got.kind) == (msg.iteration, msg.microbatch, msg.kind)
        for a, b in zip(got.tensors, msg.tensors):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    await poller.aclose()


@pytest.mark.asyncio
async def test_receive_posted_before_the_send():
    """The header lands in pinned memory only after its receive completes, by stream order."""
    tx, rx, log, poller = pair()
    pending = asyncio.ensure_future(rx.recv())
    await asyncio.sleep(0.01)
    assert not pending.done()
    msg = message(4, 7)
    await tx.send(msg)
    got = await asyncio.wait_for(pending, 5)
    assert got.microbatch == 4 and torch.equal(got.tensors[0], msg.tensors[0])
    await poller.aclose()


@pytest.mark.asyncio
async def test_send_waits_on_its_producer_event():
    tx, rx, log, poller = pair()
    await tx.send(message(0, 5))
    ops = [e for e in log if e[0] in ("record_event", "wait_event", "isend", "h2d")]
    produced = ops[0]
    assert produced[:2] == ("record_event", "compute"), ops
    wait = next(i for i, e in enumerate(ops) if e[0] == "wait_event")
    assert ops[wait][1] == tx.stream.name and ops[wait][2] == produced[2]
    sends = [i for i, e in enumerate(ops) if e[0] == "isend"]
    assert sends and min(sends) > wait, "every send is issued after the wait on the producer"
    assert all(ops[i][1] == tx.stream.name for i in sends), "sends go out on the channel's stream"
    assert len(sends) == 3, "header and the two non-empty tensors; the empty one is in the header alone"
    await poller.aclose()


@pytest.mark.asyncio
async def test_consumer_stream_waits_and_buffers_come_from_headers():
    tx, rx, log, poller = pair()
    await tx.send(message(0, 9))
    got = await rx.recv()
    recv_log = [e for e in log if e[0] in ("empty", "irecv", "wait_work", "record_stream")]
    empties = [e[2] for e in recv_log if e[0] == "empty"]
    assert empties == [(rx_header_len(),), (2, 9, 8), (9,), (0, 3)], "exactly the header's shapes, no padding"
    payload_recvs = [e[3] for e in recv_log if e[0] == "irecv"][1:]
    compute_waits = [e[2] for e in recv_log if e[0] == "wait_work" and e[1] == "compute"]
    assert compute_waits == payload_recvs, "the compute stream waits on every payload receive"
    recorded = [e[2] for e in recv_log if e[0] == "record_stream"]
    assert recorded == [tuple(t.shape) for t in got.tensors] and all(e[1] == "compute" for e in recv_log
                                                                      if e[0] == "record_stream")
    last_wait = max(i for i, e in enumerate(recv_log) if e[0] == "wait_work" and e[1] == "compute")
    assert all(i > last_wait for i, e in enumerate(recv_log) if e[0] == "record_stream")
    await poller.aclose()


def rx_header_len() -> int:
    from rrfp.comm.message import HEADER_LEN

    return HEADER_LEN


def test_no_host_sync_in_the_channel():
    """The channel reaches the device only through ops, none of which blocks the host."""
    source = inspect.getsource(nccl_channel)
    for blocking in ("synchronize", ".item(", ".cpu(", "torch.cuda"):
        assert blocking not in source, blocking
    ops_methods = {name for name in dir(FakeOps) if not name.startswith("_")} - {"stream"}
    assert not any("sync" in name for name in ops_methods)


@pytest.mark.asyncio
async def test_failed_receive_names_channel_and_peer():
    tx, rx, log, poller = pair(fail_recv=1)  # the first payload receive fails
    await tx.send(message(0, 4))
    with pytest.raises(PeerError) as info:
        await rx.recv()
    line = str(info.value)
    assert "rank 1: channel fwd 0->1" in line and "from rank 0" in line and "tensor 1/3" in line
    assert "remote process exited" in line
    with pytest.raises(PeerError, match="failed earlier"):
        await rx.recv()
    await poller.aclose()
