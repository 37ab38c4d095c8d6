"""A stop request relayed to every rank through the rendezvous store.

torchrun SIGTERMs every rank, but a user may signal one. A rank that stops
its step alone leaves its peers waiting for its messages until
``run.timeout_s``, so a rank that got SIGTERM adds 1 to a counter on the
run's store (torchrun's agent's, or rank 0's: the one ``failure_board.py``
uses), and a thread on every rank reads it every ``POLL_S``. A store read is
one small TCP round trip off the event loop. The thread starts polling only
once this process has joined its process group, so the store exists by then
and no failed connection is logged. Best effort, like the failure board: with
no store, a SIGTERM stops the ranks it reached, and the others fail their
peer deadline, naming the rank. Each poll also adds 1 to this rank's alive
counter, which the failure board reads to tell a killed rank from a blocked one.
"""

from __future__ import annotations

import logging
import threading

import torch.distributed as dist

import rrfp.loop.exit_guard  # noqa: F401 - at exit, waits for the poll to leave its store call
from rrfp.app.job.failure_board import alive_key, connect_store
from rrfp.comm.job_store import attempt

log = logging.getLogger("rrfp.app.job.stop_relay")

POLL_S = (
    0.2  # a stop reaches every rank within about this long, plus one step poll (train.STOP_POLL_S)
)
PREFIX = "rrfp/stop"


class StopRelay:
    """``post(name)`` (from a signal handler: it only sets flags) tells every rank; ``seen`` is set
    once any rank has posted, this one included; ``signal``: the name of the signal a rank posted
    (the first one, whichever rank), once known."""

    def __init__(self) -> None:
        self.key = f"{PREFIX}/{attempt()}"
        self.seen = threading.Event()
        self._posted = False  # this rank asked (read by the thread)
        self.signal = ""
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="rrfp-stop-relay", daemon=True)

    def start(self) -> StopRelay:
        self._thread.start()
        return self

    def post(self, signal: str = "SIGTERM") -> None:
        self.signal = self.signal or signal
        self._posted = True
        self.seen.set()
        self._wake.set()

    def close(self) -> None:
        """Stop polling (the run is over: the store may be going away)."""
        self._closed = True
        self._wake.set()

    def _serve(self) -> None:
        store, told = None, False
        while not self._closed and not (self.seen.is_set() and (told or not self._posted)):
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._closed or not dist.is_initialized():
                continue
            try:
                if store is None:
                    store = connect_store()
                    if store is None:
                        log.debug(
                            "stop relay: the rendezvous store cannot be reached; relaying nothing"
                        )
                        return
                store.add(alive_key(dist.get_rank()), 1)  # for the failure board: this rank lives
                if self._posted and not told:
                    store.compare_set(
                        f"{self.key}/signal", "", self.signal
                    )  # the first rank's name stays
                    store.add(self.key, 1)
                    told = True
                if store.add(self.key, 0) > 0:  # adding 0: an atomic read, 0 when nobody posted
                    self.signal = self.signal or store.get(f"{self.key}/signal").decode(
                        errors="replace"
                    )
                    self.seen.set()
            except (
                RuntimeError
            ) as e:  # the store went away (its host rank died, or the run is ending):
                log.debug(
                    "stop relay: %s", e
                )  # no reconnecting, whose every failed try torch logs on stderr
                return
