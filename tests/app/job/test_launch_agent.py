"""What ``rrfp train --nproc-per-node`` ends with once torchrun's agent has run the ranks
(rrfp/app/job/launch_agent.py): the exit code of the rank that failed first and none of the agent's
own text, a line for a rank a signal ended (it wrote none), 128 + the signal for a stop. The agent
itself is torch's; here its outcome is given, and the e2e runs are in test_user_mistakes.py."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from unittest import mock

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from rrfp.app.job import launch_agent

ARGV = ["--standalone", "--nproc-per-node", "2", "-m", "rrfp", "train", "--config", "c.toml"]


def _failures(tmp: Path, *ranks: tuple[int, bool]) -> dict[int, ProcessFailure]:
    """Ranks 0, 1, ... ended with these (exit code, whether it wrote its line), all in the same
    second, as the agent sees ranks that fail together."""
    failures = {}
    for rank, (code, wrote) in enumerate(ranks):
        error_file = tmp / f"error-{rank}.json"
        if wrote:  # what rrfp/app/job/job_lines.py tell_torchrun leaves
            info = {"py_callstack": f"rrfp: error: rank {rank}", "timestamp": "1000"}
            error_file.write_text(json.dumps({"message": {"message": "x", "extraInfo": info}}))
        failures[rank] = ProcessFailure(rank, 100 + rank, code, str(error_file))
        failures[rank].timestamp = 1000
    return failures


def _main(outcome: BaseException) -> int:
    with (
        mock.patch("torch.distributed.run.run", side_effect=outcome) as run,
        mock.patch.object(launch_agent, "quiet_agent"),  # torch's handlers stay as they are here
    ):
        code = launch_agent.main(ARGV)
    assert run.call_args.args[0].nproc_per_node == "2"  # torchrun's own arguments, as given
    return code


@pytest.mark.parametrize("code", [1, 2])
def test_a_failed_job_exits_as_the_rank_that_wrote_its_line_and_prints_nothing(
    code, tmp_path, capsys
):
    """Rank 0 stopped because rank 1 failed, in the same second: rank 1's line is the job's."""
    failures = _failures(tmp_path, (1, False), (code, True))
    assert _main(ChildFailedError("rrfp", failures)) == code
    assert capsys.readouterr().err == ""


def test_a_rank_ended_by_a_signal_is_named(tmp_path, capsys):
    failures = _failures(tmp_path, (1, False), (-signal.SIGKILL, False))
    assert _main(ChildFailedError("rrfp", failures)) == 1
    assert capsys.readouterr().err == (
        "rrfp: error: rank 1 was ended by SIGKILL (pid 101) without a line of its own: killed, "
        "out of memory or crashed\n"
    )


def test_a_job_whose_ranks_stopped_exits_as_they_did(tmp_path, capsys):
    assert _main(ChildFailedError("rrfp", _failures(tmp_path, (143, False), (143, False)))) == 143
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_exits_128_plus_the_signal(sig, capsys):
    assert _main(SignalException("stopped", sig)) == 128 + sig
    assert capsys.readouterr().err == ""


def test_the_agents_log_lines_are_dropped_below_critical():
    handler = logging.getLogger("torch.distributed").handlers[0]
    before = list(handler.filters)
    launch_agent.quiet_agent()
    agent = "torch.distributed.elastic.multiprocessing.api"

    def shown(name: str, level: int) -> bool:
        return bool(handler.filter(logging.LogRecord(name, level, "", 0, "x", None, None)))

    try:
        assert not shown(agent, logging.ERROR)
        assert not shown("torch.distributed.run", logging.WARNING)
        assert shown(agent, logging.CRITICAL) and shown("torch.distributed.c10d", logging.WARNING)
    finally:
        for name in ("torch", "torch.distributed"):
            for h in logging.getLogger(name).handlers:
                h.filters = [f for f in h.filters if f in before]
