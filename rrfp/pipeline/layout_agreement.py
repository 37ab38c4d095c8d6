"""Every rank's executor agrees on the microbatch count and the number of stages: ranks given
different counts would wait for messages that never come and end as a deadlock after
``timeouts.progress_s``, or a bare cancellation, without a word about the cause.

Each rank's executor writes what it was built for under its key on the job's store as it is
built, and its first iterations read the peers' keys beside their work, a ``check`` per poll on
the loop (no thread, no collective left posted if the iteration ends otherwise): once every
peer's key is there, a difference ends the iteration with one line naming the values and the
ranks, the same line on every rank. A peer not built yet (a DP replica of another pipeline)
leaves the check pending until a later iteration, never the iteration waiting.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

POLL_S = 0.05  # how often a pending check reads the store during an iteration
ACK_S = 5.0  # how long a rank that found a mismatch waits for every rank to have read the shapes

log = logging.getLogger("rrfp.pipeline.layout_agreement")


class LayoutMismatch(ValueError):
    """The ranks' executors were built for different microbatch counts or numbers of stages: the
    caller's arguments differ across ranks."""


@dataclass(frozen=True)
class ExecutorShape:
    """What every rank's executor must agree on."""

    n_microbatches: int
    num_stages: int
    stage_layout: str = ""  # pipeline ranks x stages per rank (placement)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def disagreement(rank: int, shapes: list[ExecutorShape]) -> str | None:
    """The line for shapes that differ across ranks (``shapes[r]``: rank r's); None: they agree."""
    for field, what, needed in (
        ("n_microbatches", "microbatch count", "the same microbatches (n_microbatches)"),
        ("num_stages", "number of stages", "the same stage layout"),
        ("stage_layout", "stage layout", "the same stage layout (virtual=, placement=)"),
    ):
        values: dict[object, list[int]] = {}
        for r, shape in enumerate(shapes):
            values.setdefault(getattr(shape, field), []).append(r)
        if len(values) > 1:
            said = "; ".join(f"{v} on {_ranks(rs)}" for v, rs in values.items())
            return (
                f"rank {rank}: the ranks disagree on the {what} ({said}): every rank's "
                f"stage_executor or ScheduleReady must be given {needed}"
            )
    return None


class LayoutCheck:
    """This rank's executor's shape, written on ``store`` under ``prefix`` now; ``alongside``
    its iterations until every rank's is read."""

    def __init__(self, store, prefix: str, rank: int, world: int, shape: ExecutorShape) -> None:
        self.store, self.rank = store, rank
        self.keys = [f"{prefix}/{r}" for r in range(world)]
        self.agreed = False
        store.set(self.keys[rank], pickle.dumps(shape))

    def _verdict(self) -> str | None:
        """The mismatch's line once every key is there; None: agreed, or not all there yet. A
        store gone (its host ended) ends the check: the iteration fails on that peer itself."""
        try:
            if not self.store.check(self.keys):
                return None
            shapes = [pickle.loads(v) for v in self.store.multi_get(self.keys)]
            self.store.set(self._read_key(self.rank), b"1")
        except RuntimeError as e:  # DistNetworkError: the store's host is gone
            log.info("rank %d: the executors' shapes go unchecked: %s", self.rank, e)
            self.agreed = True
            return None
        self.agreed = True
        return disagreement(self.rank, shapes)

    def _read_key(self, rank: int) -> str:
        return f"{self.keys[rank]}/read"

    async def _refuse(self, line: str) -> None:
        """Raise LayoutMismatch once every rank has read the shapes (``ACK_S`` at most): the
        store may live in this process (rank 0's, without torchrun), and a peer must read it
        before this rank leaves, to say the same line."""
        until = time.monotonic() + ACK_S
        read = [self._read_key(r) for r in range(len(self.keys))]
        while time.monotonic() < until:
            try:
                if self.store.check(read):
                    break
            except RuntimeError:
                break
            await asyncio.sleep(POLL_S)
        raise LayoutMismatch(line)

    async def alongside(self, work: Awaitable[Any]) -> Any:
        """``await work``, ended by LayoutMismatch once the shapes read differ. Read once more
        when ``work`` ends first: an iteration's pipeline peers sent to this rank, so they were
        built, and their keys are there."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done() and not self.agreed:
                line = self._verdict()
                if line is not None:
                    task.cancel()
                    await asyncio.wait([task])
                    await self._refuse(line)
                if not self.agreed:
                    await asyncio.wait([task], timeout=POLL_S)
            line = None if self.agreed else self._verdict()
            if line is not None:
                if not task.cancelled():
                    task.exception()  # retrieved: the mismatch is the cause
                await self._refuse(line)
            return await task
        except BaseException:
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
            raise
