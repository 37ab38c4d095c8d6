"""Gloo ranks started once per world size and reused across tests, in the manner of torch's
MultiProcContinuousTest: each test sends its function to ranks that are already running instead
of starting its own. A rank does not keep a process group between functions (rrfp's runtime
starts and ends its own), only the process, its imports and its warmed-up torch.

A function runs in a rank as under ``run_ranks``: ``fn(rank, world, *args)`` with the launcher's
variables set for a fresh port. What it changes of the process (environment, default dtype,
thread count, logging handlers) is put back after it, and a process group it left open is
ended, as the rank's exit would. A rank that fails, hangs past the timeout, or leaves a thread
running ends the pool: the test fails with the rank's traceback, and the next test starts
fresh ranks.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback

from harness.distributed import _context, free_port, next_report
from harness.launch import rank_vars


def _loggers() -> dict[str, list]:
    found = {"": list(logging.getLogger().handlers)}
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            found[name] = list(lg.handlers)
    return found


def _restore_loggers(saved: dict[str, list]) -> None:
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            lg.handlers[:] = saved.get(name, [])
    logging.getLogger().handlers[:] = saved[""]


def _serve(rank: int, world: int, tasks, results) -> None:
    """A rank's loop: run each function sent to it, report, and put the process back as it was."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    parent = multiprocessing.parent_process()
    while True:
        try:
            job = tasks.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # the test process is gone
                return
            continue
        if job is None:
            return
        fn, args, port = job
        env, dtype, loggers = dict(os.environ), torch.get_default_dtype(), _loggers()
        threads = set(threading.enumerate())
        os.environ.update(rank_vars(rank, world, port), OMP_NUM_THREADS="1")
        try:
            value = fn(rank, world, *args)
        except BaseException:
            results.put((rank, "error", traceback.format_exc(), True))
            return
        if dist.is_initialized():  # a rank's process would end it by exiting
            dist.destroy_process_group()
        left = []
        for t in threading.enumerate():
            if t not in threads:
                t.join(timeout=2)  # a runtime's threads end when it closes, some just after
                if t.is_alive():
                    left.append(t.name)
        os.environ.clear()
        os.environ.update(env)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        _restore_loggers(loggers)
        results.put((rank, "ok", value, bool(left)))
        if left:  # not reusable: the pool ends after this function, the rank with it
            return


class RankPool:
    """``world`` ranks, started at once, each waiting for functions to run."""

    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        for q in (self.results, *self.tasks):  # the test process never waits on a queue to exit
            q.cancel_join_thread()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float) -> dict[int, object]:
        """``fn(rank, world, *args)`` on every rank; {rank: result}. AssertionError with the
        failed rank's traceback, or naming the ranks that did not finish within ``timeout``."""
        port = free_port()
        for q in self.tasks:
            q.put((fn, args, port))
        results, errors, retire = {}, {}, False
        deadline = time.monotonic() + timeout
        try:
            while len(results) < self.world and not errors:
                got = next_report(self.results, self.procs, results.keys())
                if got is None:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(self.world)) - results.keys())
                        raise AssertionError(f"ranks {missing} did not finish within {timeout} s")
                    continue
                rank, status, value, done = got
                (results if status == "ok" else errors)[rank] = value
                retire |= done
        except BaseException:
            self.close(grace=0)  # what is left of the ranks may wait in a collective for good
            raise
        if errors or retire:
            self.close(grace=0 if errors else 5)
        if errors:
            rank, tb = next(iter(errors.items()))
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        return results

    def close(self, grace: float = 5) -> None:
        """Ask the ranks to leave; kill what has not left within ``grace`` seconds."""
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if _POOLS.get(self.world) is self:
            del _POOLS[self.world]


_POOLS: dict[int, RankPool] = {}


def run_shared(fn, world: int, *args, timeout: float = 120.0) -> dict[int, object]:
    """``run_ranks`` on ranks shared with the other tests of this test process: the pool of
    ``world`` ranks, started if there is none (or the last one ended)."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[world] = RankPool(world)
    return pool.run(fn, *args, timeout=timeout)


@atexit.register
def close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
