"""A blocking call awaited from the loop, in a daemon thread of its own.

``asyncio.to_thread`` runs the call in the loop's default executor, and
``asyncio.run`` (and ``asyncio.Runner``) joins that executor's threads when it
closes the loop: a collective that waits on a stopped peer (DCP's save or load,
a blocking barrier) then holds the process forever after the wait that awaited
it was cancelled, e.g. by the heartbeat naming the silent peer. A daemon thread
is never joined, so the process ends with its one line while the call stays
blocked.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from rrfp.loop import exit_guard  # noqa: F401 - at exit, waits for the call to return

T = TypeVar("T")


async def in_daemon_thread(
    fn: Callable[..., T], *args: Any, name: str = "rrfp-blocking", **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)`` in a new daemon thread; its result or exception. Cancelling the
    await returns at once and leaves the thread to finish (or block) unobserved."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if future.done():  # cancelled meanwhile
            return
        future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            result = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task, which raises it
            result = (False, e)
        try:
            loop.call_soon_threadsafe(functools.partial(deliver, *result))
        except RuntimeError:  # the loop is closed: nobody awaits the result any more
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def interruptible(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a daemon thread, while this thread waits in short joins: Python
    runs signal handlers only in the main thread between bytecodes, so a main thread blocked in
    one C++ call (a rendezvous waiting for a peer that is gone) would never act on SIGTERM."""
    out: list = []

    def target() -> None:
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            out.append((False, e))

    thread = threading.Thread(target=target, name="rrfp-interruptible", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
    ok, value = out[0]
    if not ok:
        raise value
    return value
