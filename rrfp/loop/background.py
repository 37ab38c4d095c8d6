"""An event loop of its own, in a daemon thread, for synchronous callers.

A torch training loop is plain blocking code: ``schedule.step(x)`` returns when
the step is done, and there may be no event loop in the program, or one that
belongs to someone else (a notebook). rrfp's runtime is async and its channels,
lane and poller are bound to one loop for their whole life, so that loop must
outlive each step: it runs here, in a thread, and ``call`` hands it one
coroutine at a time and blocks until it is done.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rrfp.loop import exit_guard  # noqa: F401 - at exit, waits for the loop's thread
from rrfp.loop.startup import new_event_loop

T = TypeVar("T")


class BackgroundLoop:
    """A loop from :func:`new_event_loop` running in a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "rrfp-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop; block until it returns, and return (or raise) what it did.
        Ctrl-C while waiting cancels the coroutine before it propagates."""
        if self._closed:
            coro.close()
            raise RuntimeError("this rrfp loop is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BackgroundLoop.call from its own loop would wait on itself forever")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop and its thread; tasks still pending are cancelled. Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def _cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_cancel_rest(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
