"""`rrfp train` ranks as plain processes, each in its own session, for tests of
how a run ends: stdout and stderr in files, and a check that nothing is left.

Plain processes (MASTER_ADDR, RANK, WORLD_SIZE set by hand), not torchrun
children: torchrun's agent kills a failed rank's siblings, which would hide a
survivor that hangs. Each rank leads its own process group, so the test can
tell whether anything of it (a child included) is still alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from harness import ROOT
from harness.distributed import free_port
from harness.launch import child_env, rrfp_argv


class RankProcs:
    def __init__(self, tmp: Path, world: int, args: list[str], env: dict | None = None) -> None:
        port = free_port()
        self.tmp, self.world = tmp, world
        self.procs: list[subprocess.Popen] = []
        self.files = []
        for rank in range(world):
            e = child_env(rank, world, port, **(env or {}))
            out, err = open(tmp / f"out{rank}", "w"), open(tmp / f"err{rank}", "w")
            self.files += [out, err]
            self.procs.append(
                subprocess.Popen(
                    rrfp_argv("train", *args),
                    cwd=ROOT,
                    env=e,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )

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
        for f in self.files:
            f.close()
