"""torchrun's agent as ``rrfp train --nproc-per-node`` runs it, in its own process
(rrfp/app/job/launcher.py), or as ``python -m rrfp.app.job.launch_agent TORCHRUN-ARGS``, with
torchrun's own arguments.

Each rank of a failed run writes its one line (rrfp/app/job/failure.py); torchrun's agent would then
add its log lines and a ``ChildFailedError`` traceback of about 40 lines that say nothing more.
Here the agent runs as torchrun runs it (its ``run``), in this process, so that Ctrl-C and SIGTERM
reach it as they reach torchrun; only what it prints is different: its log lines below CRITICAL
are dropped, and a failure ends with the exit code of the rank that failed first (1, 2 for bad
input, 130 or 143 for a stop) instead of the traceback. A rank that a signal ended wrote no line:
this one says so, and the job exits 1. Ctrl-C or SIGTERM to this process stops the ranks as
torchrun does; the job then exits 128 + the signal.
"""

from __future__ import annotations

import logging
import os
import sys

from rrfp.app.job.job_lines import say

# the loggers torchrun's agent logs with (torch.distributed.elastic's, torch.distributed.run's, and
# torch.multiprocessing's for the ranks it forks)
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.multiprocessing")


class _AgentLinesDropped(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        agents = record.name.startswith(AGENT_LOGGERS)
        return not agents or record.levelno >= logging.CRITICAL


def quiet_agent() -> None:
    """Drop the agent's log lines below CRITICAL ("Sending process ... closing signal SIGTERM",
    "failed (exitcode: 1)"): torch logs them through the handlers of its ``torch`` and
    ``torch.distributed`` loggers, each agent logger at a level of its own."""
    for name in ("torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_AgentLinesDropped())


def ended(failures: dict) -> int:
    """The job's exit code once ``failures`` (rank -> torch's ProcessFailure) ended it, and the
    line for a rank that wrote none. A rank whose own failure ended it wrote its line, and the
    error file the agent gave it (rrfp/app/job/job_lines.py tell_torchrun); the others, stopped by
    its loss, stay silent (rrfp/app/cli/train_command.py). So the rank that failed first is the
    first that wrote an error file; with none, the first that a signal ended, which cannot have
    written a line, so it is said here; with neither (every rank stopped, 130 or 143), the first
    to exit. torch's own "first failure" compares whole seconds, and a tie picks the lowest rank."""
    wrote = [r for r, f in failures.items() if os.path.isfile(f.error_file)]
    killed = [r for r, f in failures.items() if f.exitcode < 0]
    rank = min(wrote or killed or failures, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    if wrote or not killed:
        return failure.exitcode
    # ended by a signal (the OOM killer's SIGKILL): it said nothing
    say(
        f"rrfp: error: rank {rank} was ended by {failure.signal_name()} (pid {failure.pid}) "
        "without a line of its own: killed, out of memory or crashed"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; the exit code of the job."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    quiet_agent()
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        return ended(e.failures)
    except SignalException as e:  # Ctrl-C or SIGTERM: the agent stopped the ranks, which said so
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
