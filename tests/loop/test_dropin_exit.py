"""A drop-in script that never calls ``close()`` exits with its own code, not SIGABRT
(rrfp/loop/exit_guard.py).

The abort needs a channel's waiter thread to come back from a gloo wait after the interpreter's
finalization began: CPython then ends it with pthread_exit through torch's C++ frames. Seen as
a race (a peer dies, the script ends on the first PeerError, a second wait fails a moment
later), it is made certain here: rank 0's step fails on its model's error while its receive
from rank 1 stays posted, rank 0 ends without close() and then spends a second in finalization
(an object's ``__del__``, as a big model's teardown does), and rank 1 dies half a second after
rank 0 began to exit, so that receive fails during rank 0's exit. Rank 0 must end with its
own exit code.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT
from harness.distributed import free_port
from harness.launch import child_env
from harness.train_rows import script_rank

SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from rrfp.pipelining.schedule import ScheduleReady

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
flag = Path(os.environ["EXIT_FLAG"])
dist.init_process_group("gloo")
torch.manual_seed(rank)


class Stage(torch.nn.Linear):
    calls = 0

    def forward(self, x):
        Stage.calls += 1
        if rank == 0 and Stage.calls == 2:
            raise ValueError("the model's own error")  # its receive from rank 1 is posted by now
        return super().forward(x)


class SlowTeardown:
    def __del__(self):
        time.sleep(1.5)  # freed during finalization, after atexit


stage = PipelineStage(Stage(8, 8), rank, world, torch.device("cpu"))
schedule = ScheduleReady(stage, 2, loss_fn=lambda o, y: ((o - y) ** 2).mean(), timeout_s=5)
if rank == 1:  # never steps, alive: rank 0's receive from here stays posted
    while not flag.exists():
        time.sleep(0.01)
    time.sleep(0.5)
    os._exit(0)  # dies while rank 0 exits
teardown = SlowTeardown()
try:
    schedule.step(torch.randn(4, 8))
except Exception as e:
    sys.stderr.write(f"rank {rank}: {type(e).__name__}\\n")
    flag.touch()
    sys.exit(1)  # no close()
"""


def _pair(script: Path, flag: Path) -> list[tuple[int, str]]:
    """Rank 0, whose exit is the point, a fresh interpreter as torchrun starts it; rank 1, the peer
    that dies, a fork of the preloaded forkserver (tests/harness/train_rows.py): its own exit is
    not what is tested. Each (exit code, stderr); a rank still running after 90 s fails the test
    as a hang."""
    port, env = free_port(), {"EXIT_FLAG": str(flag)}
    peer = script_rank(script, 1, 2, port, flag.parent, env)
    rank0 = subprocess.Popen(
        [sys.executable, str(script)],
        env=child_env(0, 2, port, PYTHONPATH=str(ROOT), **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err0 = rank0.communicate(timeout=90)
        rc1 = peer.wait(90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{script.name}: a rank hung") from None
    finally:
        for p in (rank0, peer):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    return [(rank0.returncode, err0), (rc1, (flag.parent / "err1").read_text(errors="replace"))]


@pytest.mark.e2e
def test_a_script_that_never_closes_exits_with_its_own_code_while_a_wait_fails(tmp_path):
    script = tmp_path / "dropin.py"
    script.write_text(SCRIPT)
    (rc0, err0), (rc1, _) = _pair(script, tmp_path / "exiting")
    assert rc1 == 0, f"rank 1 ended with {rc1}"
    assert "terminate called" not in err0, err0[-2000:]
    assert rc0 == 1, f"rank 0 ended with {rc0}: {err0[-2000:]}"
    assert "rank 0: ValueError" in err0, err0[-2000:]
