"""Leaving the interpreter while rrfp's daemon threads are inside torch's C++ calls.

CPython 3.11 ends a daemon thread that takes the GIL back after finalization began with
``pthread_exit`` (Python/ceval_gil.h, ``take_gil``); the forced unwind then runs through
torch's pybind11 frames, whose destructors are ``noexcept``, and libstdc++ calls
``std::terminate``: "terminate called without an active exception" and SIGABRT instead of
the script's exit code. A channel's waiter thread blocked in a gloo receive from a peer
that just died returns exactly then, when the script ended on the first of its errors
without ``close()``.

So at exit, before finalization (``atexit``), rrfp closes what the user left open
(``close_at_exit``) and gives its daemon threads up to ``EXIT_WAIT_S`` to leave torch's
calls: a wait on a dead peer fails at once and returns here, where returning is safe. A wait
on a live peer stays blocked and ends with the process; it returns during finalization only
if that peer dies within those few hundred milliseconds.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("rrfp.loop.exit_guard")

EXIT_WAIT_S = 2.0  # at most this long at exit, and only while an rrfp thread is still busy
THREAD_PREFIX = "rrfp-"

_closers: list[weakref.WeakMethod] = []
_lock = threading.Lock()


def close_at_exit(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method, held weakly) at interpreter exit, unless its object is
    gone by then."""
    with _lock:
        _closers.append(weakref.WeakMethod(method))


def _bounded(fn: Callable[[], None], deadline: float) -> None:
    """``fn()`` in a daemon thread, waited for until ``deadline``: a close that blocks on a stuck
    loop must not hold the exit."""
    thread = threading.Thread(target=fn, name="rrfp-exit-close", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))


def _at_exit() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    with _lock:
        closers = [m() for m in _closers]
        _closers.clear()
    for close in closers:
        if close is not None:
            _bounded(_quietly(close), deadline)
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and thread.daemon and thread.name.startswith(THREAD_PREFIX):
            thread.join(max(0.0, deadline - time.monotonic()))


def _quietly(close: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - the process is ending; the cause was reported
            log.debug("closing at exit: %s: %s", type(e).__name__, e)

    return run


atexit.register(_at_exit)
