"""A task's message on real compute: handed to its channel's thread as the task returns (the
executor's ``sends_at_once``, A), or through the stage's sender coroutine a loop turn later (B,
what emulated time does), alternated iteration by iteration in one run of two pinned gloo ranks.

A benchmark, not a test: run it and read the numbers (they move with the machine's load, which
it prints).
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/send_at_once.py [--iters 21 --hint 1f1b
        --dispatch fixed --n-microbatches 8 --width 192]

Both ranks run gpt-tiny (8 layers, ``--width`` wide) at pp 2, each pinned to a core of its own
as ``rrfp bench --pin`` pins them; the first iteration warms up, then A and B alternate, each
first in turn (A B B A ...). Per message (µs, median and p90 over the messages of each mode):

- ``to channel thread``: from the message queued after its task to the channel's thread
  beginning the transport operation (the part A cuts);
- ``transport``: from there to the receiver's channel thread having it whole;
- ``compute end to delivered``: from the producing task's compute end (its lane) to the
  receiver's loop handing the message to its tracker, everything on the message's way.

and per iteration the loop's CPU per task on each rank (µs; thread CPU, which load inflates far
less than wall time) and the iteration's wall time (ms; not evidence under load). Paired: each
A iteration against the B iteration beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time


class _Stamps:
    """What the executor reports of its tasks (``Instrument``'s hooks), kept as plain dicts."""

    def __init__(self) -> None:
        self.tasks: dict[tuple[int, int, str], dict] = {}
        self._detail: dict = {}

    def task_detail(self, stage, iteration, task, detail) -> None:
        self._detail = detail

    def task(self, stage, iteration, task, start, end) -> None:
        row = self.tasks.setdefault((stage, iteration, str(task)), {})
        row.update(self._detail, start=start, end=end)
        self._detail = {}

    def task_sent(self, stage, iteration, task, times) -> None:
        self.tasks.setdefault((stage, iteration, str(task)), {})["sent"] = dict(times)

    def wait(self, *args) -> None:
        pass


def _rank(rank: int, port: int, a: argparse.Namespace, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})  # every thread of the rank, as --pin
    import torch

    from rrfp import PipelineRuntime, TrainConfig, run

    torch.set_num_threads(1)
    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml",
        [f"n_microbatches={a.n_microbatches}", "model.n_layer=8", f"model.n_embd={a.width}"],
        world_size=2,
    )
    wl, stamps = cfg.workload, _Stamps()
    modes: list[tuple[int, bool, float, float]] = []  # iteration, A?, wall s, loop CPU s

    async def main():
        async with PipelineRuntime.start(pp=2, backend="gloo", unit_ms=0) as rt:
            torch.manual_seed(0)
            module = wl.build_stage(cfg.model, rt.stage, rt.num_stages, None)
            ex = rt.stage_executor(
                module,
                wl.loss_fn,
                n_microbatches=a.n_microbatches,
                dispatch=a.dispatch,
                hint=a.hint,
                budget=a.budget,
                instrument=stamps,
            )
            for it in range(a.iters):
                # A B B A A B ...: each first in turn; the warm-up iteration 0 is A
                ex.sends_at_once = it == 0 or ((it - 1) // 2 + (it - 1)) % 2 == 0
                data = wl.batches(cfg.data, it, a.n_microbatches)
                t0, c0 = time.perf_counter(), time.thread_time()
                await ex.run_iteration(it, data)
                modes.append(
                    (it, ex.sends_at_once, time.perf_counter() - t0, time.thread_time() - c0)
                )
                module.zero_grad(set_to_none=True)

    run(main())
    queue.put((rank, modes, stamps.tasks))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(a: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, a, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {rank: (modes, tasks) for rank, modes, tasks in (queue.get(timeout=1800) for _ in procs)}
    for p in procs:
        p.join()
    mode_of = {it: at_once for it, at_once, _, _ in got[0][0]}
    tasks = {key: row for _, ts in got.values() for key, row in ts.items()}
    per: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for (stage, it, name), row in tasks.items():
        if it == 0 or "arrived" not in row:
            continue
        producer = tasks.get((stage - 1 if name[0] == "F" else stage + 1, it, name))
        if producer is None or "sent" not in producer:
            continue
        sent, got_ = producer["sent"], row["arrived"]
        parts = per[mode_of[it]]
        for part, value in (
            ("to channel thread", sent["sent"] - sent["posted"]),
            ("transport", got_["received"] - sent["sent"]),
            ("compute end to delivered", got_["delivered"] - producer["compute"][1]),
        ):
            parts.setdefault(part, []).append(value)
    n_tasks = len(tasks) / max(1, len(mode_of)) / 2  # per rank and iteration
    rows = {True: [], False: []}
    for it, at_once in mode_of.items():
        if it == 0:
            continue
        wall = max(m[2] for r in got.values() for m in r[0] if m[0] == it)
        cpu = statistics.fmean(m[3] for r in got.values() for m in r[0] if m[0] == it)
        rows[at_once].append((it, wall, cpu / n_tasks))
    print(
        f"load average: {os.getloadavg()}; {a.dispatch} {a.hint}, M {a.n_microbatches}, width "
        f"{a.width}, {len(rows[True])} iterations A and {len(rows[False])} B"
    )
    print("\n| per message, µs | A: at once, median (p90) | B: sender coroutine, median (p90) |")
    print("|---|---:|---:|")
    for part in per[True]:
        cells = [
            f"{1e6 * statistics.median(per[m][part]):.0f} ({1e6 * _pct(per[m][part], 0.9):.0f})"
            for m in (True, False)
        ]
        print(f"| {part} | " + " | ".join(cells) + " |")
    print("\n| per iteration | A: median (min..max) | B: median (min..max) |")
    print("|---|---:|---:|")
    for label, i, scale in (("wall ms", 1, 1e3), ("loop CPU µs per task", 2, 1e6)):
        cells = []
        for m in (True, False):
            xs = [r[i] * scale for r in rows[m]]
            cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    b = {it: r for it, *r in rows[False]}
    pairs = [(w / b[it + d][0]) for it, w, _ in rows[True] for d in (1, -1) if it + d in b][::2]
    if pairs:
        print(
            f"\nwall, A over the B beside it: median {statistics.median(pairs):.3f}x "
            f"({min(pairs):.3f}..{max(pairs):.3f}, {len(pairs)} pairs)"
        )


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--iters", type=int, default=21)
    a.add_argument("--n-microbatches", type=int, default=8)
    a.add_argument("--width", type=int, default=192)
    a.add_argument("--dispatch", default="fixed")
    a.add_argument("--hint", default="1f1b")
    a.add_argument("--budget", default="1x")
    measure(a.parse_args())


if __name__ == "__main__":
    main()
