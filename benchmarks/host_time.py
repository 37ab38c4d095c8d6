"""Host time per task, in its parts: the hand-off to the compute lane and back, a message's
encoding and its two gloo operations, and the decision.

A benchmark, not a test: run it and read the numbers (they move with the machine's load, which
it prints).
    .venv/bin/python benchmarks/host_time.py [--reps 2000 --task-ms 7 --tokens 512 --width 192]

- lane: ``ComputeLane.run`` on the event loop (uvloop), as the executor calls it with nothing
  emulated. "to lane" runs from the call to the task's first line in the lane thread, "from
  lane" from its last line to the awaiter resuming; both for a no-op task and for a task that
  computes ``--task-ms`` of matmuls (one torch thread), with the process free to use every core
  and pinned to one (as ``rrfp bench --pin`` pins a rank). "inline" is the same call made on
  the loop's thread, what a task would cost with no lane.
- message: two gloo ranks bounce one activation of ``--tokens`` x ``--width`` float32 back and
  forth: as rrfp's channel sends it (a header of 80 int64 words, about rrfp's, then the payload:
  two operations each way) and as one operation of the same bytes (header and payload packed in
  one buffer, the copy included), per one-way message.
- decision: ``StageTracker.next`` under BFW, what ready dispatch spends choosing a task.

- ``--parts``: where "from lane" goes, the same call stamped at the task's last line, once the
  lane's bookkeeping is done (``_hold_lane`` returned), when the loop runs the callback that
  sets the result, and when the awaiter resumes; the lane as it is (``call_soon_threadsafe``)
  alternates in one process with a candidate that signals by ``os.write`` to a pipe the loop
  reads (``add_reader``; the write releases the GIL), and with one whose future resumes its
  awaiter inside that callback instead of one loop iteration later ("handback").

On real compute, ``rrfp bench --real`` reports the same parts per task, measured on the run's
traces (decide, to lane, from lane, after): this script isolates them from a pipeline's waits.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import multiprocessing as mp
import os
import statistics
import time

import torch

HEADER_WORDS = 80  # about the size of rrfp's message header


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _us(xs: list[float]) -> str:
    return f"{1e6 * statistics.median(xs):8.1f} {1e6 * _q(xs, 0.9):8.1f}"


def _matmuls(task_s: float):
    """A task of about ``task_s`` seconds of real compute."""
    a = torch.randn(192, 192)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    per = 0.2 / n
    reps = max(1, round(task_s / per))

    def task():
        for _ in range(reps):
            a @ a

    return task


def lane_handoff(reps: int, task_s: float, pinned: bool) -> dict[str, list[float]]:
    import uvloop

    from rrfp.loop import ComputeLane

    if pinned:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    out: dict[str, list[float]] = {}

    async def main() -> None:
        lane = ComputeLane(0.0)
        for label, work in (("no-op", lambda: None), (f"{1e3 * task_s:g} ms", _matmuls(task_s))):
            marks: list[float] = []

            def fn(work=work, marks=marks) -> None:
                marks.append(time.perf_counter())
                work()
                marks.append(time.perf_counter())

            await lane.run(fn)
            to, back, inline = [], [], []
            n = reps if label == "no-op" else max(20, reps // 20)
            for _ in range(n):
                marks.clear()
                t0 = time.perf_counter()
                await lane.run(fn)
                t1 = time.perf_counter()
                to.append(marks[0] - t0)
                back.append(t1 - marks[1])
            for _ in range(n):
                marks.clear()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                inline.append((marks[0] - t0) + (t1 - marks[1]))
            out[f"{label}: to lane"] = to
            out[f"{label}: from lane"] = back
            out[f"{label}: inline, both ways"] = inline
        lane.close()

    uvloop.run(main())
    return out


class _Handback(asyncio.Future):
    """A future whose awaiter resumes inside ``resolve`` (the candidate "handback")."""

    _waiters: tuple = ()

    def add_done_callback(self, fn, *, context=None) -> None:  # type: ignore[override]
        if self.done():
            super().add_done_callback(fn, context=context)
        else:
            self._waiters = (*self._waiters, (fn, context))

    def resolve(self, outcome, value) -> None:
        if self.done():
            return
        outcome(self, value)
        waiters, self._waiters = self._waiters, ()
        for fn, ctx in waiters:
            if ctx is None:
                fn(self)
            else:
                ctx.run(fn, self)

    def cancel(self, msg=None) -> bool:
        if not super().cancel(msg):
            return False
        waiters, self._waiters = self._waiters, ()
        for fn, ctx in waiters:
            self.get_loop().call_soon(fn, self, context=ctx)
        return True


def _set_result(done: asyncio.Future, value) -> None:
    if not done.done():
        done.set_result(value)


def _set_exception(done: asyncio.Future, error: BaseException) -> None:
    if not done.done():
        done.set_exception(error)


def handoff_parts(reps: int, task_s: float, pinned: bool) -> dict[str, list[float]]:
    """ "from lane" in stamped parts, three ways of handing the result back alternating."""
    import uvloop

    from rrfp.loop import ComputeLane

    if pinned:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    stamps: dict[str, float] = {}
    mode = ["as is"]
    modes = ("as is", "pipe", "handback")
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    ready: collections.deque = collections.deque()

    def on_readable() -> None:
        stamps["callback"] = time.perf_counter()
        with contextlib.suppress(BlockingIOError):
            os.read(r, 4096)
        while ready:
            outcome, done, value = ready.popleft()
            outcome(done, value)

    class Lane(ComputeLane):
        async def _submit(self, calls, fn, args, hold_s, more_s):
            loop = self._loop = asyncio.get_running_loop()
            done = _Handback(loop=loop) if mode[0] == "handback" else loop.create_future()
            calls.put((loop, done, fn, args, hold_s, more_s))
            return await done

        def _serve_one(self, loop, done, fn, args, hold_s, more_s, beside=False) -> None:
            try:
                outcome, value = _set_result, self._hold_lane(fn, args, hold_s, more_s)
            except BaseException as e:  # noqa: BLE001
                outcome, value = _set_exception, e
            stamps["held"] = time.perf_counter()
            if mode[0] == "pipe":
                ready.append((outcome, done, value))
                os.write(w, b"\0")
            elif mode[0] == "handback":
                loop.call_soon_threadsafe(_stamped, done.resolve, outcome, value)
            else:
                loop.call_soon_threadsafe(_stamped, outcome, done, value)

    def _stamped(f, *a) -> None:
        stamps["callback"] = time.perf_counter()
        f(*a)

    out: dict[str, list[float]] = {}

    async def main() -> None:
        asyncio.get_running_loop().add_reader(r, on_readable)
        lane = Lane(0.0)
        for label, work in (("no-op", lambda: None), (f"{1e3 * task_s:g} ms", _matmuls(task_s))):

            def fn(work=work) -> None:
                work()
                stamps["last"] = time.perf_counter()

            await lane.run(fn)
            n = reps if label == "no-op" else max(20, reps // 20)
            for i in range(n * len(modes)):
                mode[0] = modes[(i + i // len(modes)) % len(modes)]  # each first in turn
                stamps.clear()
                await lane.run(fn)
                t1 = time.perf_counter()
                parts = {
                    "last line to bookkeeping done": stamps["held"] - stamps["last"],
                    "bookkeeping done to loop callback": stamps["callback"] - stamps["held"],
                    "loop callback to awaiter": t1 - stamps["callback"],
                    "from lane, in all": t1 - stamps["last"],
                }
                for part, x in parts.items():
                    out.setdefault(f"{label}, {mode[0]}: {part}", []).append(x)
        lane.close()

    uvloop.run(main())
    return out


def _bounce(rank: int, port: int, reps: int, tokens: int, width: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    x = torch.randn(tokens, width)
    header = torch.arange(HEADER_WORDS, dtype=torch.int64)
    packed = torch.empty(HEADER_WORDS * 8 + x.numel() * 4, dtype=torch.uint8)
    header_buf, payload_buf = torch.empty_like(header), torch.empty_like(x)

    def two_ops(sending: bool) -> None:
        if sending:
            dist.send(header, peer)
            dist.send(x, peer)
        else:
            dist.recv(header_buf, peer)
            dist.recv(payload_buf, peer)

    def one_op(sending: bool) -> None:
        if sending:
            packed[: HEADER_WORDS * 8].view(torch.int64).copy_(header)
            packed[HEADER_WORDS * 8 :].view(torch.float32).copy_(x.view(-1))
            dist.send(packed, peer)
        else:
            dist.recv(packed, peer)

    ops = {"header + payload, 2 ops": two_ops, "packed, 1 op": one_op}
    for _ in range(200):  # warm-up: the first few hundred messages of a process run slow
        for op in ops.values():
            op(rank == 0)
            op(rank == 1)
    results = {name: [] for name in ops}
    for i in range(reps):  # the two alternate, each first in turn: the same load on both
        for name in list(ops)[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            ops[name](rank == 0)
            ops[name](rank == 1)
            results[name].append((time.perf_counter() - t0) / 2)  # one message each way
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def message_ops(reps: int, tokens: int, width: int) -> dict[str, list[float]]:
    import socket

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_bounce, args=(r, port, reps, tokens, width, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    got = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return got


def decision(reps: int, S: int = 2, M: int = 8) -> list[float]:
    from rrfp.core import Budget, Dispatch, Kind, StageTracker, resolve

    times = []
    spec = resolve("bfw").spec(S, 0, M, True, Dispatch.READY, Budget.parse("2x"))
    while len(times) < reps:
        tracker = StageTracker(spec)
        while True:
            t0 = time.perf_counter()
            task = tracker.next()
            times.append(time.perf_counter() - t0)
            if task is None:
                break
            tracker.start(task)
            tracker.finish(task)
            if task.kind is Kind.F:
                tracker.arrive(Kind.B, task.mb)
    return times


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--reps", type=int, default=2000)
    a.add_argument("--task-ms", type=float, default=7.0)
    a.add_argument("--tokens", type=int, default=512, help="rows of the activation sent")
    a.add_argument("--width", type=int, default=192)
    a.add_argument("--parts", action="store_true", help="only the hand-off back, in parts")
    args = a.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}; medians and p90, µs")
    print(f"{'what':<44} {'p50':>8} {'p90':>8}")
    if args.parts:
        for pinned in (False, True):
            with mp.get_context("spawn").Pool(1) as pool:
                got = pool.apply(handoff_parts, (args.reps, args.task_ms / 1e3, pinned))
            for name, xs in got.items():
                print(f"{('pinned' if pinned else 'free') + ', ' + name:<62} {_us(xs)}")
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        return
    for pinned in (False, True):
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            got = pool.apply(lane_handoff, (args.reps, args.task_ms / 1e3, pinned))
        for name, xs in got.items():
            print(f"{'lane, ' + ('pinned' if pinned else 'free') + ', ' + name:<44} {_us(xs)}")
    kib = args.tokens * args.width * 4 / 1024
    for name, xs in message_ops(args.reps, args.tokens, args.width).items():
        print(f"{'message (' + f'{kib:g} KiB), ' + name:<44} {_us(xs)}")
    print(f"{'decision, StageTracker.next (bfw, S 2, M 8)':<44} {_us(decision(args.reps))}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
