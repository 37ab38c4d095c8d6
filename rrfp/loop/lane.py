"""The compute lane: where a stage's F, B and W run (docs/design.md, fact 7).

A stage computes in one lane, one task after the other, while its event loop
keeps receiving, sending and deciding. On GPU the lane is a CUDA stream; on
CPU it is one compute thread. Emulated device time (the variability model's
duration, ``units * unit_s`` seconds) is spent inside the lane, so a CPU
stage that "computes" leaves its loop free, as a GPU stage does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rrfp.loop import exit_guard
from rrfp.loop.completions import CompletionPoller
from rrfp.loop.host_memory import keep_freed_memory

logger = logging.getLogger("rrfp.loop")


class ComputeLane:
    """One thread that runs compute calls in submission order.

    ``await lane.run(fn, *args, units=u)`` returns ``fn(*args)`` once the call
    has held the lane for at least ``u * unit_s`` seconds: after ``fn`` returns
    the thread sleeps off the rest, and does not sleep when ``fn`` alone took
    longer. ``more_s``, asked after ``fn`` returns, adds the seconds ``fn`` spent
    on emulated time of its own (a MoE layer's experts and all-to-alls,
    rrfp/nn/expert_time.py), which the units do not hold. A call that raises
    spends no emulated time; its exception reaches the awaiter. Cancelling the
    awaiter drops a queued call; a running call finishes and its result is
    dropped. ``abandon()`` (a stop that does not
    wait for the step) also cuts short the emulated time being held, and any
    later: emulated time stands for a kernel that the device would still be
    running, and nobody waits for it any more.

    A second thread runs calls *beside* the running one (``run_beside``): the lane's device is a
    lock that the computing thread holds, emulated time included, and a call that waits at a
    collective lets it go meanwhile (``yielding``: a MoE layer's all-to-all in flight), so that
    the call beside computes then. The call that yielded gets the device back once the
    collective is done and the call beside has finished; neither thread waits for the other
    otherwise, so the two cannot block each other for good. ``window`` says that the running
    call waits there now; ``on_window`` is called on the awaiter's loop when it starts to.
    """

    emulates_on_host = True  # emulated time is this thread's: a layer may spend some of it

    def __init__(self, unit_s: float = 0.0, name: str = "compute") -> None:
        # the lane's thread allocates from a malloc arena of its own: without this, each task
        # faults its activations' pages in afresh (rrfp/loop/host_memory.py)
        keep_freed_memory()
        self.unit_s = unit_s
        self.name = name
        self.busy_s = 0.0  # wall time the lane spent on calls, emulation included
        self.tasks_run = 0
        self.tasks_beside = 0  # of them, run beside another (run_beside)
        # wall-clock (time.time()) start and end of the last call's own work, emulation excluded:
        # what a trace needs to tell the compute from the host time around it
        self.last_call: tuple[float, float] | None = None
        # a daemon thread of its own, not a ThreadPoolExecutor's: a task stuck for good (named by
        # rrfp/pipeline/task_bound.py) must not hold the interpreter's exit, which joins those.
        # At exit the thread finishes the call it runs (``_finish``), unless that call is stuck
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._beside: queue.SimpleQueue = queue.SimpleQueue()  # calls run beside (run_beside)
        self._beside_thread: threading.Thread | None = None
        self.last_beside_call: tuple[float, float] | None = None  # as last_call, beside
        self._device = threading.Lock()  # held by the thread that computes
        self.window = False  # the running call waits at a collective: the device is free
        self.on_window: Callable[[], None] | None = None  # called on the loop as a window opens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.stuck = False  # a call ran past its bound: nobody waits for it, the exit included
        self._abandoned = threading.Event()  # set: emulated time ends at once

    async def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        units: float = 0.0,
        hold_s: float = 0.0,
        more_s: Callable[[], float] | None = None,
    ) -> Any:
        """Run ``fn(*args)`` in the lane, holding it for ``units * unit_s + hold_s`` seconds at
        least (``hold_s``: a testing aid, rrfp/app/faults.py's slow task), plus ``more_s()``."""
        if self._closed:
            raise RuntimeError(f"lane {self.name}: closed")
        if self._thread is None:
            self._thread = self._start(self._calls, False, f"rrfp-lane-{self.name}")
            exit_guard.finish_at_exit(self._finish)
        return await self._submit(self._calls, fn, args, units * self.unit_s + hold_s, more_s)

    async def run_beside(
        self, fn: Callable[..., Any], *args: Any, units: float = 0.0, hold_s: float = 0.0
    ) -> Any:
        """As ``run``, on the second thread: the call computes while the running call lets the
        device go (``yielding``), or once it has finished."""
        if self._closed:
            raise RuntimeError(f"lane {self.name}: closed")
        if self._beside_thread is None:
            self._beside_thread = self._start(self._beside, True, f"rrfp-lane-{self.name}-beside")
        return await self._submit(self._beside, fn, args, units * self.unit_s + hold_s, None)

    @contextlib.contextmanager
    def yielding(self) -> Iterator[None]:
        """On the lane's thread, around a wait at a collective inside a call: the device is free
        for a call beside meanwhile, and back (after that call) before the call goes on."""
        self._device.release()
        self.window = True
        if self._loop is not None and self.on_window is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it
                self._loop.call_soon_threadsafe(self.on_window)
        try:
            yield
        finally:
            self.window = False
            self._device.acquire()

    def _start(self, calls: queue.SimpleQueue, beside: bool, name: str) -> threading.Thread:
        thread = threading.Thread(target=self._serve, args=(calls, beside), name=name, daemon=True)
        thread.start()
        return thread

    async def _submit(self, calls: queue.SimpleQueue, fn, args, hold_s: float, more_s) -> Any:
        loop = self._loop = asyncio.get_running_loop()
        done = loop.create_future()
        calls.put((loop, done, fn, args, hold_s, more_s))
        return await done

    def _serve(self, calls: queue.SimpleQueue, beside: bool) -> None:
        """One of the lane's threads: each call in turn, its outcome handed to the awaiter's
        loop; a call whose awaiter was cancelled while it queued is dropped."""
        while (call := calls.get()) is not None:
            self._serve_one(*call, beside=beside)
            # this frame waits in get() until the next call: it must not hold this one's
            # arguments (a step's microbatches, targets, outputs) past the step
            del call

    def _serve_one(self, loop, done, fn, args, hold_s, more_s, beside: bool = False) -> None:
        if done.cancelled():
            return
        try:
            outcome, value = _set_result, self._hold_lane(fn, args, hold_s, more_s, beside)
        except BaseException as e:  # noqa: BLE001 - the awaiter gets it
            outcome, value = _set_exception, e
        try:
            loop.call_soon_threadsafe(outcome, done, value)
        except RuntimeError:  # the loop closed meanwhile: nobody awaits it
            pass

    def _finish(self) -> None:
        """At exit: no new call, and the one running ends first (a thread that returns into
        torch's frames during finalization would abort the process), unless it is stuck."""
        self.close()
        if not self.stuck:
            for thread in (self._thread, self._beside_thread):
                if thread is not None:
                    thread.join()

    def abandon(self) -> None:
        """Nobody waits for the lane's work any more: emulated time held now or later ends at
        once. A real computation in the thread runs to its end (Python cannot interrupt it); its
        result is dropped."""
        self._abandoned.set()

    @property
    def last_task_done(self) -> None:
        """None: on CPU a task's results exist when ``run`` returns (see CudaComputeLane)."""
        return None

    def close(self) -> None:
        """Refuse new calls; calls already submitted still run, without blocking the caller."""
        if not self._closed:
            self._closed = True
            self._calls.put(None)
            self._beside.put(None)

    # On CPU every call has finished when ``run`` returns: there is nothing to drain or order.
    async def drain(self) -> None:
        """Wait until every call made so far has finished (they have)."""

    def follow_caller(self) -> None:
        """Later lane work runs after the caller's work so far (e.g. the optimizer step)."""

    def caller_waits(self) -> None:
        """The caller's later work runs after the lane's work so far."""

    def stream_context(self) -> contextlib.AbstractContextManager:
        """Work issued inside runs in the lane's order (its stream on GPU)."""
        return contextlib.nullcontext()

    async def __aenter__(self) -> ComputeLane:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _hold_lane(
        self,
        fn: Callable[..., Any],
        args: tuple,
        hold_s: float,
        more_s: Callable[[], float] | None = None,
        beside: bool = False,
    ) -> Any:
        with self._device:
            start, began = time.perf_counter(), time.time()
            try:
                result = fn(*args)
                if beside:
                    self.last_beside_call = (began, time.time())
                    self.tasks_beside += 1
                else:
                    self.last_call = (began, time.time())
                if more_s is not None:
                    hold_s += more_s()
                remaining = start + hold_s - time.perf_counter()
                if remaining > 0:
                    self._abandoned.wait(remaining)
                return result
            finally:
                # Only the thread holding the device writes these; readers on the loop see a
                # slightly stale value at worst.
                self.busy_s += time.perf_counter() - start
                self.tasks_run += 1


class CudaComputeLane:
    """A CUDA stream as the compute lane; completion comes from the loop's poller.

    ``fn`` runs on the loop thread with ``self.stream`` current, so it only
    enqueues kernels. ``await run(...)`` returns as soon as at most
    ``max_ahead`` earlier tasks are still unfinished on the device (default
    1): the next decided task is enqueued behind the running one, so the GPU
    does not idle while the loop decides. What a task returns is then a value
    the stream will produce: later work on this stream, and NCCL sends that
    wait on an event recorded after it, see it in order. ``drain()`` waits for
    everything enqueued; ``max_ahead = 0`` waits for each task. A task's
    completion reaches the loop through a ``torch.cuda.Event`` the
    :class:`CompletionPoller` watches (docs/design.md, fact 2).

    Emulated time is a ``torch.cuda._sleep`` spin enqueued after ``fn``'s
    kernels, calibrated once per lane: unlike the CPU lane it adds to the real
    kernel time rather than padding up to it, because the CPU cannot know the
    kernels' duration when it enqueues them. ``gaps_s`` records the device's
    idle time between consecutive tasks, ``task_s`` each task's device time,
    ``enqueue_s`` the host time spent issuing them.
    """

    emulates_on_host = False  # emulated time is a spin on the stream, not the host's

    def __init__(
        self,
        poller: CompletionPoller,
        device: Any,
        unit_s: float = 0.0,
        name: str = "compute",
        max_ahead: int = 1,
        torch_module: Any = None,
    ) -> None:
        torch = torch_module
        if torch is None:
            import torch
        if not torch.cuda.is_available():
            raise RuntimeError("CudaComputeLane needs CUDA; use ComputeLane on CPU")
        self._torch = torch
        self.poller = poller
        self.device = torch.device(device)
        self.unit_s = unit_s
        self.name = name
        self.max_ahead = max_ahead
        self.busy_s = 0.0  # GPU time between start and end events of each finished call
        self.enqueue_s = (
            0.0  # host time spent issuing calls (fn included): what the device must not wait for
        )
        self.tasks_run = 0
        self.gaps_s: list[float] = []
        self.task_s: list[float] = []  # each finished call's device time, in order
        self.stream = torch.cuda.Stream(device=self.device)
        self._pending: collections.deque = (
            collections.deque()
        )  # (started, finished) events, oldest first
        self._last_finished = None  # the finished event of the last task retired
        self._last_enqueued = None  # the finished event of the last task enqueued
        self._sleep_cycles_per_s = self._calibrate_sleep() if unit_s > 0 else 0.0

    async def run(
        self, fn: Callable[..., Any], *args: Any, units: float = 0.0, hold_s: float = 0.0
    ) -> Any:
        """Enqueue ``fn(*args)`` and ``units * unit_s + hold_s`` seconds of spin on the lane's
        stream."""
        torch = self._torch
        if hold_s > 0 and not self._sleep_cycles_per_s:
            self._sleep_cycles_per_s = self._calibrate_sleep()
        issued = time.perf_counter()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            started = torch.cuda.Event(enable_timing=True)
            finished = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
            result = fn(*args)
            cycles = int((units * self.unit_s + hold_s) * self._sleep_cycles_per_s)
            if cycles > 0:
                torch.cuda._sleep(cycles)
            finished.record(self.stream)
        self.enqueue_s += time.perf_counter() - issued
        self._pending.append((started, finished))
        self._last_enqueued = finished
        while len(self._pending) > self.max_ahead:
            await self._retire_oldest()
        return result

    @property
    def last_task_done(self):
        """The event the last task enqueued ends with, recorded right after its kernels.

        What gates a message that task produced: an event recorded on the
        stream later (say when the send coroutine runs) would also cover every
        task enqueued meanwhile, and the message would wait for them
        (docs/gpu.md, "Sends on time"). Read it when ``run`` returns, before
        anything else is enqueued on the lane."""
        return self._last_enqueued

    async def drain(self) -> None:
        """Wait until every task enqueued so far has finished on the device."""
        while self._pending:
            await self._retire_oldest()

    async def _retire_oldest(self) -> None:
        started, finished = self._pending[0]
        await self.poller.watch(finished)
        self._pending.popleft()
        self.task_s.append(started.elapsed_time(finished) / 1e3)
        self.busy_s += self.task_s[-1]
        if self._last_finished is not None:
            self.gaps_s.append(max(0.0, self._last_finished.elapsed_time(started) / 1e3))
        self._last_finished = finished
        self.tasks_run += 1

    def close(self) -> None:
        """Nothing to release: kernels already enqueued finish on their own."""

    def abandon(self) -> None:
        """Nobody waits for the stream any more. Kernels already enqueued (a spin included) cannot
        be recalled; they run on, and only work that waits on this stream waits for them."""

    def follow_caller(self) -> None:
        """The lane's stream waits (device side) for the caller's current stream."""
        self.stream.wait_stream(self._torch.cuda.current_stream(self.device))

    def caller_waits(self) -> None:
        """The caller's current stream waits (device side) for the lane's stream."""
        self._torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def stream_context(self) -> contextlib.AbstractContextManager:
        return self._torch.cuda.stream(self.stream)

    async def __aenter__(self) -> CudaComputeLane:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _calibrate_sleep(self) -> float:
        """Clock cycles per second of ``torch.cuda._sleep`` on this device (blocking, start-up
        only): the shortest of three probes, since a host stall between enqueuing a probe's start
        event and its kernel (the device idle meanwhile) lengthens that probe and never shortens
        it, and one lengthened probe would make every emulated time short."""
        torch = self._torch
        probe_cycles = 20_000_000
        probes = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(probe_cycles // 10)  # warm-up
            for _ in range(3):
                started = torch.cuda.Event(enable_timing=True)
                finished = torch.cuda.Event(enable_timing=True)
                started.record(self.stream)
                torch.cuda._sleep(probe_cycles)
                finished.record(self.stream)
                probes.append((started, finished))
        probes[-1][1].synchronize()
        shortest_ms = min(started.elapsed_time(finished) for started, finished in probes)
        cycles_per_s = probe_cycles / (shortest_ms / 1e3)
        logger.info(
            "lane %s: torch.cuda._sleep runs %.3g cycles/s on %s",
            self.name,
            cycles_per_s,
            self.device,
        )
        return cycles_per_s


def _set_result(done: asyncio.Future, value: Any) -> None:
    if not done.done():
        done.set_result(value)


def _set_exception(done: asyncio.Future, error: BaseException) -> None:
    if not done.done():
        done.set_exception(error)


def make_lane(
    device: Any = "cpu",
    unit_s: float = 0.0,
    poller: CompletionPoller | None = None,
    name: str = "compute",
    torch_module: Any = None,
) -> ComputeLane | CudaComputeLane:
    """The lane for ``device``: a CUDA stream for a CUDA device, a compute thread otherwise.
    ``torch_module``: what the CUDA lane calls torch (tests pass a fake device)."""
    if device is None or not str(device).startswith("cuda"):
        return ComputeLane(unit_s, name=name)
    if poller is None:
        raise ValueError("a CUDA lane needs the loop's CompletionPoller")
    return CudaComputeLane(poller, device, unit_s, name=name, torch_module=torch_module)
