"""A peer that dies or stops answering ends every other rank with one error
line that names the channel (or collective) and the peer, within the timeout;
a stopped one (no heartbeat, rrfp/comm/heartbeat.py) is named as silent.

The ranks are plain processes (MASTER_ADDR, RANK, WORLD_SIZE set by hand), not
torchrun children: torchrun's agent kills a failed rank's local siblings, which
would hide a survivor that hangs. Each survivor must end on its own.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from harness.rank_procs import RankProcs

pytestmark = [pytest.mark.e2e, pytest.mark.long]

WORLD = 4
TIMEOUT_S = 10  # run.timeout_s: how long a peer may stay silent
SLACK_S = 35  # on a loaded 2-core machine; a hang still fails well inside the test timeout
STARTUP_S = 60  # until rank 0 has printed its first steps
STEPS_BEFORE_FAULT = 3

ARGS = [
    "--config",
    "configs/gpt-tiny.toml",
    "--set",
    "steps=100000",
    "--set",
    f"timeout_s={TIMEOUT_S}",
    "--set",
    "unit_ms=2",
    "--set",
    "log_every=1",
    "--set",
    "model.n_embd=32",
    "--set",
    "model.block_size=64",
    "--set",
    "data.min_seq_len=16",
    "--set",
    "data.max_seq_len=64",
]

# "channel bwd 2->1 (rank 2 -> rank 1)": the pipeline channel and both of its ranks
CHANNEL = re.compile(r"channel (?:fwd|bwd) \d+->\d+ \(rank (\d+) -> rank (\d+)\)")
ALL_REDUCE = f"world all-reduce of the step statistics (ranks 0-{WORLD - 1})"
DIED = "the peer process probably died"
TIMED_OUT = ("nothing within the process-group timeout", f"nothing arrived for {TIMEOUT_S} s")


class Ranks(RankProcs):
    """WORLD `rrfp train` processes, stdout and stderr in files."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp, WORLD, [*ARGS, "--set", f"log_dir={tmp / 'logs'}"]
        )  # where tracebacks go

    def wait_for_steps(self, n: int) -> float:
        t0 = time.monotonic()
        while sum(line.startswith("step") for line in self.out(0).splitlines()) < n:
            exited = {r: p.returncode for r, p in enumerate(self.procs) if p.poll() is not None}
            if exited:
                pytest.fail(f"rank(s) exited before the fault: {exited}\n" + self.tails())
            if time.monotonic() - t0 > STARTUP_S:
                pytest.fail(
                    f"rank 0 printed fewer than {n} steps within {STARTUP_S} s\n" + self.tails()
                )
            time.sleep(0.1)
        return time.monotonic() - t0


def _check_line(rank: int, stderr: str, victim: int) -> str:
    """The one `rrfp: error:` line of a survivor; it names the victim as silent, or a pipeline
    channel of this rank and its neighbour, or the step's world all-reduce."""
    assert "Traceback" not in stderr, f"rank {rank} printed a traceback:\n{stderr[-3000:]}"
    lines = [ln for ln in stderr.splitlines() if "rrfp: error:" in ln]
    assert len(lines) == 1, (
        f"rank {rank}: expected exactly one 'rrfp: error:' line, got {len(lines)}:\n{stderr}"
    )
    line = lines[0]
    assert line.startswith(f"rrfp: error: rank {rank}"), (
        f"the error does not name rank {rank}: {line}"
    )
    m = CHANNEL.search(line)
    if f"stopped: rank {victim} went silent: no heartbeat for " in line:
        pass
    elif m is not None:
        ends = {int(m.group(1)), int(m.group(2))}
        assert rank in ends, f"rank {rank} names a channel it is not on: {line}"
        (peer,) = ends - {rank}
        assert abs(peer - rank) == 1, f"rank {rank} names a non-neighbour channel: {line}"
        assert f"rank {peer}" in line.replace(m.group(0), ""), (
            f"rank {rank}: the peer is not named: {line}"
        )
    else:
        assert ALL_REDUCE in line, (
            f"rank {rank}'s error names neither a channel nor the all-reduce: {line}"
        )
    assert DIED in line or "went silent" in line or any(t in line for t in TIMED_OUT), (
        f"rank {rank}'s error gives no cause: {line}"
    )
    assert line.startswith(f"rrfp: error: rank {rank}: stopped: "), (
        f"a peer's failure is not this rank's: {line}"
    )
    assert line.endswith(f"/logs/rank-{rank}.log)"), (
        f"rank {rank}'s line does not say where its traceback is: {line}"
    )
    return line


@pytest.mark.timeout(170)
@pytest.mark.parametrize(
    "sig,victim",
    [("SIGKILL", 2), ("SIGSTOP", 2), ("SIGKILL", 0)],
    ids=["kill-rank2", "stop-rank2", "kill-rank0-store-host"],
)
def test_survivors_end_with_one_named_error(tmp_path, sig, victim):
    ranks = Ranks(tmp_path)
    survivors = [r for r in range(WORLD) if r != victim]
    try:
        startup = ranks.wait_for_steps(STEPS_BEFORE_FAULT)
        os.kill(ranks.procs[victim].pid, getattr(signal, sig))
        elapsed = ranks.wait(survivors, TIMEOUT_S + SLACK_S)
        times = ", ".join(
            f"rank {r}: {elapsed[r]:.2f} s" if r in elapsed else f"rank {r}: still running"
            for r in survivors
        )
        summary = (
            f"{sig} rank {victim} after {startup:.1f} s of start-up; survivors ended after {times}"
        )
        print(summary)  # shown by `pytest -rP`: the measured times-to-error
        hung = [r for r in survivors if r not in elapsed]
        assert not hung, (
            f"{summary}: rank(s) {hung} hang past timeout_s={TIMEOUT_S} + {SLACK_S} s\n"
            + ranks.tails()
        )
        lines = {}
        for r in survivors:
            rc = ranks.procs[r].returncode
            assert rc not in (0, None), f"{summary}: rank {r} exited {rc}\n" + ranks.tails()
            lines[r] = _check_line(r, ranks.err(r), victim)
        report = summary + "\n" + "\n".join(lines.values())
        if sig == "SIGKILL":
            # a dead process closes its sockets: found at once, not by waiting out the deadline
            assert max(elapsed.values()) < TIMEOUT_S, report
            assert any(DIED in ln for ln in lines.values()), report
        else:
            # a stopped process keeps its sockets open: its heartbeat stops, and timeout_s later it
            # is named
            assert min(elapsed.values()) > TIMEOUT_S / 2, (
                f"ended before the deadline could expire: {report}"
            )
            assert any(
                f"rank {victim} went silent: no heartbeat for " in ln for ln in lines.values()
            ), report
            assert ranks.procs[victim].poll() is None, "the stopped rank should still be there"
        print(report)
    finally:
        ranks.kill_all()
