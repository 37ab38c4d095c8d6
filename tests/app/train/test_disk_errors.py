"""A checkpoint write that a disk's limit stops is one line naming the cause: torch's writer's
``[enforce fail at inline_container.cc:672] . unexpected pos`` becomes the errno behind it (EFBIG
past the file size limit, ENOSPC on a full file system), in the test process (DCP without a
process group)."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

import pytest
import torch

from rrfp.app.train.checkpoint_state import CheckpointError, save_stage
from rrfp.app.train.disk_errors import DiskFull, diagnosed, disk_errors

LIMIT = 16 << 10  # bytes: under the file of a 128 x 128 Linear and its AdamW state


def _save(path: Path) -> None:
    module = torch.nn.Linear(128, 128)
    save_stage(
        path,
        module,
        torch.optim.AdamW(module.parameters()),
        rank=0,
        stage=0,
        tp_rank=0,
        device=torch.device("cpu"),
    )


@pytest.fixture
def size_limit():
    """This process's file size limit lowered to LIMIT for the test (Python ignores SIGXFSZ, so
    a write past it fails with EFBIG, as under ``ulimit -f``)."""
    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torchs_writer_past_the_file_size_limit_is_named_efbig_with_the_limit(tmp_path, size_limit):
    with pytest.raises(CheckpointError) as caught:
        _save(tmp_path / "ck")
    line = str(caught.value)
    assert "inline_container" not in line and "unexpected pos" not in line, line
    assert line.startswith(
        f"cannot write checkpoint {tmp_path / 'ck'}: rank 0: File too large (EFBIG)"
    ), line
    assert f"file size limit of {LIMIT} bytes (ulimit -f, RLIMIT_FSIZE)" in line, line
    assert "\n" not in line


def test_the_writers_error_without_an_errno_is_diagnosed_from_the_file_size_limit(
    tmp_path, size_limit
):
    """torch's stream may fail in its own flush, its OSError lost: a file at the limit: EFBIG."""
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * LIMIT)
    with pytest.raises(DiskFull) as caught, disk_errors(tmp_path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert caught.value.errno == errno.EFBIG and "writing __0_0.distcp" in str(caught.value)


def test_a_file_system_without_free_space_is_diagnosed_enospc(tmp_path, monkeypatch):
    full = os.statvfs_result((4096, 4096, 512, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    err = diagnosed(tmp_path)
    assert err is not None and err.errno == errno.ENOSPC
    with pytest.raises(DiskFull) as caught, disk_errors(tmp_path):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    words = str(caught.value)
    assert words.startswith("No space left on device (ENOSPC): the file system holding"), words
    assert "0 bytes free of 2097152" in words, words


def test_other_errors_pass_through_unchanged(tmp_path):
    """A writer error that is not a disk's limit (a bug, a permission) stays what it was."""
    with pytest.raises(RuntimeError, match="unrelated"), disk_errors(tmp_path):
        raise RuntimeError("unrelated")
    with pytest.raises(PermissionError), disk_errors(tmp_path):
        raise PermissionError(errno.EACCES, "Permission denied")
