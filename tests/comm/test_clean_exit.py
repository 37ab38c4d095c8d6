"""A process whose heartbeat reader is still in a store call when the script ends exits with its
own code, not SIGABRT (rrfp/loop/exit_guard.py).

At the clean end of a run the heartbeat is closed, and its reading thread ends after its current
store call; on a loaded machine that call may still be under way when the script returns. If it
returns after the interpreter's finalization began, CPython ends the thread with pthread_exit
through torch's C++ frames and libstdc++ aborts the process. Made certain here: the peer's key is
gone, so the reader waits in ``multi_get`` for it; the script closes the heartbeat and ends, and
spends a second and a half in finalization (an object's ``__del__``, as a big model's teardown
does); the key comes back 0.3 s after the close, so the call returns during the exit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from harness import ROOT
from harness.launch import child_env

SCRIPT = """
import datetime, os, sys, time
import torch.distributed as dist
from rrfp.comm.heartbeat import Heartbeat

store = dist.TCPStore(
    "127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False, wait_for_workers=False,
    timeout=datetime.timedelta(seconds=30),
)
hb = Heartbeat(store, 0, 2, timeout_s=30.0, period_s=0.05).start()
while hb.beats[1].seq < 0:  # read the peer's beat once: from now on a round is one multi_get
    time.sleep(0.01)
print("read", flush=True)
sys.stdin.readline()  # the peer's key is gone now: the reader waits in multi_get for it
time.sleep(0.3)


class SlowTeardown:
    def __del__(self):
        time.sleep(1.5)  # freed during finalization, after atexit


teardown = SlowTeardown()
hb.close()
print("closed", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_heartbeat_call_that_returns_during_the_exit_does_not_abort(tmp_path):
    script = tmp_path / "reader.py"
    script.write_text(SCRIPT)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer_key = "rrfp/heartbeat/1"
    store.set(peer_key, "1 0.000 ")
    p = subprocess.Popen(
        [sys.executable, str(script)],
        env=child_env(STORE_PORT=str(store.port), PYTHONPATH=str(ROOT)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline() == "read\n", p.stderr.read()[-2000:]
        store.delete_key(peer_key)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "closed\n", p.stderr.read()[-2000:]
        time.sleep(0.3)  # well inside both the guard's wait and the slow teardown
        store.set(peer_key, "2 0.000 ")  # the reader's multi_get returns now
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert "terminate called" not in err, err[-2000:]
    assert p.returncode == 0, f"ended with {p.returncode}: {err[-2000:]}"


GUARD_IMPORT = re.compile(
    r"^(from rrfp\.loop import exit_guard|import rrfp\.loop\.exit_guard)\b", re.MULTILINE
)
NO_TORCH_CALLS = {
    "rrfp/app/bench/launch.py",  # its daemon timer only stops a subprocess
    "rrfp/app/train/checkpoint_owner.py",  # its daemon only touches the folder's OWNER file
}


def test_every_module_that_starts_a_daemon_thread_imports_the_exit_guard():
    """The guard waits at exit only if its module was imported: a module that starts a daemon
    thread calling into torch imports it itself, whatever else the process imported."""
    starters = [
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "rrfp").rglob("*.py"))
        if re.search(r"daemon=True|\.daemon = True", p.read_text())
    ]
    assert "rrfp/comm/heartbeat.py" in starters  # the scan sees the threads it is about
    unguarded = [
        path
        for path in starters
        if path not in NO_TORCH_CALLS | {"rrfp/loop/exit_guard.py"}
        and not GUARD_IMPORT.search((ROOT / path).read_text())
    ]
    assert not unguarded, f"daemon threads without the exit guard: {unguarded}"
