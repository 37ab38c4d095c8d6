"""Tests of rrfp.loop: waiter thread, completion poller, compute lane, start-up."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time

import pytest
import pytest_asyncio
import uvloop

from rrfp.loop import (
    BlockingWaiter,
    CompletionPoller,
    ComputeLane,
    WaiterClosedError,
    make_lane,
    new_event_loop,
    run,
)

LOOP_FACTORIES = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(uvloop.new_event_loop, id="uvloop"),
]


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escape any thread (they would otherwise only be printed)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


@pytest_asyncio.fixture
async def loop_errors():
    """Whatever reaches the running loop's exception handler ("never retrieved" and the like)."""
    contexts: list[dict] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: contexts.append(context))
    yield contexts
    loop.set_exception_handler(previous)


def run_on(loop_factory, coro):
    """``asyncio.run(coro, loop_factory=...)``, which Python 3.11 lacks."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


async def wait_until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


def error_records(caplog) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.ERROR]


# ---------------------------------------------------------------- BlockingWaiter


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_waiter_runs_calls_in_submission_order():
    started: list[int] = []

    def job(index: int) -> int:
        started.append(index)
        time.sleep(0.005 * (5 - index))  # earlier calls take longer
        assert threading.current_thread().name == "rrfp-waiter-fifo"
        return index * 10

    async with BlockingWaiter("fifo") as waiter:
        results = await asyncio.gather(*(waiter.call(job, index) for index in range(5)))
    assert started == [0, 1, 2, 3, 4]
    assert results == [0, 10, 20, 30, 40]


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_waiter_propagates_exception_type():
    def fail() -> None:
        raise ConnectionError("peer rank 3 went away")

    def stop() -> None:
        raise StopIteration

    async with BlockingWaiter("errors") as waiter:
        with pytest.raises(ConnectionError, match="peer rank 3"):
            await waiter.call(fail)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await waiter.call(stop)
        assert await waiter.call(lambda: "still serving") == "still serving"


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_cancelled_call_leaves_waiter_usable(caplog, loop_errors, thread_errors):
    gate = threading.Event()
    entered = threading.Event()
    skipped_ran = threading.Event()

    def block() -> str:
        entered.set()
        gate.wait(10)
        raise ValueError("late failure nobody awaits")

    async with BlockingWaiter("cancel") as waiter:
        blocked = asyncio.create_task(waiter.call(block))
        queued = asyncio.create_task(waiter.call(skipped_ran.set))
        await wait_until(entered.is_set)
        blocked.cancel()
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        assert await waiter.call(lambda x: x + 1, 41) == 42
    assert not skipped_ran.is_set(), "a call cancelled before it started must not run"
    gc.collect()
    await asyncio.sleep(0)
    assert loop_errors == []
    assert thread_errors == []
    assert error_records(caplog) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_late_result_after_cancel_and_loop_close_is_swallowed(loop_factory, caplog, thread_errors):
    gate = threading.Event()
    entered = threading.Event()
    finished = threading.Event()
    waiter = BlockingWaiter("late-cancel")

    def block() -> str:
        entered.set()
        gate.wait(10)
        finished.set()
        return "late"

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await waiter.call(block)

    run_on(loop_factory, give_up())
    assert entered.is_set()
    gate.set()
    assert finished.wait(5)

    async def reuse() -> str:
        return await waiter.call(lambda: "fresh loop")

    assert run_on(loop_factory, reuse()) == "fresh loop"
    waiter.close()
    assert waiter.join(5)
    assert thread_errors == []
    assert error_records(caplog) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_late_result_for_a_closed_loop_is_swallowed(loop_factory, caplog, thread_errors):
    """An embedding driver may close its loop with a call still pending."""
    caplog.set_level(logging.DEBUG, logger="rrfp.loop")
    gate = threading.Event()
    entered = threading.Event()
    waiter = BlockingWaiter("late-closed")

    def block() -> str:
        entered.set()
        gate.wait(10)
        return "late"

    loop = loop_factory()
    pending = loop.create_task(waiter.call(block))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert entered.wait(5)
    loop.close()  # the task is still pending: its future is never cancelled
    gate.set()

    async def reuse() -> str:
        return await waiter.call(lambda: "next loop")

    assert run_on(loop_factory, reuse()) == "next loop"
    waiter.close()
    assert waiter.join(5)
    assert any("loop closed" in record.getMessage() for record in caplog.records)
    assert thread_errors == []
    assert error_records(caplog) == []
    pending._log_destroy_pending = False  # the pending task is the point of this test
    del pending


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_close_fails_queued_calls_and_refuses_new_ones():
    gate = threading.Event()
    entered = threading.Event()

    def block() -> str:
        entered.set()
        gate.wait(10)
        return "current call completes"

    waiter = BlockingWaiter("close")
    current = asyncio.create_task(waiter.call(block))
    queued = asyncio.create_task(waiter.call(lambda: "never runs"))
    await wait_until(entered.is_set)
    waiter.close()
    with pytest.raises(WaiterClosedError):
        await waiter.call(lambda: None)
    gate.set()
    assert await current == "current call completes"
    with pytest.raises(WaiterClosedError):
        await queued
    await wait_until(lambda: not waiter.thread.is_alive())


# ---------------------------------------------------------------- CompletionPoller


class FakeWork:
    """A c10d-Work-like handle that completes after ``polls_needed`` polls."""

    def __init__(self, polls_needed: int, error: BaseException | None = None) -> None:
        self.polls_needed = polls_needed
        self.polls = 0
        self.error = error

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls >= self.polls_needed

    def exception(self) -> BaseException | None:
        return self.error


class FakeEvent:
    """A torch.cuda.Event-like handle that completes at a wall-clock time."""

    def __init__(self, delay_s: float) -> None:
        self.done_at = time.monotonic() + delay_s

    def query(self) -> bool:
        return time.monotonic() >= self.done_at


class BrokenWork:
    def is_completed(self) -> bool:
        raise RuntimeError("NCCL communicator was aborted on rank 2")


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_poller_completes_in_readiness_order():
    completed: list[str] = []
    async with CompletionPoller() as poller:
        # Submitted slowest first.
        handles = {"event": FakeEvent(0.05), "work-20": FakeWork(20), "work-2": FakeWork(2)}
        futures = []
        for name, handle in handles.items():
            future = poller.watch(handle)
            future.add_done_callback(lambda _f, name=name: completed.append(name))
            futures.append(future)
        results = await asyncio.gather(*futures)
    assert completed == ["work-2", "work-20", "event"]
    assert results == list(handles.values())


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_poller_timed_handles_complete_by_time_not_submission():
    async with CompletionPoller() as poller:
        later = poller.watch(FakeEvent(0.08))
        sooner = poller.watch(FakeEvent(0.01))
        done, _ = await asyncio.wait([later, sooner], return_when=asyncio.FIRST_COMPLETED)
        assert done == {sooner}
        await later


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_poller_delivers_errors_to_their_own_future():
    async with CompletionPoller() as poller:
        broken = poller.watch(BrokenWork())
        failed = poller.watch(FakeWork(3, error=ConnectionResetError("peer rank 5")))
        healthy_handle = FakeWork(5)
        healthy = poller.watch(healthy_handle)
        with pytest.raises(RuntimeError, match="aborted on rank 2"):
            await broken
        with pytest.raises(ConnectionResetError, match="peer rank 5"):
            await failed
        assert await healthy is healthy_handle


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_idle_poller_does_not_spin():
    async with CompletionPoller() as poller:
        await poller.watch(FakeWork(1))
        polls_before = poller.polls
        await asyncio.sleep(0.2)
        assert poller.polls - polls_before <= 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_poller_backs_off_while_waiting(loop_factory):
    async def wait_for_slow_event() -> CompletionPoller:
        async with CompletionPoller(spin_rounds=8, backoff_s=100e-6, max_backoff_s=1e-3) as poller:
            await poller.watch(FakeEvent(0.1))
        return poller

    poller = run_on(loop_factory, wait_for_slow_event())
    # 8 spins, a few short sleeps, then >= 1 ms a round: a busy spin makes thousands.
    assert poller.polls < 8 + 10 + 0.1 / 1e-3 + 20


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_poller_drops_cancelled_watches_and_cancels_pending_on_close(loop_errors):
    poller = CompletionPoller()
    async with poller:
        abandoned = poller.watch(FakeEvent(60))
        abandoned.cancel()
        await wait_until(lambda: poller.pending == 0)
        forgotten = poller.watch(FakeEvent(60))
    assert forgotten.cancelled()
    with pytest.raises(RuntimeError, match="not running"):
        poller.watch(FakeWork(1))
    assert loop_errors == []


class FutureWork:
    """A Work that completes on another thread after ``delay_s`` and then
    completes its torch-style future there too (as a gloo collective does)."""

    def __init__(self, delay_s: float, error: BaseException | None = None) -> None:
        import concurrent.futures

        self.done, self.error, self.waited = False, error, 0
        self._future = concurrent.futures.Future()
        threading.Timer(delay_s, self._finish).start()

    def _finish(self) -> None:
        self.done = True
        self._future.set_result(None)

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited += 1
        if self.error is not None:
            raise self.error

    def get_future(self):
        return self._future


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop_factory", LOOP_FACTORIES)
def test_future_wakes_the_poller_out_of_its_back_off(loop_factory):
    """A long back-off (50 ms) would be the latency without the wake-up."""

    async def go():
        async with CompletionPoller(spin_rounds=0, backoff_s=0.05, max_backoff_s=0.05) as poller:
            slow = FutureWork(0.02)
            t0 = time.perf_counter()
            await poller.watch(slow, wait_after=True, wake_on_future=True)
            woken = time.perf_counter() - t0
            t0 = time.perf_counter()
            await poller.watch(FutureWork(0.02), wait_after=True)  # no wake-up: waits out the nap
            napped = time.perf_counter() - t0
            failing = FutureWork(0.001, error=RuntimeError("peer gone"))
            with pytest.raises(RuntimeError, match="peer gone"):
                await poller.watch(failing, wait_after=True, wake_on_future=True)
        return woken, napped, slow.waited

    woken, napped, waited = run_on(loop_factory, go())
    assert woken < 0.045 <= napped, (woken, napped)
    assert waited == 1  # the outcome is read with wait() once complete


# ---------------------------------------------------------------- ComputeLane


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_lane_spends_emulated_time_and_returns_result():
    async with ComputeLane(unit_s=0.02, name="emulate") as lane:
        started = time.perf_counter()
        result = await lane.run(
            lambda a, b: (a + b, threading.current_thread().name), 2, 3, units=3
        )
        elapsed = time.perf_counter() - started
    assert result[0] == 5
    assert result[1].startswith("rrfp-lane-emulate")
    assert elapsed >= 0.06
    assert lane.tasks_run == 1
    assert lane.busy_s >= 0.06


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_lane_does_not_pad_calls_longer_than_emulated_time():
    async with ComputeLane(unit_s=0.001) as lane:
        started = time.perf_counter()
        await lane.run(time.sleep, 0.05, units=10)
        elapsed = time.perf_counter() - started
    assert 0.05 <= elapsed < 0.05 + 0.5  # generous: the machine is shared


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_concurrent_lane_calls_serialize():
    order: list[str] = []
    async with ComputeLane(unit_s=0.02) as lane:
        started = time.perf_counter()
        await asyncio.gather(
            lane.run(order.append, "first", units=2), lane.run(order.append, "second", units=3)
        )
        elapsed = time.perf_counter() - started
    assert order == ["first", "second"]
    assert elapsed >= 0.1
    assert lane.tasks_run == 2


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_loop_stays_responsive_while_lane_computes():
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    async with ComputeLane(unit_s=0.02) as lane:
        async with asyncio.TaskGroup() as group:
            ticker = group.create_task(tick())
            await lane.run(lambda: None, units=10)  # 0.2 s in the lane
            ticker.cancel()
    assert ticks >= 10


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_abandon_ends_emulated_time_held_now_and_later():
    """A stop that does not wait for the step: the lane's emulated hold (here 30 s, and hold_s, the
    slow fault's) ends at once on abandon(); the thread is free for the next call."""
    async with ComputeLane(unit_s=1.0) as lane:
        held = asyncio.ensure_future(lane.run(lambda: "done", units=30))
        await asyncio.sleep(0.2)
        started = time.perf_counter()
        lane.abandon()
        assert await held == "done"
        assert await lane.run(lambda: "next", units=30, hold_s=30) == "next"
        elapsed = time.perf_counter() - started
    assert elapsed < 5, f"the held lane took {elapsed:.1f} s to let go"


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_hold_s_adds_to_emulated_time():
    async with ComputeLane(unit_s=0.0) as lane:
        started = time.perf_counter()
        await lane.run(lambda: None, hold_s=0.1)
        assert time.perf_counter() - started >= 0.1


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_lane_propagates_exceptions():
    def fail() -> None:
        raise FloatingPointError("loss is nan")

    async with ComputeLane(unit_s=0.01) as lane:
        with pytest.raises(FloatingPointError, match="nan"):
            await lane.run(fail, units=5)
        assert await lane.run(lambda: "next") == "next"


def test_make_lane_picks_by_device():
    lane = make_lane("cpu", unit_s=0.01)
    assert isinstance(lane, ComputeLane) and lane.unit_s == 0.01
    lane.close()
    with pytest.raises(ValueError, match="CompletionPoller"):
        make_lane("cuda:0", unit_s=0.01)


class FakeCudaClock:
    """A torch stand-in for CudaComputeLane: one stream whose kernels take wall-clock time.

    ``kernel(d)`` enqueues d seconds of work behind whatever the stream holds;
    events complete when the stream's clock passes them, as CUDA events do."""

    def __init__(self) -> None:
        import contextlib as _cl
        import types

        class Stream:
            def __init__(self, device=None) -> None:
                self.busy_until = 0.0

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = None

            def record(self, stream) -> None:
                self.t = max(time.perf_counter(), stream.busy_until)

            def query(self) -> bool:
                return time.perf_counter() >= self.t

            def elapsed_time(self, other) -> float:
                return (other.t - self.t) * 1e3

        self.stream = None
        self.cuda = types.SimpleNamespace(
            is_available=lambda: True,
            Stream=self._remember(Stream),
            Event=Event,
            device=lambda d: _cl.nullcontext(),
            stream=lambda s: _cl.nullcontext(),
            _sleep=lambda cycles: None,
        )
        self.device = __import__("torch").device

    def _remember(self, cls):
        def make(device=None):
            self.stream = cls(device)
            return self.stream

        return make

    def kernel(self, seconds: float) -> None:
        s = self.stream
        s.busy_until = max(time.perf_counter(), s.busy_until) + seconds


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_cuda_lane_keeps_the_next_task_enqueued_behind_the_running_one():
    """20 ms tasks, 5 ms of deciding between them: with one task enqueued ahead the
    device never waits for the loop; waiting for each task leaves a gap per decision."""
    from rrfp.loop import CudaComputeLane

    gaps = {}
    for ahead in (1, 0):
        fake = FakeCudaClock()
        async with CompletionPoller(spin_rounds=4, backoff_s=1e-4, max_backoff_s=5e-4) as poller:
            lane = CudaComputeLane(poller, "cuda:0", max_ahead=ahead, torch_module=fake)
            for i in range(8):
                t0 = time.perf_counter()
                assert await lane.run(fake.kernel, 0.02) is None
                returned_after = time.perf_counter() - t0
                if ahead and i == 0:
                    assert returned_after < 0.01, (
                        "the first task is only enqueued: run() returns at once"
                    )
                await asyncio.sleep(0.005)  # the loop deciding what comes next
            await lane.drain()
        assert lane.tasks_run == 8 and lane.busy_s == pytest.approx(8 * 0.02, rel=0.2)
        gaps[ahead] = sorted(lane.gaps_s)[len(lane.gaps_s) // 2]
    assert gaps[1] < 0.001 and gaps[0] > 0.003, gaps


# ---------------------------------------------------------------- start-up


async def loop_type() -> type:
    return type(asyncio.get_running_loop())


@pytest.mark.timeout(30)
def test_run_uses_uvloop_when_importable():
    assert issubclass(run(loop_type()), uvloop.Loop)


@pytest.mark.timeout(30)
def test_run_falls_back_to_asyncio_without_uvloop(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # makes "import uvloop" fail
    with caplog.at_level(logging.WARNING, logger="rrfp.loop"):
        kind = run(loop_type())
    assert not issubclass(kind, uvloop.Loop)
    assert issubclass(kind, asyncio.AbstractEventLoop)
    assert any("uvloop" in record.getMessage() for record in caplog.records)
    loop = new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


@pytest.mark.timeout(30)
@pytest.mark.asyncio
async def test_a_wake_up_before_any_back_off_is_harmless(loop_errors):
    """A collective that completes while the poller has not slept yet still wakes it cleanly."""
    async with CompletionPoller() as poller:
        work = FutureWork(0.0)
        await asyncio.sleep(0.01)  # completed before it is watched: the callback runs at once
        await poller.watch(work, wait_after=True, wake_on_future=True)
        poller._wake()
    assert loop_errors == []
