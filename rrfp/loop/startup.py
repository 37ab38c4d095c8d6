"""Event-loop start-up: uvloop when it is installed, plain asyncio otherwise.

The loop is chosen through a loop factory rather than ``uvloop.install()`` or
an event-loop policy, both deprecated (docs/design.md, fact 9). ``asyncio.Runner`` is
used because ``asyncio.run`` only takes ``loop_factory`` from Python 3.12.
Nothing else in rrfp depends on uvloop: embedding drivers bring their own loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("rrfp.loop")

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop, or a default asyncio loop when uvloop cannot be imported."""
    try:
        import uvloop
    except ImportError:
        logger.warning("uvloop is not importable; running on the default asyncio event loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh loop from :func:`new_event_loop`.

    Same as ``asyncio.run(coro, loop_factory=new_event_loop)`` on Python 3.12+.
    """
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
