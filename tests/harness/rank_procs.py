"""`rrfp train` ranks started by hand, each in its own process group, for tests of how a run ends:
stdout and stderr in files, and a check that nothing is left.

Ranks with MASTER_ADDR, RANK, WORLD_SIZE set by hand, not torchrun children: torchrun's agent
kills a failed rank's siblings, which would hide a survivor that hangs. Each rank leads its own
process group, so the test can tell whether anything of it (a child included) is still alive.
A rank is a child of the test session's forkserver running ``python -m rrfp train`` as a fresh
interpreter would (tests/harness/train_rows.py: torch and rrfp already imported, SIGINT raising
KeyboardInterrupt), seen through the part of ``subprocess.Popen`` the tests use.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from harness.distributed import _context, free_port
from harness.train_rows import AsPopen, _rank_main


class RankProcs:
    def __init__(self, tmp: Path, world: int, args: list[str], env: dict | None = None) -> None:
        ctx, port = _context(), free_port()
        self.tmp, self.world = tmp, world
        self.procs: list[AsPopen] = []
        for rank in range(world):
            for name in (f"out{rank}", f"err{rank}"):  # readable from the start, as Popen's were
                (tmp / name).write_text("")
            p = ctx.Process(
                target=_rank_main,
                args=(rank, world, port, ["train", *args], str(tmp), env or {}),
                kwargs={"sigint": signal.default_int_handler},
            )
            p.start()
            self.procs.append(AsPopen(p))

    def out(self, rank: int) -> str:
        return (self.tmp / f"out{rank}").read_text(errors="replace")

    def err(self, rank: int) -> str:
        return (self.tmp / f"err{rank}").read_text(errors="replace")

    def error_lines(self, rank: int) -> list[str]:
        return [ln for ln in self.err(rank).splitlines() if ln.startswith("rrfp: error:")]

    def wait(self, ranks, limit_s: float) -> dict[int, float]:
        """Seconds from now until each of ``ranks`` exited; one still running after limit_s is
        missing."""
        t0 = time.monotonic()
        done: dict[int, float] = {}
        while len(done) < len(ranks) and time.monotonic() - t0 < limit_s:
            for r in ranks:
                if r not in done and self.procs[r].poll() is not None:
                    done[r] = time.monotonic() - t0
            time.sleep(0.02)
        return done

    def alive(self) -> list[int]:
        """Ranks whose process group still has a process (a stopped one counts)."""
        left = []
        for r, p in enumerate(self.procs):
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                continue
            left.append(r)
        return left

    def tails(self) -> str:
        return "\n".join(f"--- rank {r} stderr:\n{self.err(r)[-2000:]}" for r in range(self.world))

    def kill_all(self) -> None:
        """SIGKILL whatever is left of every rank (a SIGSTOPped one included), and reap it."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
