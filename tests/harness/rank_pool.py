"""Gloo ranks started once per world size and reused across tests, in the manner of torch's
MultiProcContinuousTest: each test sends its function to ranks that are already running instead
of starting its own. A rank does not keep a process group between functions (rrfp's runtime
starts and ends its own), only the process, its imports and its warmed-up torch.

A function runs in a rank as under ``run_ranks``: ``fn(rank, world, *args)`` with the launcher's
variables set for a fresh port. It finds the process as a fresh rank would: what the last one
changed is put back after it (environment, working directory, ``sys.path``, default dtype and
device, thread count, grad mode, deterministic algorithms, signal handlers, loggers' handlers and
levels, warning filters, the event loop policy, the globals of rrfp's and the tests' modules) and
the random generators (torch's, Python's, numpy's) are set back to the state the rank started
with; a process group it left open is ended, as the rank's exit would.
A rank that fails, hangs past the timeout, or leaves a thread or a child process running ends the
pool: the test fails with the rank's traceback, and the next test starts fresh ranks.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from harness import ROOT
from harness.distributed import _context, free_port, next_report
from harness.launch import rank_vars

log = logging.getLogger("harness.rank_pool")


def _all_loggers() -> dict[str, logging.Logger]:
    """Every logger made so far, by name ("": the root)."""
    found = {"": logging.getLogger()}
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):  # not a placeholder of a dotted name's parent
            found[name] = lg
    return found


def _loggers() -> dict[str, tuple]:
    """Each logger's handlers, level, propagation and whether it is disabled."""
    return {
        name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
        for name, lg in _all_loggers().items()
    }


def _restore_loggers(saved: dict[str, tuple]) -> None:
    logging.disable(logging.NOTSET)
    for name, lg in _all_loggers().items():
        handlers, level, lg.propagate, lg.disabled = saved.get(
            name, ([], logging.NOTSET, True, False)
        )
        lg.handlers[:] = handlers
        if lg.level != level:
            lg.setLevel(level)  # and the levels cached from it


# the signals whose handlers a function may set (SIGKILL and SIGSTOP cannot be caught)
SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


class ProcessState:
    """What of the rank's process a function may change and a fresh rank would not have seen."""

    def __init__(self) -> None:
        import torch

        self.env, self.cwd, self.path = dict(os.environ), os.getcwd(), list(sys.path)
        self.dtype, self.device = torch.get_default_dtype(), torch.get_default_device()
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        self.signals = {s: signal.getsignal(s) for s in SIGNALS}
        self.loggers, self.warnings = _loggers(), list(warnings.filters)
        self.loop_policy = asyncio.get_event_loop_policy()
        self.globals = {name: dict(vars(m)) for name, m in _own_modules().items()}
        self.threads = set(threading.enumerate())
        self.children = set(children())
        self.native = _native_threads()

    def restore(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:  # setting it at all adds a torch mode
            torch.set_default_device(None if self.device.type == "cpu" else self.device)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        for s, handler in self.signals.items():
            # None: set outside Python, left as it is
            if handler is not None and signal.getsignal(s) != handler:
                signal.signal(s, handler)
        _restore_loggers(self.loggers)
        warnings.filters[:] = self.warnings
        asyncio.set_event_loop_policy(self.loop_policy)
        for name, saved in self.globals.items():  # a module attribute patched and not put back
            now = vars(sys.modules[name])
            for key in [k for k in now if k not in saved]:
                del now[key]
            for key, value in saved.items():
                if now.get(key, _MISSING) is not value:
                    now[key] = value

    def new_threads(self) -> list[str]:
        return [name for tid, name in _native_threads().items() if tid not in self.native]

    def left_running(self) -> list[str]:
        """The threads and child processes a function started and left running, after giving them
        2 s to end (some of a runtime's end just after it closes); a child that ended is reaped."""
        left = []
        for t in threading.enumerate():
            if t not in self.threads:
                t.join(timeout=2)
                if t.is_alive():
                    left.append(f"thread {t.name}")
        end = time.monotonic() + 2
        for pid in set(children()) - self.children:
            while not _reaped(pid) and time.monotonic() < end:
                time.sleep(0.02)
            if not _reaped(pid):
                left.append(f"process {pid}")
        if not left and self.new_threads():  # held only by garbage, perhaps
            gc.collect()
        if grown := self.new_threads():
            # gloo's transport threads of a group that something still holds: each wakes now
            # and then, and a rank that gathered them over many tests spent CPU while idle
            left.append(f"native threads {', '.join(sorted(set(grown)))}")
        return left


_MISSING = object()


def _import_rrfp() -> None:
    """Every module of rrfp, imported before any function runs (a third of a CPU second): a module
    a function imports first and patches would keep the patch, not being there to put back."""
    import importlib
    import pkgutil

    import rrfp

    for info in pkgutil.walk_packages(rrfp.__path__, "rrfp."):
        if not info.name.endswith("__main__"):
            try:
                importlib.import_module(info.name)
            except ImportError:  # an extra that is not installed (rrfp.titan's torchtitan)
                pass


def _own_modules() -> dict[str, object]:
    """The modules of this repository imported so far (rrfp's, the tests'), whose globals a test
    may patch: a fresh rank would import them unpatched."""
    root, installed = str(ROOT), sys.prefix  # a virtual environment may live in the repository
    return {
        name: m
        for name, m in list(sys.modules.items())
        if (path := getattr(m, "__file__", None) or "").startswith(root)
        and not path.startswith(installed)
    }


def _native_threads() -> dict[int, str]:
    """This process's threads, Python's and those started in C++ (gloo's), by id: their names."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            found[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:  # ended since the listing
            pass
    return found


def children() -> list[int]:
    """This process's children, live or not yet reaped."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone since the listing
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == me:
            found.append(int(stat.parent.name))
    return found


def _reaped(pid: int) -> bool:
    """Reap the child ``pid`` if it has ended; whether it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped already (by the code that started it)
        return True


class Generators:
    """The random generators' state at the rank's start, set back before each function: a test
    that does not seed draws what it would draw in a fresh rank."""

    def __init__(self) -> None:
        import torch

        self.torch, self.python = torch.get_rng_state(), random.getstate()
        self.numpy = _numpy_state()

    def reset(self) -> None:
        import torch

        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


def _numpy_state():
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _serve(rank: int, world: int, tasks, results) -> None:
    """A rank's loop: run each function sent to it, report, and put the process back as it was."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    parent = multiprocessing.parent_process()
    _import_rrfp()
    generators = Generators()
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
        state = ProcessState()
        generators.reset()
        os.environ.update(rank_vars(rank, world, port), OMP_NUM_THREADS="1")
        try:
            value = fn(rank, world, *args)
        except BaseException:
            results.put((rank, "error", traceback.format_exc(), True))
            return
        if dist.is_initialized():  # a rank's process would end it by exiting
            dist.destroy_process_group()
        left = state.left_running()
        state.restore()
        results.put((rank, "ok", value, left))
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
                rank, status, value, left = got
                (results if status == "ok" else errors)[rank] = value
                if left and status == "ok":
                    log.warning("rank %d left %s running: the shared ranks end", rank, left)
                retire |= bool(left)
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
