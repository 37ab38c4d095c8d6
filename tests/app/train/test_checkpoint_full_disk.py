"""`rrfp train` on two ranks whose checkpoint folder is a real, small tmpfs that fills up as the
first checkpoint is written: torch's writer fails on the real file (ENOSPC), and each rank ends
with one line that names the checkpoint, the cause and the free space, exit 1; nothing of the
step is committed and its partial folder is deleted. The tmpfs is mounted in a user and mount
namespace of the job's own (``unshare -rm``'s, entered by a child of the test session's
preloaded forkserver, in which `rrfp train --nproc-per-node 2` then runs: no interpreter
importing torch afresh), which needs no root where the kernel allows unprivileged user
namespaces; elsewhere the test says so and does not run (the fault matrix's ``full`` row, a file
size limit, covers the writer there)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from harness import ROOT
from harness.forked_python import run_python
from harness.launch import child_env

pytestmark = pytest.mark.e2e

SIZE = 256 << 10  # bytes of the tmpfs: under one step's checkpoint of the model below

# ``unshare -rm sh -c 'mount -t tmpfs ...; rrfp ARGV; ls -A FOLDER > LEFT'`` in this process: a user
# namespace mapping this user to root and a mount namespace of its own (its mounts reach no other),
# the tmpfs on FOLDER, `rrfp ARGV` in a child, then what it left there listed in LEFT
IN_NAMESPACE = """
import ctypes, os, sys
from harness.train_rows import module_run
folder, left, size, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
    sys.exit(99)
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
    sys.exit(99)
pid = os.fork()
if pid == 0:
    module_run("rrfp", argv)()
    os._exit(0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open(left, "w") as f:
    f.write("\\n".join(os.listdir(folder)))
sys.exit(code)
"""


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
    argv = [
        "train",
        "--nproc-per-node",
        "2",
        "--config",
        "configs/gpt-tiny.toml",
        *(a for s in sets for a in ("--set", s)),
    ]
    left = tmp_path / "left"  # what the job left on the tmpfs, listed before it goes
    res = run_python(
        ["-c", IN_NAMESPACE, str(ck), str(left), str(SIZE), *argv],
        env=child_env(),
        cwd=ROOT,
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
