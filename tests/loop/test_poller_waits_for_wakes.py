"""The completion poller waits for a gloo collective without backing off: a handle whose torch
future completes with the work (``wake_on_future``) is polled through the spin and then once when
its wake-up comes, however long the wait, and the poller still notices what a wake-up cannot
tell: a work that reads complete only after its future did, and a new handle that must be polled.

``wake_wait_s`` (the backstop sleep) is an hour here, so each count is exact and a missed
wake-up hangs the test instead of costing a backstop's wait."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import uvloop

from rrfp.loop import CompletionPoller

LOOP_FACTORIES = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(uvloop.new_event_loop, id="uvloop"),
]
HOUR = 3600.0
SPIN = 4


class GatedWork:
    """A gloo-collective-like Work finished by the test from another thread."""

    def __init__(self) -> None:
        self.done = False
        self.future = concurrent.futures.Future()

    def finish(self, lag_s: float | None = None) -> None:
        """Complete the work, then its future; with ``lag_s``, the future first and the work
        ``lag_s`` later, as gloo's worker thread does in the moment between the two."""

        def run() -> None:
            if lag_s is None:
                self.done = True
                self.future.set_result(None)
                return
            self.future.set_result(None)
            threading.Event().wait(lag_s)
            self.done = True

        threading.Thread(target=run).start()

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        pass

    def get_future(self):
        return self.future


class PolledWork:
    """An NCCL-like Work: its future is done at once (enqueued), completion is polled."""

    def __init__(self, polls_needed: int) -> None:
        self.polls_needed, self.polls = polls_needed, 0
        self.future = concurrent.futures.Future()
        self.future.set_result(None)

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls >= self.polls_needed

    def wait(self) -> None:
        pass

    def get_future(self):
        return self.future


def run_on(loop_factory, coro):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_a_long_wait_at_a_gloo_collective_costs_the_spin_and_one_poll(loop_factory):
    async def go() -> tuple[int, int]:
        async with CompletionPoller(spin_rounds=SPIN, wake_wait_s=HOUR) as poller:
            work = GatedWork()
            waiting = poller.watch(work, wait_after=True, wake_on_future=True)
            await asyncio.sleep(0.3)  # a late peer: backing off polled hundreds of times
            before = poller.polls
            work.finish()
            async with asyncio.timeout(10):
                assert await waiting is work
            return before, poller.polls

    before, after = run_on(loop_factory, go())
    assert (before, after) == (SPIN, SPIN + 1), "the spin's polls, then one at the wake-up"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_a_wake_up_before_the_work_reads_complete_falls_back_to_polling(loop_factory):
    async def go() -> None:
        async with CompletionPoller(wake_wait_s=HOUR) as poller:
            work = GatedWork()
            waiting = poller.watch(work, wait_after=True, wake_on_future=True)
            await asyncio.sleep(0.05)
            work.finish(lag_s=0.05)
            async with asyncio.timeout(10):  # a poller asleep for a wake-up would wait an hour
                await waiting

    run_on(loop_factory, go())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_a_handle_watched_while_the_poller_sleeps_for_a_wake_up_is_polled(loop_factory):
    async def go() -> None:
        async with CompletionPoller(wake_wait_s=HOUR) as poller:
            gloo = GatedWork()
            pending = poller.watch(gloo, wait_after=True, wake_on_future=True)
            for wake_on_future in (False, True):  # an NCCL Work's future is done: no wake-up
                await asyncio.sleep(0.05)  # past the spin: asleep for gloo's wake-up
                async with asyncio.timeout(10):
                    await poller.watch(PolledWork(3), wake_on_future=wake_on_future)
            assert not pending.done()
            gloo.finish()
            async with asyncio.timeout(10):
                await pending

    run_on(loop_factory, go())
