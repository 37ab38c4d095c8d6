"""SIGKILL to the torchrun agent that ``rrfp train --nproc-per-node 2`` became: its store's
connection closes, and each rank stops at once with one line saying so, instead of waiting out
``run.timeout_s`` of silence behind some 110 lines of C++ store warnings with their native
stacks."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from harness.train_rows import python_m

pytestmark = pytest.mark.e2e

TIMEOUT_S = 120  # run.timeout_s: silence alone would keep the ranks this long
LIMIT_S = 60  # the ranks end well before TIMEOUT_S, however loaded the machine


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] not in "ZX"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.timeout(300)
def test_a_killed_agent_ends_each_rank_at_once_with_one_line(tmp_path):
    sets = [
        "steps=100000",
        "pp=2",
        "n_microbatches=2",
        "model.n_layer=2",
        "model.n_embd=16",
        "model.block_size=32",
        "data.min_seq_len=8",
        "data.max_seq_len=32",
        f"timeout_s={TIMEOUT_S}",
        f"log_dir={tmp_path / 'logs'}",
        f"output.dir={tmp_path / 'run'}",
    ]
    argv = ["train", "--nproc-per-node", "2", "--config", "configs/gpt-tiny.toml"]
    out, err = tmp_path / "out", tmp_path / "err"
    # the launcher from the preloaded forkserver (tests/harness/train_rows.py); its ranks are
    # forks of it, its children
    agent = python_m("rrfp", *argv, *(a for s in sets for a in ("--set", s)), out=out, err=err)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while "step    2/" not in out.read_text():
            assert agent.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        ranks = _children(agent.pid)
        assert len(ranks) == 2, ranks
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        killed = time.monotonic()
        while any(_alive(r) for r in ranks) and time.monotonic() - killed < LIMIT_S:
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), f"ranks alive {LIMIT_S} s after the agent died"
        said = err.read_text()
        lines = [ln for ln in said.splitlines() if ln.strip()]
        assert "frame #" not in said and "TCPStore.cpp" not in said, said[-3000:]
        assert len(lines) == 2, said
        for rank, line in zip(sorted(range(2)), sorted(lines)):
            assert line.startswith(f"rrfp: error: rank {rank}: stopped: the rendezvous store"), line
            assert "(in torchrun's agent) closed its connection" in line, line
            assert "the agent is gone, so this job cannot go on" in line, line
    finally:
        for pid in [agent.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait()
