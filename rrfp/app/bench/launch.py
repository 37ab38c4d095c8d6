"""Start the bench's torchrun job, follow its progress, and turn its failure
into one line.

torchrun's agent is a fork of the `rrfp bench` process where it can be (rrfp/app/bench/agent.py).
Its and the ranks' stderr go to a log file in the results folder (a
failing rank's traceback and torchrun's own report stay there); the parent
shows a progress bar from rank 0's progress lines, and when the job fails it
reports the first ``rrfp: error:`` line a rank printed. A job that outlives
its deadline is stopped (torchrun stops its ranks on SIGTERM).
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path

from rrfp.app.bench.agent import Agent, start_agent
from rrfp.app.bench.rank import PROGRESS
from rrfp.app.bench.suite import ROOT, BenchSpec
from rrfp.app.job import forked_rank

STOP_WAIT_S = 30.0  # how long a stopped agent has to stop its ranks before it is killed


class JobFailed(Exception):
    """The torchrun job exited non-zero or ran past its deadline; the message is one line."""


def _rank_error(log: Path) -> str | None:
    """The first rank's error line (ranks share the log, so lines keep their order), and how many
    ranks failed after it, mostly of its consequences."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [ln.split("rrfp: error: ", 1)[1] for ln in lines if "rrfp: error: " in ln]
    if not errors:
        return None
    return errors[0] + (f" (then {len(errors) - 1} more rank error(s))" if len(errors) > 1 else "")


def _last_line(log: Path) -> str:
    lines = (
        [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        if log.exists()
        else []
    )
    return lines[-1] if lines else "no output"


def _stop(agent: Agent) -> None:
    """SIGTERM torchrun's agent (it stops its ranks), then SIGKILL it if it lingers."""
    agent.send_signal(signal.SIGTERM)
    if agent.wait(STOP_WAIT_S) is None:
        agent.send_signal(signal.SIGKILL)
        agent.wait(STOP_WAIT_S)


def _follow(agent: Agent, bar, err, deadline: float) -> bool:
    """Show rank 0's progress lines on ``bar`` and keep any other line of the job's stdout in the
    log ``err``: True once the agent and every rank have closed it, False if ``deadline``
    (time.monotonic) comes first."""
    rest = b""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([agent.stdout], [], [], left)[0]:
            continue
        chunk = os.read(agent.stdout, 1 << 16)
        if not chunk:
            return True
        *lines, rest = (rest + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if line.startswith(PROGRESS):
                bar.set_postfix_str(json.loads(line[len(PROGRESS) :])["label"], refresh=False)
                bar.update(1)
            else:
                err.write(line + "\n")  # nothing else should print; keep it with the log
    return False


def run_job(
    spec: BenchSpec, job_dir: Path, log: Path, cost: dict[str, str], timeout_s: float, bar
) -> dict:
    """Run every case of ``spec`` on ``spec.world`` local ranks; return rank 0's rows.
    ``bar.update(1)`` per finished run. Raises JobFailed with one line."""
    job, rows = job_dir / "job.json", job_dir / "rows.json"
    job.write_text(json.dumps({"spec": spec.as_dict(), "cost": cost}))
    # the agent a fork of this process where it can be, each rank a fork of the agent, which has
    # imported what the ranks import (rrfp/app/bench/agent.py, rrfp/app/job/forked_rank.py)
    argv = [
        "--standalone",
        f"--nproc-per-node={spec.world}",
        *forked_rank.torchrun_args("rrfp.app.bench.rank"),
        str(job),
        str(rows),
    ]
    # what the ranks start imports this rrfp and the models beside it, wherever the command was
    # started
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    log.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(log, "w") as err:
        agent = start_agent(argv, env, err.fileno())
        try:
            finished = _follow(agent, bar, err, deadline)
            rc = agent.wait(max(0.0, deadline - time.monotonic())) if finished else None
            if rc is None:
                _stop(agent)
        except BaseException:  # e.g. Ctrl-C: do not leave ranks behind
            _stop(agent)
            raise
        finally:
            os.close(agent.stdout)
    first = _rank_error(log)
    if rc is None:
        raise JobFailed(
            f"it did not finish within {timeout_s:g} s (--timeout) and was stopped"
            f"{f'; first rank error: {first}' if first else ''} (log: {log})"
        )
    if rc != 0:
        raise JobFailed(f"{first or _last_line(log)} (torchrun exit {rc}; log: {log})")
    return json.loads(rows.read_text())
