"""Pipeline channels: one FIFO, one direction, one process group each.

Every (neighbour pair, direction) gets its own process group, created eagerly
at start-up in the same order on every rank (docs/design.md, fact 3): a shared group
would let a posted receive block a later send on NCCL, and lazy creation
deadlocks. A channel carries self-describing messages (``message.py``).

On gloo a point-to-point ``Work`` completes only inside a blocking ``wait()``
(fact 1), so each channel owns a :class:`BlockingWaiter` thread that runs its
blocking sends or receives one after the other (a message in one operation
where it fits the largest payload so far, ``packed.py``; else its header,
then each tensor); one thread per channel keeps messages in order and lets
the four channels of a stage progress independently. Nothing polls with
short timed waits, which would break the group (fact 8): the process-group
timeout is the dead-peer detector.

What surfaces where (gloo on CPU): a peer process that
dies fails a posted receive or a send at once ("Connection closed/reset by
peer"); a peer that lives but does not answer fails it after the process-group
timeout. A send, even of a small header, waits until the peer posts the
matching receive, so the timeout bounds how long either side may legitimately
wait for the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from rrfp.comm.collective_wait import waiting_at
from rrfp.comm.message import Message, MessageError, decode_header, encode_header
from rrfp.comm.packed import HEADER_BYTES, header_payload_bytes, pack, payload_bytes, unpack
from rrfp.core.errors import PeerFailure, PipelineError
from rrfp.loop.completions import BlockingWaiter

logger = logging.getLogger("rrfp.comm")


class PeerError(PeerFailure):
    """A send or receive failed in the transport: the peer died, hung past the
    process-group timeout, or the group broke. Names rank, channel and peer."""


_DIED = (
    "Connection closed by peer",
    "Connection reset",
    "Broken pipe",  # gloo
    "remote process exited",
    "ncclRemoteError",
)  # NCCL, as its watchdog reports it on the Work
_HUNG = ("Timed out", "Watchdog caught collective operation timeout")  # gloo, NCCL


def timed_out(text: str) -> bool:
    """Whether a transport error's text says the operation waited out its timeout (a peer hung,
    too slow, or never came), not that a peer died."""
    return not any(s in text for s in _DIED) and any(s in text for s in _HUNG)


def lost_peer_reason(text: str) -> str:
    """' (the likely reason)' when a transport error's text says a peer died or hung; else ''."""
    if any(s in text for s in _DIED):
        return " (the peer process probably died)"
    if timed_out(text):
        return (
            " (nothing within the process-group timeout: the peer is hung, too slow, or not "
            "sending)"
        )
    return ""


_GLOO_SOURCE = re.compile(r"^\[[^\]]*:\d+\] ")  # "[/__w/pytorch/.../pair.cc:553] "


def describe_failure(cause: BaseException) -> str:
    """' (the likely reason): Type: text' for a transport error, one line, without
    gloo's source location and its generic advice ("This is typically caused by ...")."""
    text = _GLOO_SOURCE.sub("", " ".join(str(cause).split())).split(" This is typically caused by")[
        0
    ]
    return f"{lost_peer_reason(str(cause))}: {type(cause).__name__}: {text}"


def lone_peer(group=None) -> int | None:
    """The other member of a two-member ``group`` (the world when None): the one peer a failed
    collective over it can have lost. None in a larger group, or with no process group."""
    try:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        others = [r for r in ranks if r != dist.get_rank()]
    except (RuntimeError, ValueError):
        return None
    return others[0] if len(others) == 1 else None


@contextlib.contextmanager
def named_collective(what: str, group=None):
    """gloo's collective errors name no rank or group: re-raise one as a one-line
    PeerFailure saying which collective (``what``, over ``group``) failed on this rank, and
    why; its ``peer`` is the other member when the group has two (``lone_peer``). Meanwhile this
    rank waits at ``what`` (``waiting_at``: bounded while the peers beat)."""
    try:
        with waiting_at(what, group):
            yield
    except PipelineError:
        raise
    except RuntimeError as e:
        raise PeerFailure(
            f"rank {dist.get_rank()}: {what} failed{describe_failure(e)}", lone_peer(group)
        ) from e


@dataclass(frozen=True)
class Prepared:
    """A message made ready to post (``Channel.prepare``, or ``post`` itself): its header, its
    payload as sent and that payload's bytes in one buffer, and that buffer where it was packed
    ahead (it fitted the channel's capacity then)."""

    header: torch.Tensor
    payload: list[torch.Tensor | None]
    size: int
    packed: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        """The one buffer the message travels in: the one packed ahead, else packed now."""
        return self.packed if self.packed is not None else pack(self.header, self.payload)


class ChannelEnd:
    """What the gloo and the NCCL channel share: their name in errors, refusing use
    once closed, failed or in the wrong direction, and a peer's failure as one line.
    Subclasses set ``name``, ``rank``, ``peer``, ``outbound``, ``_failure``, ``_closed``."""

    name: str
    rank: int
    peer: int
    outbound: bool
    _failure: BaseException | None
    _closed: bool

    def __repr__(self) -> str:
        role = "send" if self.outbound else "receive"
        return f"<{type(self).__name__} {self.name} ({role} on rank {self.rank})>"

    @property
    def where(self) -> str:
        return f"rank {self.rank}: channel {self.name}"

    def _check_usable(self, action: str, *, outbound: bool) -> None:
        """Why this channel cannot ``action``, in one line: closed, wrong direction, or failed."""
        where = self.where
        if self._closed:
            raise RuntimeError(f"{where}: cannot {action}: the channel is closed")
        if outbound != self.outbound:
            role = "sends" if self.outbound else "receives"
            raise RuntimeError(f"{where}: cannot {action}: this rank only {role} on this channel")
        if self._failure is not None:
            first = str(self._failure).removeprefix(f"{where}: ")
            raise PeerError(
                f"{where}: cannot {action}: the channel failed earlier: {first}",
                getattr(self._failure, "peer", self.peer),
            ) from self._failure

    def _peer_error(self, what: str, cause: BaseException) -> PeerError:
        return PeerError(f"{self.where}: {what} failed{describe_failure(cause)}", self.peer)


class Channel(ChannelEnd):
    """One direction between two neighbouring ranks; FIFO, one consumer.

    ``send`` and ``recv`` are cancel-safe: a cancelled ``send`` still goes out,
    in order; a cancelled ``recv`` leaves its receive running and the next
    ``recv`` returns that message, so a timeout around ``recv`` loses nothing.
    After a transport failure the channel refuses further use, because a gloo
    failure breaks the whole group.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        peer: int,
        group: dist.ProcessGroup,
        *,
        outbound: bool,
        device: torch.device | str = "cpu",
        wait: datetime.timedelta | None = None,
    ) -> None:
        self.name = name
        # how long one send or receive may wait for the peer; None: the group's timeout. gloo gives
        # a point-to-point op the timeout its group was created with unless its wait() is given one
        self.wait = wait
        self.rank = rank
        self.peer = peer
        self.group = group
        self.outbound = outbound
        self.device = torch.device(device)
        self.messages = 0  # messages sent or received so far
        self.whole = 0  # of which in one operation, header and payload (rrfp/comm/packed.py)
        self._waiter = BlockingWaiter(name)
        self._receive_job: asyncio.Future[Message] | None = None
        self._receiving = False
        self._last: str | None = None
        self._failure: BaseException | None = None
        self._closed = False
        # the largest payload so far, in packed bytes: a message up to it travels in one operation
        # (rrfp/comm/packed.py); a sending channel's is the loop thread's, a receiving channel's
        # the waiter thread's
        self._capacity = 0
        self._last_send: asyncio.Future | None = None  # the send posted last (``post``)

    # -- loop side -------------------------------------------------------------

    async def send(self, msg: Message) -> None:
        """Send ``msg`` (header and payload in one operation where the peer's buffer holds it, else
        the header, then each payload tensor; a None payload is in the header alone).

        Returns once the peer has taken it: gloo point-to-point is a rendezvous,
        so each part completes only after the peer posted the matching receive.
        """
        await asyncio.shield(self.post(msg, begin_here=False))

    def prepare(self, msg: Message) -> Prepared | None:
        """``msg``'s header and payload, packed into one buffer where it will travel whole, made
        on the calling thread: the compute lane's, as its task returns the payload, while the
        payload is still in its cache and before the loop's turn. The capacity only grows, so a
        message packed for the capacity now still travels whole when ``post`` sends it after
        others; one that did not fit is packed by ``post`` if it fits by then. None where ``msg``
        cannot be sent (``post`` raises why)."""
        try:
            made = self._encode(msg)
        except Exception:  # noqa: BLE001 - post raises it, where a send's error belongs
            return None
        return replace(made, packed=made.buffer()) if 0 < made.size <= self._capacity else made

    def _encode(self, msg: Message) -> Prepared:
        """``msg``'s header and its payload as sent (detached, contiguous), not packed; raises
        what cannot be sent."""
        try:
            header = encode_header(msg, self.device)
        except MessageError as e:
            raise MessageError(f"{self.where}: cannot send: {e}") from None
        payload: list[torch.Tensor | None] = []
        for i, t in enumerate(msg.tensors):
            if t is None:
                payload.append(None)
                continue
            if t.device.type != self.device.type:
                raise ValueError(
                    f"{self.where}: payload {i} of {msg.label()} is on {t.device}, "
                    f"but the channel sends from {self.device}"
                )
            payload.append(t.detach().contiguous())
        return Prepared(header, payload, payload_bytes(payload))

    def post(
        self, msg: Message, begin_here: bool = True, prepared: Prepared | None = None
    ) -> asyncio.Future:
        """Start sending ``msg`` now, ``send`` without the await: the future is done once the peer
        has taken it; cancelling it does not stop a send that began. ``prepared``: what
        ``prepare(msg)`` made of it off the loop.

        With ``begin_here``, a message that travels whole (``packed.py``) and has nothing of this
        channel's ahead of it begins its one operation here, on the loop's thread: gloo moves it on
        a thread of its own that needs no GIL, so it is on its way before the loop hands the lane
        its next task, and the channel's thread only waits for its end. Else its operations are
        queued for the channel's thread, which has to win the GIL and a core from that task."""
        self._check_usable("send", outbound=True)
        made = prepared or self._encode(msg)
        label = msg.label()
        whole = 0 < made.size <= self._capacity  # the peer's buffer holds it: one operation
        self._capacity = max(
            self._capacity, made.size
        )  # what the receiver computes from the header
        ahead = self._last_send is not None and not self._last_send.done()
        if begin_here and whole and not ahead:
            # nothing of this channel's is ahead of it: the operation starts here, on gloo's own
            # thread, which needs no GIL, and the channel's thread only waits for it to end
            work = self._start_whole(made, msg.times)
            job = self._waiter.submit(self._send_started, work, label, msg.times)
        else:
            job = self._waiter.submit(self._send_blocking, made, whole, label, msg.times)
        self._last_send = job
        job.add_done_callback(self._note_failure)
        job.add_done_callback(lambda done: self._note_sent(done, label))
        return job

    def _note_sent(self, job: asyncio.Future, label: str) -> None:
        if not job.cancelled() and job.exception() is None:
            self.messages += 1
            self._last = label

    async def recv(self) -> Message:
        """The next message from the peer, in sending order."""
        self._check_usable("receive", outbound=False)
        if self._receiving:
            raise RuntimeError(
                f"{self.where}: recv() called while another recv() is waiting; "
                f"a channel has one consumer"
            )
        if self._receive_job is None:
            self._receive_job = asyncio.ensure_future(
                self._waiter.call(self._receive_blocking, self._last)
            )
            self._receive_job.add_done_callback(self._note_failure)
        job = self._receive_job
        self._receiving = True
        try:
            msg = await asyncio.shield(job)
        finally:
            self._receiving = False
        self._receive_job = None
        self.messages += 1
        self._last = msg.label()
        return msg

    async def aclose(self) -> None:
        """Stop the waiter thread. A call stuck in gloo stays stuck until the group
        times out or is destroyed; its late result is dropped."""
        if self._closed:
            return
        self._closed = True
        job, self._receive_job = self._receive_job, None
        if job is not None and not job.done():
            job.cancel()
            await asyncio.wait([job])
        self._waiter.close()
        logger.debug("%s closed after %d message(s)", self.where, self.messages)

    def _note_failure(self, job: asyncio.Future) -> None:
        # Also marks the exception as retrieved when nobody awaits the job any more.
        if job.cancelled():
            return
        error = job.exception()
        if error is not None and self._failure is None:
            self._failure = error
            logger.debug("%s", error)

    # -- waiter thread side ------------------------------------------------------

    def _start_whole(self, made: Prepared, times: dict[str, float] | None):
        """Begin the one operation of a whole message (on the loop's thread): its Work, or the
        error that kept it from starting, for the channel's thread to wait for or raise."""
        if times is not None:
            times["sent"] = time.time()
        try:
            return dist.isend(made.buffer(), self.peer, group=self.group)
        except Exception as e:  # noqa: BLE001 - raised by the channel's thread, as a send's is
            return e

    def _send_started(self, work, label: str, times: dict[str, float] | None) -> None:
        """Wait for a whole message's operation begun by ``_start_whole``."""
        what = f"send of {label} (its header and payload in one) to rank {self.peer}"
        try:
            if isinstance(work, Exception):
                raise work
            work.wait() if self.wait is None else work.wait(self.wait)
        except Exception as e:
            raise self._peer_error(what, e) from e
        self.whole += 1
        if times is not None:
            times["taken"] = time.time()

    def _send_blocking(
        self, made: Prepared, whole: bool, label: str, times: dict[str, float] | None = None
    ) -> None:
        """The message's transport operations, one (``whole``) or its parts; ``times`` (the
        message's stamps, when it has them) gets when they began (``sent``) and when the peer had
        taken them all (``taken``)."""
        if times is not None:
            times["sent"] = time.time()
        if whole:
            try:
                self._p2p(dist.send, dist.isend, made.buffer())
            except Exception as e:
                raise self._peer_error(
                    f"send of {label} (its header and payload in one) to rank {self.peer}", e
                ) from e
            self.whole += 1
        else:
            self._send_parts(made.header, made.payload, label)
        if times is not None:
            times["taken"] = time.time()

    def _send_parts(
        self, header: torch.Tensor, payload: list[torch.Tensor | None], label: str
    ) -> None:
        what = f"send of the header of {label} to rank {self.peer}"
        try:
            self._p2p(dist.send, dist.isend, header)
            for i, t in enumerate(payload):
                if t is None or t.numel() == 0:  # the header says it all; gloo cannot move 0 bytes
                    continue
                what = (
                    f"send of tensor {i + 1}/{len(payload)} ({_spec(t)}) of {label} "
                    f"to rank {self.peer}"
                )
                self._p2p(dist.send, dist.isend, t)
        except Exception as e:
            raise self._peer_error(what, e) from e

    def _receive_blocking(self, last: str | None) -> Message:
        after = f"after {last}" if last else "first message"
        # room for the largest payload so far: a message up to that size comes whole, header and
        # payload; a header arriving short leaves the rest zero (its checksum then fails)
        capacity = self._capacity
        buf = torch.empty(HEADER_BYTES + capacity, dtype=torch.uint8, device=self.device)
        buf[:HEADER_BYTES].zero_()
        try:
            self._p2p(dist.recv, dist.irecv, buf)
        except Exception as e:
            raise self._peer_error(f"receive of header ({after}) from rank {self.peer}", e) from e
        try:
            header = decode_header(buf[:HEADER_BYTES].view(torch.int64))
        except MessageError as e:
            raise MessageError(
                f"{self.where}: bad header from rank {self.peer} ({after}): {e}"
            ) from e
        size = header_payload_bytes(header)
        self._capacity = max(capacity, size)
        if 0 < size <= capacity:  # the payload came with it
            self.whole += 1
            return Message(
                header.iteration,
                header.microbatch,
                header.kind,
                unpack(buf, header),
                header.requires_grad,
                times={"received": time.time()},
            )
        tensors = header.empty_tensors(self.device)
        for i, t in enumerate(tensors):
            if t is None or t.numel() == 0:  # None and empty payloads are in the header alone
                continue
            try:
                self._p2p(dist.recv, dist.irecv, t)
            except Exception as e:
                raise self._peer_error(
                    f"receive of tensor {i + 1}/{len(tensors)} ({_spec(t)}) of "
                    f"{header.label()} from rank {self.peer}",
                    e,
                ) from e
        return Message(
            header.iteration,
            header.microbatch,
            header.kind,
            tensors,
            header.requires_grad,
            times={"received": time.time()},
        )

    def _p2p(self, blocking, posted, t: torch.Tensor) -> None:
        """One send or receive of ``t``, waiting ``self.wait`` if set (else the group's timeout)."""
        if self.wait is None:
            blocking(t, self.peer, group=self.group)
        else:
            posted(t, self.peer, group=self.group).wait(self.wait)


def _spec(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
