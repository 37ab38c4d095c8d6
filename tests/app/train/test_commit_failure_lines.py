"""A checkpoint whose commit fails on rank 0 (a full disk as it writes meta.json) is
one line for the job that says why: rank 0's, naming ENOSPC; the other rank's
line points at rank 0 and names no cause of its own. Plain processes, 2 ranks."""

from __future__ import annotations

import pytest
from harness.fault_run import STARTUP_S, _args
from harness.rank_procs import RankProcs

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(150)
def test_a_full_disk_at_commit_is_said_by_rank_0_and_pointed_at_by_the_other(tmp_path):
    ranks = RankProcs(
        tmp_path,
        2,
        _args(
            tmp_path,
            2,
            "steps=3",
            "fault=full:step=1:rank=0:during=commit",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every=1",
        ),
    )
    try:
        ended = ranks.wait([0, 1], STARTUP_S)
        assert sorted(ended) == [0, 1], ranks.tails()
        assert [p.returncode for p in ranks.procs] == [1, 1], ranks.tails()
        zero, one = ranks.error_lines(0), ranks.error_lines(1)
        assert (
            len(zero) == 1
            and "could not commit checkpoint" in zero[0]
            and "No space left on device" in zero[0]
        ), ranks.tails()
        assert "stopped:" not in zero[0], zero
        assert len(one) <= 1, one
        if one:
            assert "stopped:" in one[0] and "rank 0" in one[0] and "No space left" not in one[0], (
                one
            )
        assert "Traceback" not in ranks.err(0) + ranks.err(1), ranks.tails()
    finally:
        ranks.kill_all()
