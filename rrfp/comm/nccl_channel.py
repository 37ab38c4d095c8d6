"""An NCCL channel: one direction between two neighbouring ranks, on its own
communicator, with isend/irecv whose Work the loop's poller watches.

Where the header travels, and why: over the same NCCL communicator, first,
into a device buffer that is copied (non-blocking, on the channel's stream)
into pinned host memory; an event recorded after that copy tells the poller
when the host can read it. So the header needs no second transport (a gloo
group would need waiter threads) and reading it never blocks the host. The
receiver then allocates exactly the payload buffers the header describes,
with no padding, and posts their receives in order: NCCL matches messages
between two ranks in posting order (docs/design.md, fact 3), which is why
each direction has its own communicator.

Ordering without host syncs:
- send: the event the producing task ends with (``Message.ready``, recorded by
  the lane when that task was enqueued, not when the send runs: by then later
  tasks are on the compute stream too); the channel's stream waits on it
  before the sends are issued;
- receive: once the payload's Works complete, the compute stream waits on
  them and every buffer is ``record_stream``-ed to it, so the caching
  allocator cannot hand the memory out while compute still reads it.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from rrfp.comm.channels import ChannelEnd, PeerError
from rrfp.comm.message import HEADER_LEN, Message, MessageError, decode_header, encode_header
from rrfp.loop.completions import CompletionPoller

logger = logging.getLogger("rrfp.comm")


class NcclChannel(ChannelEnd):
    """Same surface as the gloo ``Channel``: ``send``, ``recv``, ``aclose``, ``name``, ``peer``."""

    def __init__(
        self,
        name: str,
        rank: int,
        peer: int,
        group,
        *,
        outbound: bool,
        ops,
        poller: CompletionPoller,
        compute_stream,
        deadline_s: float | None = None,
    ) -> None:
        self.name, self.rank, self.peer, self.group, self.outbound = (
            name,
            rank,
            peer,
            group,
            outbound,
        )
        self.ops, self.poller, self.compute_stream = ops, poller, compute_stream
        # how long a send, or a payload after its header, may take: rrfp's peer deadline, shorter
        # than NCCL's watchdog timeout, so a dead or hung peer ends this rank with one line
        self.deadline_s = deadline_s
        self.stream = (
            ops.new_stream()
        )  # the channel's own stream: copies and NCCL calls are issued here
        self.messages = 0
        self._header_host = ops.pinned(torch.zeros(HEADER_LEN, dtype=torch.int64))
        self._last: str | None = None
        self._failure: BaseException | None = None
        self._closed = False

    async def send(self, msg: Message) -> None:
        """Send header and payload after the kernels that made them; return when NCCL is done."""
        self._check_usable("send", outbound=True)
        try:
            header = self.ops.pinned(encode_header(msg))
        except MessageError as e:
            raise MessageError(f"{self.where}: cannot send: {e}") from None
        ops = self.ops
        produced = msg.ready if msg.ready is not None else ops.record_event(self.compute_stream)
        with ops.stream(self.stream):
            header_dev = ops.to_device(header)
            ops.wait_event(
                self.stream, produced
            )  # everything below runs after the producing kernels
            works = [
                (
                    ops.isend(header_dev, self.peer, self.group),
                    f"send of the header of {msg.label()}",
                )
            ]
            for i, t in enumerate(msg.tensors):
                if t is not None and t.numel():  # None and empty payloads are in the header alone
                    works.append(
                        (
                            ops.isend(t.detach().contiguous(), self.peer, self.group),
                            f"send of tensor {i + 1}/{len(msg.tensors)} of {msg.label()}",
                        )
                    )
        for work, what in works:  # awaiting keeps every tensor alive until NCCL has read it
            await self._completed(work, f"{what} to rank {self.peer}")
        self.messages += 1
        self._last = msg.label()

    async def recv(self) -> Message:
        """The next message, its tensors safe to use on the compute stream."""
        self._check_usable("receive", outbound=False)
        ops = self.ops
        after = f"after {self._last}" if self._last else "first message"
        with ops.stream(self.stream):
            header_dev = ops.empty((HEADER_LEN,), torch.int64)
            work = ops.irecv(header_dev, self.peer, self.group)
            ops.wait_work(work)
            ops.to_host(header_dev, self._header_host)
            header_copied = ops.record_event(self.stream)
        # no deadline here: the peer may compute for long; the executor's wait for an arrival has
        # one
        await self._completed(
            work, f"receive of header ({after}) from rank {self.peer}", deadline=False
        )
        await self.poller.watch(header_copied)
        try:
            header = decode_header(self._header_host)
        except MessageError as e:
            raise self._fail(
                MessageError(f"{self.where}: bad header from rank {self.peer} ({after}): {e}")
            ) from e
        with ops.stream(self.stream):
            tensors = [None if s.is_none else ops.empty(s.shape, s.dtype) for s in header.specs]
            works = [
                (ops.irecv(t, self.peer, self.group), i)
                for i, t in enumerate(tensors)
                if t is not None and t.numel()
            ]
        for work, i in works:
            await self._completed(
                work,
                f"receive of tensor {i + 1}/{len(tensors)} of {header.label()} "
                f"from rank {self.peer}",
            )
        with ops.stream(self.compute_stream):
            for work, _ in works:
                ops.wait_work(work)
        for t in tensors:
            if t is not None:
                ops.record_stream(t, self.compute_stream)
        self.messages += 1
        self._last = header.label()
        return Message(
            header.iteration, header.microbatch, header.kind, tensors, header.requires_grad
        )

    async def aclose(self) -> None:
        """Refuse further use. Work already issued finishes or fails with its communicator."""
        self._closed = True

    def warm_up(self) -> None:
        """Start-up only, blocking: one element over this channel, so that NCCL connects the pair
        now. NCCL sets up a pair's P2P connection at their first send or receive, and that call
        blocks its thread until the peer makes the matching one (nccl_groups.py); after start-up
        that thread would be the event loop. Every rank calls this for its channels in one
        global order, so the calls meet."""
        ops = self.ops
        with ops.stream(self.stream):
            one = ops.empty((1,), torch.int64)
            work = (
                ops.isend(one, self.peer, self.group)
                if self.outbound
                else ops.irecv(one, self.peer, self.group)
            )
            ops.wait_work(work)
        ops.synchronize(self.stream)

    async def _completed(self, work, what: str, deadline: bool = True) -> None:
        limit = self.deadline_s if deadline else None
        try:
            async with asyncio.timeout(limit):
                await self.poller.watch(work)
        except TimeoutError:
            raise self._fail(
                PeerError(
                    f"{self.where}: {what} failed (nothing within {limit:g} s: the peer is "
                    f"hung, too slow, or not receiving)",
                    self.peer,
                )
            ) from None
        except Exception as e:
            raise self._fail(self._peer_error(what, e)) from e

    def _fail(self, error: BaseException) -> BaseException:
        if self._failure is None:
            self._failure = error
        return error
