"""A failure board on the rendezvous store: each failing rank posts how it
failed, so a rank that lost a peer can name the rank that failed first.

A neighbour only sees that its peer left; that peer may itself have left
because of its own peer. Before it prints, a failing rank posts ``primary``
(its own failure) or ``secondary P`` (it lost peer P) under its rank; a
secondary rank then looks for a primary post, or follows the ``secondary``
posts to the rank that posted nothing (killed or hung). Everything here is
best effort with a short deadline: the store lives in torchrun's agent, or in
rank 0, which may be the rank that died.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

from rrfp.comm.job_store import attempt

PREFIX = "rrfp/failed"
GRACE_S, GRACE_POLLS = 1.0, 10  # how long a rank waits for a peer's post before calling it silent


class FailureBoard:
    def __init__(self, store, world: int) -> None:
        self.store, self.world = store, world
        self.prefix = f"{PREFIX}/{attempt()}"

    @classmethod
    def connect(cls, timeout_s: float = 1.0) -> "FailureBoard | None":
        """A client of this run's store (MASTER_ADDR:MASTER_PORT); None if it cannot be reached."""
        with _quiet():
            store = connect_store(timeout_s)
        try:
            return cls(store, int(os.environ["WORLD_SIZE"])) if store is not None else None
        except (KeyError, ValueError):
            return None

    def post(self, rank: "int | str", note: str) -> None:
        """``primary`` or ``secondary P`` (P: the lost peer, or ``?``) under a rank's key."""
        try:
            with _quiet():
                self.store.set(f"{self.prefix}/{rank}", note)
        except RuntimeError:
            pass

    def post_refusal(self, text: str) -> None:
        """Rank 0: the bad-input error it printed for the job (job_lines.py)."""
        self.post("refused", text)

    def refusal(self, wait_s: float) -> str | None:
        """Rank 0's posted refusal, waiting up to ``wait_s`` for it; None if none came."""
        deadline = time.monotonic() + wait_s
        key = f"{self.prefix}/refused"
        while True:
            try:
                with _quiet():
                    if self.store.check([key]):
                        return self.store.get(key).decode(errors="replace")
            except RuntimeError:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def read(self, rank: int) -> str | None:
        try:
            key = f"{self.prefix}/{rank}"
            with _quiet():
                return self.store.get(key).decode() if self.store.check([key]) else None
        except RuntimeError:
            return None

    def origin(self, rank: int, peer: int | None) -> tuple[int, bool] | None:
        """(the rank that failed first, whether it wrote a line), as far as the posts tell; None if
        they tell nothing. A primary post anywhere wins; else follow the lost peers from ``peer``."""
        notes = {r: self.read(r) for r in range(self.world) if r != rank}
        primary = sorted(r for r, n in notes.items() if n == "primary")
        if primary:
            return primary[0], True
        if peer is None:  # a world collective failed: if exactly one rank stays silent, that is the one
            for _ in range(GRACE_POLLS):
                silent = [r for r, n in notes.items() if n is None]
                if len(silent) <= 1:
                    break
                time.sleep(GRACE_S / GRACE_POLLS)
                notes.update({r: self.read(r) for r in silent})
            silent = [r for r, n in notes.items() if n is None]
            if any(n == "primary" for n in notes.values()):
                return min(r for r, n in notes.items() if n == "primary"), True
            return (silent[0], False) if len(silent) == 1 else None
        seen = {rank}
        while peer is not None and peer not in seen:
            seen.add(peer)
            note = notes.get(peer)
            for _ in range(GRACE_POLLS):  # it may have timed out a moment after us, and be posting
                if note is not None:
                    break
                time.sleep(GRACE_S / GRACE_POLLS)
                note = self.read(peer)
            if note is None:
                return peer, False  # it posted nothing: killed, or alive and silent
            nxt = note.removeprefix("secondary ")
            peer = int(nxt) if nxt.isdigit() else None
        return None


def connect_store(timeout_s: float = 1.0):
    """A new client of this run's rendezvous store (MASTER_ADDR:MASTER_PORT: torchrun's agent's, or
    rank 0's); None if it cannot be reached within about ``timeout_s``. In a thread: TCPStore's
    constructor pings the server and reads the reply with no timeout, so a stopped store (in a
    SIGSTOPped rank 0) would hang it. torch logs each failed attempt on stderr (see _quiet)."""
    found: list = []

    def connect() -> None:
        try:
            found.append(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False))
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
