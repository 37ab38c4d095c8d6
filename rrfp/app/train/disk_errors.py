"""A checkpoint write that failed for want of disk: the errno behind torch's writer's error, and
what to do about it, in words.

torch.save (which DCP's file writer calls for each file) writes through a C++ stream: a full disk
or a file size limit surfaces as ``RuntimeError: [enforce fail at inline_container.cc:672] .
unexpected pos 704 vs 598``, with the OSError that caused it (ENOSPC, EFBIG) at best as that
error's context, which does not survive DCP sending the failure to the other ranks. So the writer's
own rank turns the failure into an OSError naming the cause (``disk_errors``) before DCP sends it
on; where no errno came with it, the rank looks at what a writer runs out of: its file size limit
(RLIMIT_FSIZE, ``ulimit -f``) and the free space of the folder's file system.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path

# the errnos of a disk that cannot take more: its space, this process's file size limit, a quota
DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# torch's stream writer's failure, whatever errno (if any) it lost on the way
_TORCH_WRITER = ("inline_container", "PytorchStreamWriter")
# free bytes under which a file system counts as full when a write to it failed without an errno
_NEARLY_FULL = 1 << 20


def os_error_of(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``'s chain: itself, then what caused it."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, OSError) and at.errno is not None:
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


def _size_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def diagnosed(folder: Path) -> OSError | None:
    """Why a write into ``folder`` failed without an errno, when a disk's limit explains it: EFBIG
    when a file there reached this process's file size limit, ENOSPC when the folder's file system
    has (nearly) no space left; None otherwise."""
    limit = _size_limit()
    try:
        files = [p for p in folder.iterdir() if p.is_file()]
        if limit is not None:
            for p in files:
                if p.stat().st_size >= limit:
                    return OSError(errno.EFBIG, os.strerror(errno.EFBIG), p.name)
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < _NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def explained(e: OSError, folder: Path) -> str:
    """``e``, a disk's error writing into ``folder``, as the cause and what to do about it."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    said = f"{os.strerror(e.errno or 0)} ({name})" + (
        f" writing {e.filename}" if e.filename else ""
    )
    if e.errno == errno.ENOSPC:
        try:
            st = os.statvfs(folder)
            free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
        except OSError:
            free = "its free space unknown"
        return (
            f"{said}: the file system holding {folder} is full ({free}): free space there, or "
            "set checkpoint.dir to a disk with room"
        )
    if e.errno == errno.EFBIG:
        limit = _size_limit()
        what = f"of {limit} bytes" if limit is not None else "(unlimited now)"
        return (
            f"{said}: a file reached the writing rank's file size limit {what} (ulimit -f, "
            "RLIMIT_FSIZE): raise the limit"
        )
    if e.errno == errno.EDQUOT:
        return f"{said}: the disk quota of the user is used up: free space, or raise the quota"
    return f"{said}: {e.strerror or e}"


class DiskFull(OSError):
    """A write that a disk's limit stopped; its text says which limit, where, and what to do
    (an OSError, so it pickles with its words when DCP sends it to the other ranks)."""

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def disk_errors(folder: Path) -> Iterator[None]:
    """Around a write into ``folder``: a failure from a full disk, a file size limit or a quota,
    however torch's writer reported it, raised as a DiskFull that says so."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        err = os_error_of(exc)
        if (
            err is None
            and isinstance(exc, RuntimeError)
            and any(w in str(exc) for w in _TORCH_WRITER)
        ):
            err = diagnosed(Path(folder))
        if err is None or err.errno not in DISK_ERRNOS:
            raise
        raise DiskFull(err.errno, explained(err, Path(folder)), err.filename) from None
