"""Does planning beside the arbiter slow its decisions? Decision latency on 4 CPU ranks.

A benchmark, not a test: run it and read the numbers (they move with the machine's load,
which it prints).
    .venv/bin/python benchmarks/decision_latency.py [--iters 6 --n-microbatches 32 --unit-ms 4]

Each rank runs the tiny GPT's stage with ready dispatch under `lang`, M microbatches, in
emulated time, in three modes:

- `bfw`: no planning;
- `plan`: hint = plan, each iteration planned one ahead in the executor's thread (its own
  4xM plan), as `rrfp train` does;
- `bfw + 8x32 plan/iter`: no plan of its own, but a thread makes one 8x32 plan at the start of
  every iteration: the planner's load at 8x32 (a run of 8 stages), beside this arbiter;
- `bfw + 8x32 nonstop`: the same thread plans 8x32 iterations back to back for the whole run:
  planning that never stops, a stress far beyond what a run does.

Two latencies per decision, over every rank and every iteration after the first:
- policy: the tracker's ``next()`` call, what the executor's ``decision_us`` averages;
- reaction: from the end of a task on the stage's lane (in the lane thread) to the start of
  the next one, when the next one was already decided without waiting for an arrival. It
  holds everything between two tasks: the loop waking (the GIL), finish, next, start, and the
  lane thread waking. It is what a stage loses per task to deciding.
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time

MODES = ("bfw", "plan", "bfw + 8x32 plan/iter", "bfw + 8x32 nonstop")


def _rank(
    rank: int, world: int, port: int, mode: str, iters: int, mb: int, unit_ms: float, queue
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch

    from rrfp import (
        PipelineRuntime,
        SimConfig,
        TrainConfig,
        Variability,
        planned_config,
        run,
    )
    from rrfp.core import StageTracker  # patched below: the arbiter's policy calls are timed

    torch.set_num_threads(1)
    policy: list[float] = []
    idle: list[
        float
    ] = []  # when a policy call found nothing to run: the arbiter then waits for an arrival
    lane: list[
        tuple[float, float]
    ] = []  # (start, end) of every task in the lane thread, time.time()

    next_call = StageTracker.next

    def timed_next(
        self, among=None
    ):  # this process only: time the arbiter's policy calls (the loop's thread)
        if threading.current_thread() is not threading.main_thread():
            return next_call(self, among)
        t0 = time.perf_counter()
        out = next_call(self, among)
        policy.append(time.perf_counter() - t0)
        if out is None:
            idle.append(time.time())
        return out

    StageTracker.next = timed_next

    def time_the_lane(rt) -> None:
        """Wrap the lane's ``run`` so that each task notes, in the lane thread, when it started
        and when its hold of the lane ended. The wrapper sleeps off the emulated time itself, as
        the lane would (then the lane finds none left), so the end it notes is the real one."""
        lane_run = rt.lane.run

        async def timed_run(fn, *args, units=0.0):
            def timed_fn(*a):
                start, t0 = time.time(), time.perf_counter()
                out = fn(*a)
                remaining = t0 + units * rt.unit_s - time.perf_counter()
                if remaining > 0:
                    time.sleep(remaining)
                lane.append((start, time.time()))
                return out

            return await lane_run(timed_fn, *args, units=units)

        rt.lane.run = timed_run

    cfg = TrainConfig.load("configs/gpt-tiny.toml", [f"n_microbatches={mb}"], world_size=world)
    wl = cfg.workload
    stop = threading.Event()
    planned = [0]

    requested = threading.Semaphore(0)

    # 8x32 plans, as a thread beside the arbiter: one per request, or back to back
    def plan_beside():
        k = 0
        while not stop.is_set():
            if "nonstop" not in mode and not requested.acquire(timeout=0.05):
                continue
            planned_config(
                SimConfig(8, 32, "plan", "ready", "2x", Variability.preset("lang"), seed=k)
            )
            k += 1
        planned[0] = k

    async def main():
        async with PipelineRuntime.start(pp=world, backend="gloo", unit_ms=unit_ms) as rt:
            torch.manual_seed(0)
            module = wl.build_stage(cfg.model, rt.stage, rt.num_stages, None)
            time_the_lane(rt)
            ex = rt.stage_executor(
                module,
                wl.loss_fn,
                n_microbatches=mb,
                hint="plan" if mode == "plan" else "bfw",
                budget="2x",
                variability=Variability.preset("lang"),
                seed=0,
            )
            beside = threading.Thread(target=plan_beside, daemon=True) if "8x32" in mode else None
            if beside is not None:
                beside.start()
            data = [wl.batches(cfg.data, it, mb) for it in range(iters)]
            feats = [[wl.features(b) for b in batches] for batches in data]
            ex.prepare(0, feats[0])
            marks = []
            for it in range(iters):
                if it + 1 < iters:
                    ex.prepare(it + 1, feats[it + 1])
                marks.append((time.time(), len(policy)))
                requested.release()  # bfw + 8x32 plan/iter: this iteration's plan, beside it
                await ex.run_iteration(it, data[it], feats[it])
                module.zero_grad(set_to_none=True)
            stop.set()
            if beside is not None:
                beside.join()
            return marks

    marks = run(main())
    t1, p1 = marks[1]  # the first iteration warms up
    ordered = sorted(x for x in lane if x[0] >= t1)
    idle.sort()
    reaction = []
    for (_, end), (start, _) in zip(ordered, ordered[1:]):
        waited = bisect.bisect_left(idle, end) < bisect.bisect_right(idle, start)
        if not waited:  # decided without waiting for an arrival
            reaction.append(start - end)
    queue.put((rank, policy[p1:], reaction, planned[0]))


def measure(mode: str, iters: int, mb: int, unit_ms: float, world: int = 4) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, mode, iters, mb, unit_ms, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    policy = sorted(x for _, pol, _, _ in got for x in pol)
    reaction = sorted(x for _, _, rea, _ in got for x in rea)
    return {"policy": policy, "reaction": reaction, "planned": sum(n for *_, n in got)}


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--iters", type=int, default=6)
    a.add_argument("--n-microbatches", type=int, default=32)
    a.add_argument("--unit-ms", type=float, default=4.0)
    args = a.parse_args()
    print(
        f"4 CPU ranks (gloo), gpt-tiny, M={args.n_microbatches}, ready dispatch, lang, "
        f"{args.unit_ms:g} ms units, {args.iters} iterations (the first not counted); "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'mode':<22} {'decisions':>9} {'policy p50':>11} {'p99':>8} "
        f"{'reaction p50':>13} {'p99':>8}  µs"
    )
    for mode in MODES:
        r = measure(mode, args.iters, args.n_microbatches, args.unit_ms)
        pol, rea = r["policy"], r["reaction"]
        extra = f"  ({r['planned']} 8x32 plans made beside, over 4 ranks)" if r["planned"] else ""
        print(
            f"{mode:<22} {len(pol):>9} {1e6 * statistics.median(pol):>11.1f} "
            f"{1e6 * pct(pol, 0.99):>8.1f} {1e6 * statistics.median(rea):>13.1f} "
            f"{1e6 * pct(rea, 0.99):>8.1f}{extra}",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
