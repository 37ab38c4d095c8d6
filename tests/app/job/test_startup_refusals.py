"""A job refused at start-up ends on every rank: a output.trace or output.sizes path that
cannot be written is probed on every rank (not rank 0 alone, which left the others
waiting for it in the rendezvous), and a rank that waits in the rendezvous acts on
SIGTERM at once (the rendezvous runs off the main thread, where Python runs signal
handlers). No torchrun: its agent would end the others itself."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest
from harness import ROOT
from harness.checkpoint_run import SMALL
from harness.launch import child_env, rrfp_argv
from harness.train_rows import TrainJob

LIMIT_S = 45  # imports and the checks of 2 ranks on a loaded 2-core machine


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("key,where", [("trace", "folder"), ("sizes", "below a file")])
def test_an_end_file_that_cannot_be_written_ends_every_rank_with_exit_2(tmp_path, key, where):
    (tmp_path / "a-file").write_text("x")
    path = tmp_path if where == "folder" else tmp_path / "a-file" / "out.json"
    ranks = TrainJob(tmp_path / "job", [*SMALL, "--set", "timeout_s=60", "--set", f"{key}={path}"])
    try:
        assert ranks.wait([0, 1], time.monotonic() + LIMIT_S), (
            f"still running after {LIMIT_S} s\n{ranks.tails()}"
        )
        assert ranks.codes() == [2, 2], ranks.tails()
        for r in (0, 1):
            lines = ranks.lines(r)
            assert len(lines) == 1 and f"output.{key} = {path}" in lines[0], ranks.err(r)
    finally:
        ranks.kill()


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(120)
def test_a_rank_waiting_in_the_rendezvous_stops_at_once_on_sigterm(tmp_path):
    """Rank 1 of 2 alone: its rendezvous waits for a rank 0 that never answers (timeout_s = 60).
    The test holds rank 0's port, listening, so no other test's store can take it, and accepts
    the rank's connection without a word: the rank is then in the rendezvous, waiting for its
    store, when the signal comes (a fixed sleep cannot know when a loaded machine's imports end)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    held.settimeout(LIMIT_S)
    conn = None
    p = subprocess.Popen(
        rrfp_argv("train", *SMALL, "--set", "timeout_s=60"),
        cwd=ROOT,
        env=child_env(1, 2, held.getsockname()[1]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        conn, _ = held.accept()  # the rank's store client: in the rendezvous
        assert p.poll() is None, p.communicate()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=10)
        took = time.monotonic() - t0
    finally:
        p.kill()
        if conn is not None:
            conn.close()
        held.close()
    assert p.returncode == 143, (p.returncode, err)
    assert took < 5, f"{took:.1f} s after SIGTERM"
    assert err.strip().splitlines() == [
        "rrfp: stopped: rank 1: SIGTERM during start-up, before any step; no "
        "checkpoint is kept (checkpoint.dir is not set)"
    ], err
