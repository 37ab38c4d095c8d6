"""`rrfp train` on two ranks whose checkpoint folder is a real, small tmpfs that fills up as the
first checkpoint is written: torch's writer fails on the real file (ENOSPC), and each rank ends
with one line that names the checkpoint, the cause and the free space, exit 1; nothing of the
step is committed and its partial folder is deleted. The tmpfs is mounted in a user and mount
namespace of the job's own (``unshare -rm``), which needs no root where the kernel allows
unprivileged user namespaces; elsewhere the test says so and does not run (the fault matrix's
``full`` row, a file size limit, covers the writer there)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from harness import ROOT
from harness.launch import child_env, rrfp_argv

pytestmark = pytest.mark.e2e

SIZE = 256 << 10  # bytes of the tmpfs: under one step's checkpoint of the model below


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.timeout(300)
def test_a_full_tmpfs_under_torchs_writer_is_one_line_naming_enospc(tmp_path: Path):
    if not _namespaces_allowed():
        pytest.skip("this machine mounts no tmpfs without root (no unprivileged user namespaces)")
    ck = tmp_path / "ck"
    ck.mkdir()
    sets = [
        "steps=3",
        "pp=2",
        "n_microbatches=4",
        "model.n_layer=2",
        "model.n_embd=32",
        "model.block_size=32",
        "data.min_seq_len=8",
        "data.max_seq_len=32",
        f"checkpoint.dir={ck}",
        "checkpoint.every=1",
        f"log_dir={tmp_path / 'logs'}",
    ]
    argv = rrfp_argv(
        "train",
        "--nproc-per-node",
        "2",
        "--config",
        "configs/gpt-tiny.toml",
        *(a for s in sets for a in ("--set", s)),
    )
    left = tmp_path / "left"  # what the job left on the tmpfs, listed before it goes
    mount = (
        f'mount -t tmpfs -o size={SIZE} tmpfs "{ck}" || exit 99; '
        f'"$@"; code=$?; ls -A "{ck}" > "{left}"; exit $code'
    )
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, "sh", *argv],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    tails = f"--- stdout:\n{res.stdout[-2000:]}\n--- stderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 1, tails
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("rrfp:")]
    assert lines, tails
    for line in lines:
        assert "checkpoint step-00000001 was not saved" in line, tails
        assert "No space left on device (ENOSPC)" in line, tails
        assert f"the file system holding {ck}/.partial-step-00000001 is full" in line, tails
        assert "inline_container" not in line and "unexpected pos" not in line, tails
    assert "Traceback" not in res.stderr, tails
    assert left.read_text().split() == [], left.read_text()  # no step, no partial folder
