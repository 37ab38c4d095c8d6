"""A failure board on the rendezvous store: each failing rank posts how it
failed, so a rank that lost a peer can name the rank that failed first.

A neighbour only sees that its peer left; that peer may itself have left
because of its own peer. Before it prints, a failing rank posts ``primary``
(its own failure) or ``secondary P`` (it lost peer P) under its rank; a
secondary rank then looks for a primary post, or follows the ``secondary``
posts to the rank that posted nothing (killed or hung), from its own lost
peer and from those the other ranks' posts name (a world collective's
failure names no peer). When no post names one, the ``alive`` counters
tell a killed rank from one still blocked in the broken collective (gloo
fails it only once a neighbour in the ring has left): the killed one's
stops moving. Everything here is
best effort with a short deadline: the store lives in torchrun's agent, or in
rank 0, which may be the rank that died.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import rrfp.loop.exit_guard  # noqa: F401 - at exit, waits for a connect to leave torch
from rrfp.comm.job_store import attempt, connect_bound, store_client

PREFIX = "rrfp/failed"
# a counter per rank that its stop relay's thread adds 1 to every POLL_S (stop_relay.py)
ALIVE = "rrfp/alive"
GRACE_S, GRACE_POLLS = 1.0, 10  # how long a rank waits for a peer's post before calling it silent


class FailureBoard:
    def __init__(self, store, world: int) -> None:
        self.store, self.world = store, world
        self.prefix = f"{PREFIX}/{attempt()}"

    @classmethod
    def connect(cls, timeout_s: float = 1.0) -> FailureBoard | None:
        """A client of this run's store (MASTER_ADDR:MASTER_PORT); None if it cannot be reached.
        ``timeout_s`` is short because the store may be dead with the rank that hosted it, and a
        survivor's exit tells the next rank; a store this process hosts gets ``connect_bound``'s
        (none at all once it is gone)."""
        bound = connect_bound(timeout_s)
        if bound is None:
            return None
        with _quiet():
            store = connect_store(bound)
        try:
            return cls(store, int(os.environ["WORLD_SIZE"])) if store is not None else None
        except (KeyError, ValueError):
            return None

    def post(self, rank: int | str, note: str) -> None:
        """``primary`` or ``secondary P`` (P: the lost peer, or ``?``) under a rank's key."""
        try:
            with _quiet():
                self.store.set(f"{self.prefix}/{rank}", note)
        except RuntimeError:
            pass

    def post_refusal(self, text: str, wait_s: float) -> bool:
        """Rank 0: the bad-input error it printed for the job (job_lines.py), trying for up to
        ``wait_s``: the other ranks print it again unless they read it, and the agent's store, which
        outlives the ranks, can miss a client's bound on a loaded machine. Whether it was posted."""
        key = f"{self.prefix}/refused"
        return self._retried(lambda: self.store.set(key, text) or True, wait_s) is not None

    def refusal(self, wait_s: float) -> str | None:
        """Rank 0's posted refusal, waiting up to ``wait_s`` for it; None if none came. A store
        operation that failed (timed out under load) is tried again until then."""
        key = f"{self.prefix}/refused"
        got = self._retried(lambda: self.store.check([key]) and self.store.get(key), wait_s)
        return None if got is None else got.decode(errors="replace")

    def _retried(self, op, wait_s: float):
        """``op``'s first true result, asked every 20 ms for up to ``wait_s``, a failed store
        operation counting as none; None if none came."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with _quiet():
                    if result := op():
                        return result
            except RuntimeError:
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def ticks(self, ranks) -> dict[int, int]:
        """Each rank's alive counter (0: none, or the store is gone)."""
        try:
            with _quiet():
                return {r: self.store.add(alive_key(r), 0) for r in ranks}
        except RuntimeError:
            return dict.fromkeys(ranks, 0)

    def read(self, rank: int) -> str | None:
        try:
            key = f"{self.prefix}/{rank}"
            with _quiet():
                return self.store.get(key).decode() if self.store.check([key]) else None
        except RuntimeError:
            return None

    def origin(self, rank: int, peer: int | None) -> tuple[int, bool] | None:
        """(the rank that failed first, whether it wrote a line), as far as the posts tell; None if
        they tell nothing. A primary post anywhere wins. Else follow the lost peers from ``peer``,
        and from every peer another rank's post names, to a rank that posted nothing (killed or
        hung), giving it GRACE_S to post; with no ``peer`` (a world collective), a lone silent
        rank is the one at once; else, after GRACE_S, the one silent rank whose alive counter
        stood still while the others' moved."""
        notes = {r: self.read(r) for r in range(self.world) if r != rank}
        deadline = time.monotonic() + GRACE_S
        ticks = self.ticks(notes)
        while True:
            primary = sorted(r for r, n in notes.items() if n == "primary")
            if primary:
                return primary[0], True
            silent = [r for r, n in notes.items() if n is None]
            if peer is None and len(silent) == 1:
                return silent[0], False
            ends = self._silent_ends(rank, peer, notes)
            if not silent or time.monotonic() >= deadline:
                if ends:
                    return ends[0], False
                now = self.ticks(silent)
                still = [r for r in silent if now[r] == ticks[r]]
                return (still[0], False) if len(still) == 1 and len(silent) > 1 else None
            time.sleep(
                GRACE_S / GRACE_POLLS
            )  # a silent rank may have failed a moment after us, and be posting
            notes.update({r: self.read(r) for r in silent})

    @staticmethod
    def _silent_ends(rank: int, peer: int | None, notes: dict[int, str | None]) -> list[int]:
        """The silent ranks that the chains of lost peers lead to: from ``peer`` first, then from
        each peer a post names (``secondary P``), most named first."""
        named = [int(n.split()[1]) for n in notes.values() if n and n.split()[-1].isdigit()]
        starts = ([peer] if peer is not None else []) + sorted(
            set(named), key=lambda p: (-named.count(p), p)
        )
        ends: list[int] = []
        for start in starts:
            seen, at = {rank}, start
            while at is not None and at not in seen and at in notes:
                seen.add(at)
                note = notes[at]
                if note is None:
                    if at not in ends:
                        ends.append(at)
                    break
                nxt = note.removeprefix("secondary ")
                at = int(nxt) if nxt.isdigit() else None
        return ends


def alive_key(rank: int) -> str:
    return f"{ALIVE}/{attempt()}/{rank}"


def post_before_teardown(rank: int, note: str) -> None:
    """Post this rank's own failure (``Failure.note``, not a lost peer's) while its process groups
    still stand: a peer learns of the failure when those groups close, and reads the board then,
    giving a post only ``GRACE_S``; posted after the teardown, on a loaded machine, it can come too
    late and the peer names this rank silent. A rank that lost a peer posts after its teardown,
    as before: its store may be the one that died, and waiting for it here would hold up the
    closing that tells the next rank. Best effort, as every post: no store, no post."""
    board = FailureBoard.connect()
    if board is not None:
        board.post(rank, note)


def connect_store(timeout_s: float = 1.0):
    """A new client of this run's rendezvous store (MASTER_ADDR:MASTER_PORT: torchrun's agent's, or
    rank 0's); None if it cannot be reached within about ``timeout_s``. In a thread: TCPStore's
    constructor pings the server and reads the reply with no timeout, so a stopped store (in a
    SIGSTOPped rank 0) would hang it. torch logs each failed attempt on stderr (see _quiet)."""
    found: list = []

    def connect() -> None:
        try:
            found.append(store_client(timeout_s))
        except (KeyError, ValueError, RuntimeError):
            pass

    thread = threading.Thread(target=connect, name="rrfp-store-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    return found[0] if found else None


@contextlib.contextmanager
def _quiet():
    """torch's C++ store client logs every failed attempt to stderr, with a C++ stack: a gone
    store is expected here, so its log goes to /dev/null while the board talks to it."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
