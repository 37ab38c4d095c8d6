"""Turning communication completions into asyncio futures.

Two back ends can report that a message or a kernel is done, and they need
opposite treatments (docs/design.md, facts 1, 2 and 8):

- gloo point-to-point ``Work`` only completes inside a blocking ``wait()``, so
  a :class:`BlockingWaiter` owns a thread that makes those calls one after the
  other and hands each outcome to the loop.
- NCCL ``Work`` and ``torch.cuda.Event`` never block the CPU and must be
  polled, so one :class:`CompletionPoller` per loop polls every pending handle
  from a single task instead of one thread per handle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from rrfp.loop import exit_guard  # noqa: F401 - at exit, waits for a waiter to leave its call

logger = logging.getLogger("rrfp.loop")


class WaiterClosedError(RuntimeError):
    """A call reached a :class:`BlockingWaiter` that was already closed."""


class _Job:
    """One blocking call, the future awaiting it, and whether anyone still cares."""

    __slots__ = ("loop", "future", "fn", "args", "abandoned")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future,
        fn: Callable[..., Any],
        args: tuple,
    ) -> None:
        self.loop = loop
        self.future = future
        self.fn = fn
        self.args = args
        # Written on the loop thread, read on the waiter thread: a plain bool
        # assignment is atomic, and a stale read only costs one useless call.
        self.abandoned = False

    def abandon_if_cancelled(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self.abandoned = True


def _settle(future: asyncio.Future, outcome: BaseException | None, value: Any) -> None:
    """Runs on the loop thread; a future cancelled meanwhile keeps its state."""
    if future.done():
        return
    if outcome is None:
        future.set_result(value)
    else:
        future.set_exception(outcome)


class BlockingWaiter:
    """One daemon thread that runs blocking callables in submission order.

    This is how a gloo channel waits: ``work.wait()`` on a gloo ``irecv`` never
    completes otherwise (docs/design.md, fact 1). Results come back to the awaiting loop
    through ``loop.call_soon_threadsafe``.

    Cancelling the awaiting task cancels its future; the call itself cannot be
    interrupted and runs on, and its late result is dropped. For a receive this
    loses the message, so channels cancel only when they are torn down.
    :meth:`close` likewise stops the thread only after the current call
    returns: what unblocks a stuck ``wait()`` is the process-group timeout
    (``init_process_group(timeout=...)``, docs/design.md, fact 8), never a short timed
    wait. The thread is a daemon so a stuck call cannot hold the process open.
    """

    def __init__(self, name: str = "waiter") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"rrfp-waiter-{name}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the waiter thread after earlier calls; return its result."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``call`` without the await, from the loop's thread: ``fn`` is queued for the waiter
        thread before this returns, ahead of whatever the caller does next; the future has its
        result. Cancelling the future drops the call if it has not begun."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = _Job(loop, future, fn, args)
        future.add_done_callback(job.abandon_if_cancelled)
        with self._lock:
            if self._closed:
                raise WaiterClosedError(f"waiter {self.name!r} is closed")
            self._jobs.put(job)
        return future

    def close(self) -> None:
        """Stop the thread after its current call; calls still queued fail.

        Does not block: joining would hang on a call stuck in a dead peer's
        ``wait()``. Use :meth:`join` where waiting for the thread is safe.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)  # wakes an idle thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (blocking); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def __aenter__(self) -> BlockingWaiter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if self._closed or job is None:
                self._fail_queued(job)
                return
            if job.abandoned:
                continue
            try:
                value, outcome = job.fn(*job.args), None
            except StopIteration as exc:  # a Future refuses StopIteration
                value, outcome = None, RuntimeError(f"blocking call raised {exc!r}")
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiter
                value, outcome = None, exc
            self._deliver(job, outcome, value)

    def _fail_queued(self, first: _Job | None) -> None:
        # After _closed is set under the lock nothing more is queued, so
        # draining until empty reaches every job that will ever be submitted.
        pending = [first] if first is not None else []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                pending.append(job)
        for job in pending:
            if not job.abandoned:
                error = WaiterClosedError(f"waiter {self.name!r} closed before the call ran")
                self._deliver(job, error, None)
        logger.debug("waiter %s stopped; %d queued call(s) failed", self.name, len(pending))

    def _deliver(self, job: _Job, outcome: BaseException | None, value: Any) -> None:
        if job.abandoned:
            logger.debug("waiter %s: dropping result of a cancelled call", self.name)
            return
        try:
            job.loop.call_soon_threadsafe(_settle, job.future, outcome, value)
        except RuntimeError:
            # The loop was closed while the call blocked: nobody can receive it.
            logger.debug("waiter %s: loop closed, dropping late result", self.name)


def _completion_probe(handle: Any) -> Callable[[], bool]:
    if callable(getattr(handle, "is_completed", None)):
        return handle.is_completed
    if callable(getattr(handle, "query", None)):
        return handle.query
    raise TypeError(f"{type(handle).__name__} has neither is_completed() nor query()")


def _reported_error(handle: Any) -> BaseException | None:
    """The error a finished c10d ``Work`` carries, if any.

    NCCL marks a failed ``Work`` completed and keeps the error; ``exception()``
    reads it without ``wait()``, which on NCCL would also touch the current
    stream. torch logs a one-time deprecation warning for it.
    """
    read_error = getattr(handle, "exception", None)
    if not callable(read_error):
        return None
    error = read_error()
    if error is None:
        return None
    if isinstance(error, BaseException):
        return error
    return RuntimeError(f"communication failed: {error!r}")


class _Watch:
    __slots__ = ("handle", "probe", "future", "wait_after", "signal")

    def __init__(self, handle: Any, future: asyncio.Future, wait_after: bool) -> None:
        self.handle = handle
        self.probe = _completion_probe(handle)
        self.future = future
        self.wait_after = wait_after
        # the handle's torch future, when its completion will wake the poller: not done yet
        # when watched (a gloo collective's completes as the work ends, an NCCL one's at enqueue)
        self.signal: Any = None

    def will_wake(self) -> bool:
        """The handle's future is still to complete, and its callback will wake the poller."""
        return self.signal is not None and not self.signal.done()


class CompletionPoller:
    """One task per loop that polls non-blocking completion handles (docs/design.md, fact 2).

    :meth:`watch` returns a future that is done when the handle reports
    completion, with the handle as result, or with the error it reported.
    The first ``watch`` on a running loop starts the polling task, so a
    runtime can own a poller before its loop exists; after ``aclose`` the
    poller refuses new handles.
    While handles are pending the task re-polls after ``asyncio.sleep(0)``;
    after ``spin_rounds`` rounds with no progress it sleeps between rounds,
    starting at ``backoff_s`` and doubling up to ``max_backoff_s``. The
    doubling matters: asyncio rounds a sub-millisecond sleep up to 1 ms, but
    uvloop rounds it down to 0, which would be a busy spin. Any progress or
    new handle resets the back-off. With nothing pending the task sleeps on
    an event, so an idle poller costs nothing.

    ``watch(..., wake_on_future=True)`` also cuts a back-off sleep short when
    the handle's torch future completes (its callback runs on the backend's
    own thread and only schedules a wake-up). gloo collectives complete their
    future when they finish, so they are noticed at once instead of after up
    to ``max_backoff_s``, which matters because collectives run in lockstep:
    a rank asleep in its poller delays the next round for every peer (back to
    back TP agreement rounds on gloo are measurably slower without the
    wake-up). NCCL completes that future at enqueue time; the extra wake-up
    then costs one poll.

    Past the spin, while every pending handle's future is still to
    complete (gloo collectives, whose wake-up says they are done), the task
    does not back off but sleeps until a wake-up, or ``wake_wait_s`` at the
    longest, a backstop: a rank waiting at a collective for a slow or
    stopped peer polls a few times a second instead of a thousand times,
    CPU its peers on the same cores may be computing with. The spin stays:
    a collective that completes within it is seen at once, and a late
    look at one keeps its peer's gloo thread spinning on the next message.
    gloo completes the future a moment before the work reads complete; a
    poll after that wake-up that finds the work not yet complete spins
    again.

    Not for gloo point-to-point work, which never reports completion by
    itself (use :class:`BlockingWaiter`).
    """

    def __init__(
        self,
        *,
        spin_rounds: int = 32,
        backoff_s: float = 100e-6,
        max_backoff_s: float = 1e-3,
        wake_wait_s: float = 0.05,
    ) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max(backoff_s, max_backoff_s)
        self.spin_rounds = spin_rounds
        self.wake_wait_s = wake_wait_s
        self.polls = 0  # poll rounds made, for tests and statistics
        self._watches: list[_Watch] = []
        self._work_arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._nap: asyncio.Future | None = None  # the back-off sleep in progress

    @property
    def pending(self) -> int:
        return len(self._watches)

    def watch(
        self, handle: Any, *, wait_after: bool = False, wake_on_future: bool = False
    ) -> asyncio.Future:
        """A future for ``handle``'s completion; must be called on the poller's loop.

        ``wait_after``: once complete, read the outcome with ``handle.wait()``
        instead of ``exception()``. For a completed c10d collective that is
        immediate on gloo and only orders the current stream on NCCL, and it
        avoids torch's deprecation warning for ``Work.exception``."""
        if self._task is None and not self._closed:
            self._begin()
        if self._task is None or self._task.done():
            raise RuntimeError(
                "CompletionPoller is not running; use 'async with CompletionPoller()'"
            )
        watch = _Watch(handle, self._loop.create_future(), wait_after)
        self._watches.append(watch)
        self._work_arrived.set()
        if wake_on_future:
            signal = handle.get_future()
            signal.add_done_callback(self._wake_threadsafe)
            if not signal.done():  # else its callback has run already, or runs now: poll for it
                watch.signal = signal
        self._wake()  # new handles are polled eagerly, not after a sleep for another's wake-up
        return watch.future

    def _wake_threadsafe(self, _done: Any) -> None:
        """Runs on whichever thread completed the handle: only schedules a wake-up."""
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass

    def _wake(self) -> None:
        if self._nap is not None and not self._nap.done():
            self._nap.set_result(None)

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("CompletionPoller already started")
        self._begin()

    def _begin(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(
            self._poll_until_cancelled(), name="rrfp-completion-poller"
        )

    async def aclose(self) -> None:
        """Stop the polling task and cancel every future still pending."""
        self._closed = True
        task, self._task = self._task, None
        try:
            if task is not None:
                task.cancel()
                await asyncio.wait([task])
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            self._cancel_all()

    async def __aenter__(self) -> CompletionPoller:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _cancel_all(self) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.future.cancel()

    async def _poll_until_cancelled(self) -> None:
        try:
            await self._poll_rounds()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # A bug here must not leave awaiters hanging: they get the error too.
            for watch in self._watches:
                if not watch.future.done():
                    watch.future.set_exception(exc)
            self._watches = []
            raise

    async def _poll_rounds(self) -> None:
        fruitless_rounds = 0
        while True:
            if not self._watches:
                self._work_arrived.clear()
                await self._work_arrived.wait()
            if self._work_arrived.is_set():  # new handles: poll eagerly again
                self._work_arrived.clear()
                fruitless_rounds = 0
            if self._poll_once():
                fruitless_rounds = 0
            else:
                fruitless_rounds += 1
            backoff_rounds = fruitless_rounds - self.spin_rounds
            if backoff_rounds < 0:
                await asyncio.sleep(0)
            elif all(w.will_wake() for w in self._watches):
                await self._sleep(self.wake_wait_s)
                if not all(w.will_wake() for w in self._watches):
                    fruitless_rounds = 0  # woken: the work reads complete now or a moment later
            else:
                await self._sleep(
                    min(self.backoff_s * 2 ** min(backoff_rounds, 32), self.max_backoff_s)
                )

    async def _sleep(self, seconds: float) -> None:
        """``asyncio.sleep`` that ``_wake`` can cut short."""
        self._nap = self._loop.create_future()
        timer = self._loop.call_later(seconds, _settle, self._nap, None, None)
        try:
            await self._nap
        finally:
            timer.cancel()
            self._nap = None

    def _poll_once(self) -> bool:
        """Poll every watch once; True when at least one future was settled or dropped."""
        self.polls += 1
        still_pending: list[_Watch] = []
        progressed = False
        for watch in self._watches:
            if watch.future.done():  # the caller cancelled it
                progressed = True
                continue
            try:
                completed = watch.probe()
                error = None
                if completed and watch.wait_after:
                    watch.handle.wait()  # raises the error the Work carries
                elif completed:
                    error = _reported_error(watch.handle)
            except Exception as exc:  # noqa: BLE001 - belongs to this handle's awaiter
                watch.future.set_exception(exc)
                progressed = True
                continue
            if not completed:
                still_pending.append(watch)
                continue
            progressed = True
            if error is None:
                watch.future.set_result(watch.handle)
            else:
                watch.future.set_exception(error)
        self._watches = still_pending
        return progressed
