"""A rank stopped (SIGSTOP) inside a checkpoint's save or commit is named by the
other rank within run.timeout_s, as one stopped during a step is: every wait of
a save is bounded, and a blocking collective left waiting on the stopped peer
(DCP's save, in a thread) does not hold the survivor's exit. Plain processes
(rank_procs.py), 2 ranks; rank 0 holds the rendezvous store, so a stopped rank 0
is named as the store that stopped answering."""

from __future__ import annotations

import re
import time

import pytest
from harness.fault_run import _args, _wait_for_fault
from harness.rank_procs import RankProcs

pytestmark = [pytest.mark.e2e, pytest.mark.long]

TIMEOUT_S = 4
SLACK_S = 12  # a loaded 2-core machine


@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase,victim", [("save", 1), ("commit", 0), ("commit", 1)])
def test_a_rank_stopped_in_a_save_is_named_within_the_timeout(tmp_path, phase, victim):
    world, survivor = 2, 1 - victim
    fault = f"stop:step=2:rank={victim}:during={phase}"
    ranks = RankProcs(
        tmp_path,
        world,
        _args(
            tmp_path,
            world,
            f"timeout_s={TIMEOUT_S}",
            f"fault={fault}",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every=1",
        ),
    )
    try:
        what = "write" if phase == "save" else "commit"
        _wait_for_fault(
            ranks, victim, f"step 2 during the checkpoint {what}: injecting fault {fault}"
        )
        t0 = time.monotonic()
        ended = ranks.wait([survivor], TIMEOUT_S + SLACK_S)
        assert survivor in ended, (
            f"rank {survivor} still running {TIMEOUT_S + SLACK_S} s after the stop\n{ranks.tails()}"
        )
        took = time.monotonic() - t0
        assert ranks.procs[survivor].returncode == 1, ranks.tails()
        lines = ranks.error_lines(survivor)
        assert len(lines) == 1 and "Traceback" not in ranks.err(survivor), ranks.err(survivor)
        named = (
            rf"rank 1 went silent: no heartbeat for [\d.]+ s \(run.timeout_s = {TIMEOUT_S}\)"
            if victim == 1
            else r"\(in rank 0's process\) stopped answering: .* rank 0 is stopped, hung or gone"
        )
        assert re.search(named, lines[0]), lines[0]
        assert took > TIMEOUT_S / 2, f"named after {took:.1f} s, before the deadline could pass"
        print(f"{fault}: rank {survivor} named it {took:.1f} s after the stop was logged")
    finally:
        ranks.kill_all()
