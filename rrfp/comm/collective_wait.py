"""A wait at a collective, bounded while the peers beat.

With a heartbeat, gloo's collectives may wait a day (the runtime's backstop): a peer that beats is
alive, however long its step takes. A peer that beats but never arrives (stuck in a user's code,
or at another collective) would then hold its peers for that day. So while this rank waits at a
collective its heartbeat says ``at WHAT`` (``waiting_at``, entered by ``named_collective``), and
the runtime's watcher asks ``overdue`` every beat: once this rank has waited ``progress_s`` with
no progress of the job since (``Heartbeat.progress_at``: a peer read in a task, writing or reading
a checkpoint, or at something new), the ranks of the collective's group that are not at it are
the ones that never reached it.

Which waits it covers: the collectives awaited on the runtime's loop while the ``async with`` block
or ``PipelineRuntime.watch`` runs them (``BOUND``, a context variable those set), when this rank is
between things (no activity of its own): a collective that a task starts, such as a TP agreement,
is part of the task's work. A rank's own long write (``working``) says ``writing ...``: progress
to the peers that wait for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from rrfp.comm.heartbeat import Heartbeat
from rrfp.core.errors import PeerStuck

AT = "at "  # how a rank's activity says that it waits at a collective


@dataclass
class Wait:
    """This rank at the collective ``what`` since ``since`` (monotonic), with the ``peers`` of its
    group. ``since`` moves on when the wait counts afresh; the wait stays the one ``at`` began."""

    what: str
    peers: tuple[int, ...]
    since: float


@dataclass(frozen=True)
class Unreached:
    """A wait at ``what`` that no progress of the job has excused for ``seconds``: the ``absent``
    peers never reached it (none: every peer is at it, and it still does not complete)."""

    what: str
    absent: tuple[int, ...]
    seconds: float


class CollectiveWaits:
    """This rank's wait at a collective, told to its peers through ``hb``, and the verdict on it."""

    def __init__(self, hb: Heartbeat) -> None:
        self.hb = hb
        self.current: Wait | None = None
        self._asked = time.monotonic()  # the last ``overdue``: a long gap means this rank slept
        self._lock = threading.Lock()  # ``working`` runs in a collective's thread

    @contextlib.contextmanager
    def at(self, what: str, peers: tuple[int, ...]) -> Iterator[None]:
        """This rank waits at ``what`` for ``peers`` meanwhile; nothing when it is already doing
        something (a task's collective is the task's)."""
        with self._lock:
            if self.hb.activity or self.current is not None:
                mine = None
            else:
                mine = Wait(what, peers, time.monotonic())
                self.current = mine
                self.hb.doing(AT + what)
        try:
            yield
        finally:
            if mine is not None:
                with self._lock:
                    if self.current is mine:
                        self.current = None
                    if self.hb.activity == AT + what:
                        self.hb.doing("")

    @contextlib.contextmanager
    def working(self, what: str) -> Iterator[None]:
        """This rank works at ``what`` (``writing checkpoint ...``) meanwhile, inside a collective
        or not: its peers count it as progress. Any thread may enter it."""
        with self._lock:
            before = self.hb.activity
            self.hb.doing(what)
        try:
            yield
        finally:
            with self._lock:
                if self.hb.activity == what:
                    self.hb.doing(before)

    def overdue(self, bound_s: float, now: float | None = None) -> Unreached | None:
        """The wait at a collective that has lasted ``bound_s`` with no progress of the job since
        it began; None if none. Asked every beat: after a longer gap (this rank was itself stopped
        or starved) the wait counts afresh, as a silent peer does in ``Heartbeat.check``."""
        now = time.monotonic() if now is None else now
        slept = now - self._asked > self.hb.timeout_s / 2
        self._asked = now
        wait = self.current
        if wait is None:
            return None
        if slept:
            wait.since = now  # the same wait, counted afresh: ``at`` still ends it
        stalled = now - max(wait.since, self.hb.progress_at)
        if stalled < bound_s:
            return None
        return Unreached(wait.what, absent_from(self.hb, wait.what, wait.peers), stalled)


def absent_from(hb: Heartbeat, what: str, peers: tuple[int, ...]) -> tuple[int, ...]:
    """The ``peers`` whose heartbeat does not say they wait at the collective ``what``."""
    return tuple(p for p in peers if hb.beats[p].activity != AT + what)


def stuck(rank: int, hb: Heartbeat, late: Unreached, bound: str, why: str = "") -> PeerStuck:
    """The one line for the collective ``late.what`` that ``late.absent`` never reached, with what
    their heartbeats say and ``bound``, the key that set the wait's limit; ``why``: what else the
    wait's end took (`` with no progress of the job``)."""
    if not late.absent:
        return PeerStuck(
            f"rank {rank}: {late.what}: every rank of it is at it, yet it has not completed in "
            f"{late.seconds:.1f} s{why} ({bound})"
        )
    who = " and ".join(f"rank {p} ({hb.describe(p)})" for p in late.absent)
    return PeerStuck(
        f"rank {rank}: {late.what}: {who} never reached it: waited {late.seconds:.1f} s{why} "
        f"({bound}): stuck outside it, or at another collective",
        late.absent[0],
    )


# the waits of the runtime whose block (or ``watch``) runs this task; None: unbounded here
BOUND: contextvars.ContextVar[CollectiveWaits | None] = contextvars.ContextVar(
    "rrfp_collective_waits", default=None
)


def group_destroyed(group) -> bool:
    """Whether ``group`` (the world when None) was taken down (``destroy_process_group``), so that
    no collective can run over it any more."""
    if not dist.is_initialized():
        return True
    try:
        dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (KeyError, RuntimeError, ValueError):
        return True
    return False


def peers_of(group) -> tuple[int, ...]:
    """The other members of ``group`` (the world when None), as global ranks."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return tuple(r for r in ranks if r != dist.get_rank())


@contextlib.contextmanager
def waiting_at(what: str, group=None) -> Iterator[None]:
    """This rank waits at the collective ``what`` over ``group`` meanwhile (when bounded here)."""
    waits = BOUND.get()
    if waits is None:
        yield
        return
    with waits.at(what, peers_of(group)):
        yield


def working_marker() -> Callable[[str], contextlib.AbstractContextManager]:
    """``working`` of the waits bounded here, for a thread to enter (a thread does not see the
    loop's context variables); a no-op marker when none are."""
    waits = BOUND.get()
    return waits.working if waits is not None else (lambda what: contextlib.nullcontext())
