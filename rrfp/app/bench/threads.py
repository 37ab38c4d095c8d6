"""CPU time and wake-ups of this process's threads, by role, between two snapshots.

What a rank's host work costs on real compute shows in its threads: the compute lane
should hold the core, and the event loop, the channels' waiter threads and the heartbeat
should wake once per message or completion and otherwise sleep. Linux keeps per thread
its CPU time and its time runnable but waiting for a core (``schedstat``, in ns), its voluntary
context switches (each one a sleep that later woke) and its involuntary ones (the scheduler took
its core for another thread) in ``/proc/self/task/TID/``; elsewhere a snapshot is empty and the
bench reports nothing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TASKS = Path("/proc/self/task")
# thread-name prefixes (rrfp's own threads, torch's schedules' sender threads) -> role
ROLES = (
    ("rrfp-lane-", "lane"),
    ("rrfp-waiter-", "channels"),
    ("rrfp-heartbeat-", "heartbeat"),
    ("rrfp-plan", "planner"),
    ("rrfp-torch-send-", "torch sends"),
    ("rrfp-stage", "loop"),  # ScheduleReady's background loop
)


# the system's names of threads Python did not start (torch names its own) -> role
NATIVE = (
    ("gloo_tcp", "gloo"),  # gloo's transport loop: its sockets' reads and writes
    ("pt_gloo", "gloo"),  # the process groups' threads (collectives)
    ("pt_tcpstore", "store"),
    ("pt_workerserver", "store"),
)


def role(name: str | None, main: bool, comm: str = "") -> str:
    """The role of a thread with Python name ``name`` (None: a thread Python did not start, named
    ``comm`` by the system: gloo's transport loop, the store's, the OpenMP pool's)."""
    if main:
        return "loop"  # the bench's ranks run their event loop on the main thread
    if name is None:
        return next((r for prefix, r in NATIVE if comm.startswith(prefix)), "other")
    return next((r for prefix, r in ROLES if name.startswith(prefix)), "other")


def _text(path: str) -> bytes:
    """A /proc file's bytes: one open and one read, no text layer (a snapshot reads three files a
    thread, twice a run, on every rank)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 8192)
    finally:
        os.close(fd)


def _count(status: bytes, key: bytes) -> int:
    """The value of the line ``KEY:\tN`` in a /proc status file; 0 where it has none."""
    at = status.find(b"\n" + key + b":")
    if at < 0:
        return 0
    at += len(key) + 2
    end = status.find(b"\n", at)
    return int(status[at : end if end >= 0 else None])


def _read(tid: str) -> tuple[float, int, int, float] | None:
    """(CPU seconds, voluntary and involuntary context switches, seconds queued for a core) of
    thread ``tid``; None once it has ended."""
    where = f"{TASKS}/{tid}/"
    try:
        cpu, queued = (int(v) / 1e9 for v in _text(where + "schedstat").split()[:2])
        status = _text(where + "status")
    except (OSError, ValueError):
        return None
    return (
        cpu,
        _count(status, b"voluntary_ctxt_switches"),
        _count(status, b"nonvoluntary_ctxt_switches"),
        queued,
    )


def snapshot() -> dict[int, tuple]:
    """Every thread of this process now: native id -> (role, CPU seconds, wake-ups,
    preemptions, seconds queued)."""
    if not TASKS.is_dir():
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = {}
    for entry in os.listdir(TASKS):
        got = _read(entry)
        if got is not None:
            tid = int(entry)
            try:
                comm = _text(f"{TASKS}/{entry}/comm").decode(errors="replace").strip()
            except OSError:
                comm = ""
            out[tid] = (role(names.get(tid), tid == main, comm), *got)
    return out


def between(before: dict, after: dict) -> dict[str, list[float]]:
    """By role, [CPU seconds, wake-ups, preemptions, seconds queued] between two snapshots (a
    thread that started meanwhile counts from zero)."""
    out: dict[str, list[float]] = {}
    for tid, (who, *now) in after.items():
        then = before.get(tid, (who, 0.0, 0, 0, 0.0))[1:]
        acc = out.setdefault(who, [0.0, 0, 0, 0.0])
        for i, (a, b) in enumerate(zip(now, then)):
            acc[i] += a - b
    return out
