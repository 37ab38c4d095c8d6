"""Which job owns a checkpoint folder: one job writes into it at a time.

Two jobs given one ``checkpoint.dir`` would write into the same partial folder, and one of them
commit a step holding the other's shards. Rank 0 of a job claims the folder at the run's start
by creating ``DIR/OWNER`` (the job id, host, pid, the process's start, the torchrun run id); a
folder another live job owns is refused in one line naming it, and every save checks the record
is still this job's before it writes and before it commits.

A job id is agreed through torchrun's store (rrfp/app/job/job_agreement.py ``job_id``), so a job
that torchrun restarts (``--max-restarts``, the same store) is the same job and takes its folder
back. A job that ended without releasing its folder (killed, crashed) must not lock it for good:
its record is stale when its process is gone (the same host: its pid is not running, or runs
another process, told by the process's start time) or, from another host, when the record was
not renewed for ``LEASE_S`` (the owner touches it every ``RENEW_S`` from a thread; the hosts'
clocks must agree within the lease). A stale record is replaced, and said so in the log.

Plain files, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("rrfp.app.train.checkpoint_owner")

OWNER = "OWNER"
LEASE_S = 60.0  # a record from another host not renewed for this long is stale
RENEW_S = LEASE_S / 6


class NotOurs(OSError):
    """A checkpoint folder, or a file in it, that another job owns or wrote; the message names it.
    An OSError: the commit that meets it fails as one that meets a full disk does."""


@dataclass(frozen=True)
class Owner:
    """The job that owns a checkpoint folder, and the process that claimed it for the job."""

    job: str
    host: str
    pid: int
    started: float  # when the claim was made (time.time())
    pid_start: str = ""  # the process's start in the kernel's ticks (/proc/PID/stat), if known
    run_id: str = ""  # torchrun's rendezvous id (TORCHELASTIC_RUN_ID), if any

    @classmethod
    def this(cls, job: str) -> Owner:
        pid = os.getpid()
        return cls(
            job=job,
            host=socket.gethostname(),
            pid=pid,
            started=time.time(),
            pid_start=_process_start(pid),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        run = f", torchrun run id {self.run_id}" if self.run_id else ""
        return f"job {self.job} (host {self.host}, pid {self.pid}, started {when}{run})"

    def alive(self, renewed: float) -> bool:
        """Whether the owning job may still write (``renewed``: the record's mtime)."""
        if self.host != socket.gethostname():
            return time.time() - renewed < LEASE_S
        if self.pid == os.getpid():  # an earlier run of this process (embedded), which has ended
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: running
            pass
        return not self.pid_start or _process_start(self.pid) in ("", self.pid_start)


def _process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot ("" where /proc has none):
    tells a pid that was reused from the process that claimed a folder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command's ")"


def read_owner(root: Path) -> tuple[Owner, float] | None:
    """The folder's owner record and its mtime; None when there is none (or it is unreadable:
    a record cut short by a crash is no owner)."""
    path = Path(root) / OWNER
    try:
        raw, renewed = path.read_text(), path.stat().st_mtime
        return Owner(**json.loads(raw)), renewed
    except (OSError, ValueError, TypeError):
        return None


class FolderClaim:
    """Rank 0's hold on a checkpoint folder for its job: ``claim`` at the start, ``check`` before
    each write and commit, ``release`` at the end; renewed from a thread meanwhile."""

    def __init__(self, root: str | Path, job: str) -> None:
        self.root, self.job = Path(root), job
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def claim(self) -> Owner | None:
        """Own the folder for this job; the live owner of another job when it is taken."""
        for _ in range(3):  # a claim that races another job's: read again, once or twice
            found = read_owner(self.root)
            if found is not None and found[0].job != self.job:
                other, renewed = found
                if other.alive(renewed):
                    return other
                log.warning(
                    "checkpoint.dir %s: taking it over from %s, which is no longer running",
                    self.root,
                    other.describe(),
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / OWNER)
            if self._create(replace=found is not None and found[0].job == self.job):
                self._start_renewing()
                return None
        found = read_owner(self.root)
        return found[0] if found is not None else None

    def _create(self, replace: bool) -> bool:
        """Write this job's record: in place of its own earlier one (a restarted job), else only
        where none is (a link fails on an existing name, on NFS too); False when another job's
        record got there first."""
        tmp = self.root / f".partial-owner-{os.getpid()}-{socket.gethostname()}"
        tmp.write_text(json.dumps(asdict(Owner.this(self.job)), sort_keys=True))
        try:
            if replace:
                os.replace(tmp, self.root / OWNER)
            else:
                os.link(tmp, self.root / OWNER)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def check(self) -> None:
        """NotOurs when the folder's record names another job (a job that took it over as stale);
        a missing record is made again."""
        found = read_owner(self.root)
        if found is None:
            self._create(replace=False)
            found = read_owner(self.root)
        if found is not None and found[0].job != self.job:
            raise NotOurs(
                f"checkpoint.dir {self.root} is owned by another {found[0].describe()}, not by "
                f"this job {self.job}: it took the folder over (this job's record had not been "
                f"renewed for {LEASE_S:g} s?)"
            )

    def release(self) -> None:
        """Stop renewing, and remove the record if it is still this job's."""
        self._stop.set()
        found = read_owner(self.root)
        if found is not None and found[0].job == self.job:
            with contextlib.suppress(OSError):
                os.unlink(self.root / OWNER)

    def _start_renewing(self) -> None:
        if self._renewer is None:
            self._renewer = threading.Thread(
                target=self._renew, name="rrfp-checkpoint-owner", daemon=True
            )
            self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            with contextlib.suppress(OSError):
                os.utime(self.root / OWNER)


def refusal(root: str | Path, owner: Owner | None) -> str:
    """The line for a folder another job owns."""
    who = owner.describe() if owner is not None else "another job"
    return (
        f"checkpoint.dir {root} is in use by {who}: one job writes into a checkpoint folder at a "
        "time (wait for it to end, or give this job another checkpoint.dir)"
    )
