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
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "rrfp-blocking", **kwargs: Any) -> T:
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
