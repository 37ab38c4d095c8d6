"""Leaving the interpreter while rrfp's daemon threads are inside torch's C++ calls.

CPython 3.11 ends a daemon thread that takes the GIL back after finalization began with
``pthread_exit`` (Python/ceval_gil.h, ``take_gil``); the forced unwind then runs through
torch's pybind11 frames, whose destructors are ``noexcept``, and libstdc++ calls
``std::terminate``: "terminate called without an active exception" and SIGABRT instead of
the script's exit code. Any rrfp thread whose torch call returns in that window does it: the
heartbeat's reader or the stop relay in a store call that a loaded store host answers late, at
the clean end of a run as much as after an error; a channel's waiter in a gloo receive from a
peer that just died, when the script ended on the first of its errors without ``close()``.

So every module that starts a daemon thread calling into torch imports this one, and its
``atexit`` hook, which runs before finalization, is in force whenever such a thread can exist.
It closes what the user left open (``close_at_exit``) and gives the daemon threads named
``rrfp-...`` up to ``EXIT_WAIT_S`` to end: a closed thread ends after its current call, which
returns within a round trip from a live store or a finished peer and fails at once from a dead
one, and returns here, where returning is safe. Waiting costs nothing when no thread is left.
A call blocked on a live peer that never answers (or a stopped store) stays blocked and ends
with the process; it returns during finalization only if that peer moves within those few
hundred milliseconds.

A script that ends on an uncaught exception while such a call is still blocked after the wait (a
gloo receive posted by an iteration the script cancelled: the peer's exit wakes it, whenever
that comes, and both ranks exit at once) is ended here with ``os._exit``, its output flushed, with
the status Python gives an uncaught exception (1; KeyboardInterrupt: SIGINT), which the hook knows
from ``sys.excepthook``: finalization would abort it. A script that ends normally or by
``sys.exit`` goes on to finalization, its status unknown here.

Joining each thread where it is closed would not do: ``close`` runs on the loop thread and on
error paths, where a stuck call must not hold it. Ending the process with ``os._exit`` would
skip the atexit hooks registered before this one and the flushing of files, and an atexit hook
cannot know the exit status the script chose (``sys.exit``'s code never reaches it).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("rrfp.loop.exit_guard")

EXIT_WAIT_S = 2.0  # at most this long at exit, and only while an rrfp thread is still busy
THREAD_PREFIX = "rrfp-"

_closers: list[weakref.WeakMethod] = []
_finishers: list[weakref.WeakMethod] = []
_lock = threading.Lock()


def close_at_exit(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method, held weakly) at interpreter exit, unless its object is
    gone by then."""
    with _lock:
        _closers.append(weakref.WeakMethod(method))


def finish_at_exit(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method, held weakly) at interpreter exit, before the closers, and
    wait for it without a bound: a compute lane's thread finishing the call it runs, as the
    interpreter would join a thread that is not a daemon, unless that call is stuck for good."""
    with _lock:
        _finishers.append(weakref.WeakMethod(method))


def _bounded(fn: Callable[[], None], deadline: float) -> None:
    """``fn()`` in a daemon thread, waited for until ``deadline``: a close that blocks on a stuck
    loop must not hold the exit."""
    thread = threading.Thread(target=fn, name="rrfp-exit-close", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))


def _at_exit() -> None:
    with _lock:
        finishers = [m() for m in _finishers]
        _finishers.clear()
    for finish in finishers:
        if finish is not None:
            _quietly(finish)()
    deadline = time.monotonic() + EXIT_WAIT_S
    with _lock:
        closers = [m() for m in _closers]
        _closers.clear()
    for close in closers:
        if close is not None:
            _bounded(_quietly(close), deadline)
    me = threading.current_thread()
    ours = [
        t
        for t in threading.enumerate()
        if t is not me and t.daemon and t.name.startswith(THREAD_PREFIX)
    ]
    for thread in ours:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in ours if t.is_alive()]
    if left:
        log.debug("exiting while %s still run (a call that has not returned)", ", ".join(left))
    if left and _uncaught:
        _exit_as_uncaught(_uncaught[-1])


def _exit_as_uncaught(error: BaseException) -> None:
    """End the process as Python would after ``error``, without finalization."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if isinstance(error, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)


_uncaught: list[BaseException] = []  # the script's uncaught exception, once Python reported it
_python_hook = sys.excepthook


def _note_uncaught(kind, value, tb) -> None:
    _uncaught.append(value)
    _python_hook(kind, value, tb)


sys.excepthook = _note_uncaught


def _quietly(close: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            close()
        except BaseException as e:  # noqa: BLE001 - the process is ending; the cause was reported
            log.debug("closing at exit: %s: %s", type(e).__name__, e)

    return run


atexit.register(_at_exit)
