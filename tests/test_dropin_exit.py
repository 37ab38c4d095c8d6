"""A drop-in script that never calls ``close()`` exits with its own code when a peer dies
under it (rrfp/loop/exit_guard.py): rank 1 ``os._exit``s in its first forward, rank 0 gets
the PeerError, says it and leaves with ``sys.exit(1)``. Without the guard, a channel's waiter
thread whose gloo wait failed a moment later took the GIL back during finalization and the
process died of SIGABRT ("terminate called without an active exception") in about a third
of the runs, so the pair runs several times."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNS = 6

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from rrfp.pipelining.schedule import ScheduleReady

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
torch.manual_seed(rank)


class Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if rank == 1:
            os._exit(3)  # a crashed rank, in its first forward
        return self.lin(x)


stage = PipelineStage(Stage(), rank, world, torch.device("cpu"))
schedule = ScheduleReady(stage, 4, loss_fn=lambda o, y: ((o - y) ** 2).mean(), timeout_s=5)
try:
    for _ in range(3):
        if rank == 0:
            schedule.step(torch.randn(8, 8))
        else:
            schedule.step(target=torch.randn(8, 8), losses=[])
except Exception as e:
    sys.stderr.write(f"rank {rank}: {type(e).__name__}\\n")
    sys.exit(1)  # no close(): the script ends on the error
"""


def _pair(script: Path) -> list[tuple[int, str]]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "RRFP_"))}
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung after its peer died") from None
        out.append((p.returncode, err))
    return out


def test_a_survivor_that_never_closes_exits_with_its_own_code(tmp_path):
    script = tmp_path / "dropin.py"
    script.write_text(SCRIPT)
    for run in range(RUNS):
        (rc0, err0), (rc1, _) = _pair(script)
        assert rc1 == 3, f"run {run}: the victim ended with {rc1}"
        assert "terminate called" not in err0, f"run {run}: {err0[-2000:]}"
        assert rc0 == 1, f"run {run}: the survivor ended with {rc0}: {err0[-2000:]}"
        assert "rank 0: PeerError" in err0, err0[-2000:]
