"""A rank's heartbeat written by a process of its own, so that it beats while the rank's
Python holds the GIL in one long C call (a forward in one big kernel, a C extension that does
not release it): a beating thread needs the GIL between two beats, and was then named silent
while its rank computed.

The choice, and why: "alive" is a fact about the process, which the kernel knows and the
interpreter does not need to be free to tell. A forked child (``os.fork``: no second torch
import, so it costs a few milliseconds) beats every ``period_s`` while its parent is there and
not stopped: it reads the parent's state in ``/proc/PID/stat`` and stays silent while it is
``T`` (SIGSTOP) or ``t`` (a debugger), and exits once the parent is gone (its parent pid
changes). A tolerance tied to the task in progress was the other way: it needs the task's
expected length before the first step has measured any, and it lets a rank stopped in a long
task go unnamed for that long. A hang that keeps the process running (a deadlock) still beats:
a stage waiting on it names it once no rank of the job has run a task for ``progress_s``
(rrfp/pipeline/timeouts.py), with the groups' long timeout as the backstop behind.

The child closes every inherited descriptor at once, so a killed rank's sockets close with it
(its peers' gloo reads fail at once); it dies with its parent (PR_SET_PDEATHSIG) and lives in a
process group of its own, so a signal to the rank's group is the rank's alone to act on (the
parent ends the child) and the group empties when the rank ends; it ignores the stop signals,
and never returns into the parent's code: it leaves with ``os._exit``. What the rank is doing
(``doing``) reaches it through a page of shared memory.
"""

from __future__ import annotations

import datetime
import mmap
import os
import signal
import struct
import sys
import time

import torch.distributed as dist

_HEAD = struct.Struct("=QdH")  # version, since (monotonic), length of the activity's bytes
_COUNT = struct.Struct("=Q")  # the child's beats so far, at the page's end: the parent reads it
_SIZE = 512
_COUNT_AT = _SIZE - _COUNT.size
CONNECT_S = 10.0  # how long one try to reach the store may wait (the C++ client logs each miss)


def supported() -> bool:
    """A child can tell its parent's state here (Linux's /proc) and can be forked."""
    return hasattr(os, "fork") and os.path.exists(f"/proc/{os.getpid()}/stat")


class Beater:
    """The child that writes ``SEQ AGE ACTIVITY`` under ``key`` on the store at ``host:port``."""

    def __init__(self, host: str, port: int, key: str, period_s: float, timeout_s: float) -> None:
        self.host, self.port, self.key = host, port, key
        self.period_s, self.timeout_s = period_s, timeout_s
        self._page = mmap.mmap(-1, _SIZE)
        self._version = 0
        self.pid: int | None = None
        self.exit_code: int | None = None  # once ``ended`` has seen the child exit
        self.doing("", time.monotonic())

    def doing(self, what: str, since: float) -> None:
        """What the rank does from ``since`` on; read by the child at its next beat."""
        data = what.encode()[: _COUNT_AT - _HEAD.size]
        self._version += 1
        self._page[_HEAD.size : _HEAD.size + len(data)] = data
        self._page[: _HEAD.size] = _HEAD.pack(self._version, since, len(data))

    def start(self) -> Beater:
        parent = os.getpid()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: beat, and never return into the parent's code
            code = 0
            try:
                self._serve(parent)
            except BaseException:  # noqa: BLE001 - the store went away: the beats stop, as they should
                code = 1
            os._exit(code)
        self.pid = pid
        return self

    def close(self) -> None:
        """End the child (it holds nothing the parent needs) and reap it."""
        pid, self.pid = self.pid, None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    # -- the child ----------------------------------------------------------------

    def _serve(self, parent: int) -> None:
        _die_with_parent()
        os.setpgid(0, 0)  # a group of its own: the rank's group is the rank's, as launchers see it
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        os.closerange(3, _max_fd())  # the parent's sockets close when it dies, not when we do
        store = self._connect(parent)
        seq = 0
        while os.getppid() == parent:
            if _state(parent) not in ("T", "t", "Z", "X", ""):
                seq += 1
                what, since = self._activity()
                store.set(self.key, f"{seq} {time.monotonic() - since:.3f} {what}")
                self._page[_COUNT_AT:] = _COUNT.pack(seq)
            time.sleep(self.period_s)

    def _connect(self, parent: int) -> dist.TCPStore:
        """A client of the store, however long a loaded machine takes to accept it: a child that
        gave up here would leave its rank unheard, and its peers would call a working rank
        silent. Each try waits up to CONNECT_S; the tries end with the parent."""
        while True:
            try:
                return dist.TCPStore(
                    self.host,
                    self.port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=max(CONNECT_S, self.timeout_s)),
                )
            except RuntimeError:  # DistNetworkError: not accepted within the timeout
                if os.getppid() != parent:
                    raise
                time.sleep(self.period_s)

    def beats(self) -> int:
        """How many beats the child has written so far (0 before its first)."""
        return _COUNT.unpack(self._page[_COUNT_AT:])[0]

    def ended(self) -> bool:
        """The child exited on its own (not by ``close``); reaps it then."""
        pid = self.pid
        if pid is None:
            return False
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by close meanwhile
            return False
        if done and self.pid is not None:
            self.exit_code = os.waitstatus_to_exitcode(status)
            return True
        return False

    def _activity(self) -> tuple[str, float]:
        while True:  # the parent may be writing: read until one version is seen whole
            version, since, n = _HEAD.unpack(self._page[: _HEAD.size])
            what = self._page[_HEAD.size : _HEAD.size + n].decode(errors="replace")
            if _HEAD.unpack(self._page[: _HEAD.size])[0] == version:
                return what, since


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, D, T, t, Z, ...); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2 :][:1].decode()


def _die_with_parent() -> None:
    """SIGKILL this child when the thread that forked it ends (Linux's PR_SET_PDEATHSIG), so a
    killed rank leaves nothing behind; the parent-pid check covers the rest."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536
