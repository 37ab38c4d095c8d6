"""Start real gloo process groups from a test: forkserver children, a free
loopback port, results through a queue, and a deadline so a hang fails fast."""

from __future__ import annotations

import atexit
import gc
import multiprocessing.context
import multiprocessing.popen_forkserver
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import forkserver, resource_tracker
from multiprocessing.connection import wait
from pathlib import Path
from unittest import mock

from harness import ROOT
from harness.launch import child_env, rank_vars

# a generator of its own: a test that seeds the global one (hypothesis does) would have every test
# process pick the same ports
_PORTS = random.Random()


def free_port() -> int:
    """A port nothing listens on now, for a job's rendezvous store, picked below the kernel's
    ephemeral range: every outbound connection and every socket gloo binds to port 0 takes a port
    from that range, so a port picked there can be taken by another test's ranks before this
    job's rank 0 binds it (EADDRINUSE at start-up)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = _PORTS.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


# start-up's own bound in a test whose subject comes after it: on a loaded two-core machine a
# rank's store client has taken over 2 s to be accepted, and a start-up group over 2 s to form
START_S = 30.0


def started_waits(timeout_s: float, **waits: float):
    """The waits of a test of what follows start-up: ``timeout_s`` and ``waits`` for the run,
    connecting to the store and forming the groups bounded apart by START_S. With the heartbeat
    on, ``process_group_s`` bounds nothing past start-up (every group's collectives take the
    beat's bound), so only tests with the heartbeat on may use it."""
    from rrfp.pipeline.timeouts import Timeouts

    return Timeouts.derive(timeout_s, store_connect_s=START_S, process_group_s=START_S, **waits)


def script_ranks(
    script: Path, *args: str, world: int = 2, timeout: float = 90, **extra: str
) -> list[tuple[int, str, str]]:
    """Run ``python SCRIPT ARGS`` as the ``world`` ranks of one job (torchrun's variables, a fresh
    store port, ``extra`` in their environment): each rank's (exit code, stdout, stderr). A rank
    still running after ``timeout`` seconds kills them all and fails the test as a hang."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=child_env(rank, world, port, PYTHONPATH=str(ROOT), **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    out = []
    for p in procs:
        try:
            stdout, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{script.name} {' '.join(args)}: a rank hung") from None
        out.append((p.returncode, stdout, err))
    return out


def freeze_inherited_heap() -> None:
    """Leave what a forkserver child inherited (torch, dynamo, rrfp: some 400,000 objects) out of
    its garbage collections. A full collection walks every tracked object and writes to each one's
    header, so in a fork it also copies the pages it shares with the server: about 0.3 CPU-s a
    collection, as much as a short rank's whole run. Freezing takes no time, and what the child
    makes is still collected."""
    gc.freeze()


START_TOGETHER_S = 60.0  # how long a rank waits for the job's others to be forked


def _child(fn, rank, world, port, args, queue, started):
    freeze_inherited_heap()
    os.environ.update(rank_vars(rank, world, port), OMP_NUM_THREADS="1")
    try:
        import torch

        torch.set_num_threads(1)
        # the job's ranks call ``fn`` together: forked one after the other on a loaded machine,
        # they can be seconds apart, which a start-up bounded by a test's short timeout_s counts.
        # A file each in the job's folder (a multiprocessing.Barrier's semaphore does not reach a
        # child of the session's shared forkserver)
        Path(started, str(rank)).touch()
        end = time.monotonic() + START_TOGETHER_S
        while len(os.listdir(started)) < world and time.monotonic() < end:
            time.sleep(0.01)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


class _Popen(multiprocessing.popen_forkserver.Popen):
    """A forkserver child's handle whose exit status is read once, however many threads ask. The
    server writes the status once into a pipe, and ``Popen.poll`` (multiprocessing's
    popen_forkserver.py) reads it without a lock; ``Process.start`` polls every child this process
    started (``_cleanup`` in process.py). A test that starts jobs from several threads (the
    fault matrix's rows) then had two readers of one status: the second read the pipe's end and
    recorded the exit code 255."""

    def __init__(self, process_obj) -> None:
        self._read = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            if not wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            with self._read:  # ready: the status or the pipe's end, for one reader
                return super().poll(os.WNOHANG)
        return self.returncode


class _RankProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(multiprocessing.context.ForkServerContext):
    Process = _RankProcess


_CONTEXT = None
# the address of the session's forkserver, which pytest-xdist's controller starts for its workers
SERVER_ENV = "RRFP_TEST_FORKSERVER"
_JOINED: list[int] = []


def _context():
    """One forkserver for the session, with torch and rrfp imported once: each rank starts as a
    fork of it instead of importing torch afresh (about 2 s of CPU per rank on this machine).
    The server starts no threads before it forks, which is what makes forking torch safe.
    Besides rrfp's modules it imports what rrfp imports only on use but nearly every rank uses:
    torch's dynamo (the first torch optimizer built imports it, with DTensor and FSDP), DCP.
    Under `make test` the server is the one pytest-xdist's controller started
    (``start_session_forkserver``), shared by the workers; a run without workers starts its own.

    The server loads torch with one OpenMP thread, as a launched rank does (OMP_NUM_THREADS=1):
    OpenMP reads the count once, when torch loads, and a fork's ``torch.set_num_threads(1)`` does
    not make up for it. Started with the machine's count, the server's ranks spent several times
    the CPU that ranks with one thread spend, though each called ``torch.set_num_threads(1)``
    first (examples/embedded_driver.py on 2 ranks: 10.3 CPU-s against 2.0)."""
    global _CONTEXT
    if _CONTEXT is None:
        context = _Context()
        address = os.environ.get(SERVER_ENV)
        if not (address and _join(address)):
            context.set_forkserver_preload(PRELOAD)
            with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):
                forkserver.ensure_running()  # its environment is this process's, now
        _CONTEXT = context
    return _CONTEXT


def start_session_forkserver() -> None:
    """Start the session's forkserver in pytest-xdist's controller, before its workers, and tell
    them where it listens: each worker then forks its ranks from it instead of starting and
    preloading a server of its own (about 6 CPU-s each). The controller outlives the workers,
    so the server does too. A server's child takes its working directory and ``sys.path`` from the
    process that asked for it; its environment is the server's, which the rank functions and the
    harness's children set for themselves. Its output goes nowhere, not to `make test`'s
    terminal: a test that reads what a rank prints has it write a file. Where the workers could
    not join it (``_shareable``), none is started here."""
    if not _shareable():
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    quiet = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        _context()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, quiet):
            os.close(fd)
    os.environ[SERVER_ENV] = forkserver._forkserver._forkserver_address


def _shareable() -> bool:
    """Whether this interpreter's ``ForkServer`` (multiprocessing/forkserver.py) is the one a
    server shared between processes relies on: it connects to ``_forkserver_address``, and later
    versions authenticate each request with a key only the starting process holds."""
    server = forkserver._forkserver
    return hasattr(server, "_forkserver_address") and not hasattr(server, "_forkserver_authkey")


def _join(address: str) -> bool:
    """Send this process's forkserver requests to the server at ``address``, which another
    process started: ``ForkServer`` checks first that the server it started is alive, which only
    its parent can, so that check is left out. False where the server cannot be shared
    (``_shareable``): then this process starts its own."""
    if not _shareable():
        return False
    server = forkserver._forkserver
    # Each request also hands the server the write end of an "alive" pipe for the child; the
    # server's own liveness is the controller's pipe. This one is only kept open.
    _JOINED.extend(os.pipe())
    server._forkserver_address = address
    server._forkserver_alive_fd = _JOINED[1]
    server.ensure_running = resource_tracker.ensure_running
    return True


PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "rrfp.pipeline.runtime",
    "rrfp.app.cli.main",
    "rrfp.app.train.training",
    "rrfp.models.gpt",
    # the HF tests' ranks build transformers' Llama and Qwen3 (about 2 CPU-s of imports a rank);
    # without the hf extra these are skipped (the server ignores a preload it cannot import)
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    # a rank's function comes from its test's module, which a rank imports to unpickle it, and a
    # test module imports pytest (about 0.13 CPU-s, half a short fault row's rank), some hypothesis
    "pytest",
    "hypothesis",
    # what a rank of `rrfp train` imports as it runs: its metrics' TensorBoard writer (rank 0, about
    # 0.09 CPU-s), the Llama family's models, the start-up checks, the loop's uvloop
    "torch.utils.tensorboard",
    "rrfp.models.llama",
    "rrfp.app.train.start_checks",
    "uvloop",
    # the VLM ranks' models (test_vlm's, test_vit_vlm's): about 0.02 CPU-s a rank
    "rrfp.models.vit_vlm",
    # the drop-in's ranks and the torch schedules they are compared with (about 0.12 CPU-s a rank)
    "torch.distributed.pipelining",
    "rrfp.pipelining",
]


def start_ranks(fn, world: int, args: tuple) -> tuple[list, object]:
    """``fn(rank, world, *args)`` started in ``world`` forkserver children of one job (a fresh
    store port), which call it together: (their processes, the queue each reports on as
    ``(rank, "ok" or "error", result or traceback)``)."""
    ctx = _context()
    queue, port, started = ctx.Queue(), free_port(), tempfile.mkdtemp(prefix="rrfp-job-")
    atexit.register(shutil.rmtree, started, True)
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, args, queue, started), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs, queue


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> dict[int, object]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return {rank: result}.
    Raises AssertionError with the child's traceback, or on timeout. The ranks are forkserver
    children, whose stderr is the server's, not the test's: a test that reads what a rank prints
    has it write a file."""
    procs, queue = start_ranks(fn, world, args)
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    ok = False
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world and not errors:
            got = next_report(queue, procs, results.keys())
            if got is None:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ranks {sorted(set(range(world)) - results.keys())} "
                        f"did not finish within {timeout} s"
                    )
                continue
            rank, status, value = got
            (results if status == "ok" else errors)[rank] = value
        ok = not errors
    finally:
        for p in procs:
            p.join(timeout=5 if ok else 0)  # a failed job's other ranks may wait in a collective
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        rank, tb = next(iter(errors.items()))
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return results


def died(rank: int, exitcode: int) -> str:
    """The line for a rank whose process ended before it reported: its exit code, or the signal
    that ended it (an OOM kill is SIGKILL, a C-level abort SIGABRT)."""
    how = (
        f"was ended by {signal.Signals(-exitcode).name}"
        if exitcode < 0
        else f"exited with code {exitcode}"
    )
    return f"rank {rank} failed: its process {how} before it reported a result"


def next_report(queue, procs, reported, wait: float = 0.2) -> tuple | None:
    """The next report a rank put on ``queue``, None if there was none within ``wait`` seconds;
    AssertionError at once, naming the rank, if a rank not in ``reported`` has ended without one.
    A report is in the queue's pipe before its sender can end (a process flushes its queues as it
    exits), so the queue is read once more after an end is seen."""
    import queue as q

    try:
        return queue.get(timeout=wait)
    except q.Empty:
        pass
    ended = [
        (r, p.exitcode) for r, p in enumerate(procs) if r not in reported and p.exitcode is not None
    ]
    if not ended:
        return None
    try:
        return queue.get(timeout=wait)
    except q.Empty:
        raise AssertionError(died(*ended[0])) from None


def timed_outcome(main) -> dict:
    """``rrfp.run(main(mark))`` in a rank, where ``main`` calls ``mark()`` as the wait it times
    begins: what the rank was told (``error``: the exception's line, or None) and ``took``, the
    seconds from ``mark()`` to the end."""
    import time

    import rrfp

    began = [time.monotonic()]

    def mark() -> None:
        began[0] = time.monotonic()

    try:
        rrfp.run(main(mark))
    except Exception as e:  # the row's outcome, not a failure of the test's rank
        return {"error": f"{type(e).__name__}: {e}", "took": time.monotonic() - began[0]}
    return {"error": None, "took": time.monotonic() - began[0]}


async def timed_iteration(ex, mark) -> None:
    """One iteration of the stage executor ``ex`` (8 features in and out): two microbatches of
    random rows; ``mark()`` as it begins."""
    import torch

    x = torch.randn(4, 8)
    mark()
    await ex.run_iteration(0, [(x[:2], x[:2]), (x[2:], x[2:])])
