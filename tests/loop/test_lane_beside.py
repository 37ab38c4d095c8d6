"""The lane's call beside: it computes while the running call waits at a collective
(``yielding``), and the running call goes on only once the call beside has finished: one call
holds the device at a time. Ordered by events, not by time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rrfp.loop import run
from rrfp.loop.lane import ComputeLane


@pytest.mark.timeout(60)
def test_a_call_beside_runs_while_the_running_call_waits():
    lane = ComputeLane()
    in_window, beside_ran = threading.Event(), threading.Event()
    seen: list = []

    def running():
        with lane.yielding():  # the collective: it completes once the call beside has run
            in_window.set()
            seen.append(("window", lane.window))
            if not beside_ran.wait(20):
                raise AssertionError("the call beside did not run in the window")
        seen.append(("after", lane.window))
        return "running"

    def beside():
        beside_ran.set()
        return "beside"

    async def main():
        first = asyncio.ensure_future(lane.run(running))
        await asyncio.to_thread(in_window.wait, 20)
        second = await lane.run_beside(beside)
        return await first, second

    assert run(main()) == ("running", "beside")
    assert seen == [("window", True), ("after", False)]
    assert lane.tasks_beside == 1 and lane.tasks_run == 2
    lane.close()


@pytest.mark.timeout(60)
def test_the_running_call_goes_on_after_the_call_beside():
    lane = ComputeLane()
    in_window, beside_started, release = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def running():
        with lane.yielding():
            in_window.set()
            if not beside_started.wait(20):
                raise AssertionError("the call beside did not start")
            release.set()  # the collective is done while the call beside still computes
        order.append("running goes on")

    def beside():
        beside_started.set()
        if not release.wait(20):
            raise AssertionError("the running call's collective did not complete")
        order.append("beside ends")

    async def main():
        first = asyncio.ensure_future(lane.run(running))
        await asyncio.to_thread(in_window.wait, 20)  # the call beside comes in the window
        await lane.run_beside(beside)
        await first

    run(main())
    assert order == ["beside ends", "running goes on"]
    lane.close()


@pytest.mark.timeout(60)
def test_a_window_opening_wakes_the_loop():
    lane = ComputeLane()
    opened = []

    async def main():
        woken = asyncio.Event()
        lane.on_window = lambda: (opened.append(lane.window), woken.set())
        go = threading.Event()

        def running():
            with lane.yielding():
                go.wait(20)

        first = asyncio.ensure_future(lane.run(running))
        await asyncio.wait_for(woken.wait(), 20)
        go.set()
        await first

    run(main())
    assert opened == [True]
    lane.close()
