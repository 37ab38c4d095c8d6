"""Start the bench's torchrun job, follow its progress, and turn its failure
into one line.

torchrun's and the ranks' stderr go to a log file in the results folder (a
failing rank's traceback and torchrun's own report stay there); the parent
shows a progress bar from rank 0's progress lines, and when the job fails it
reports the first ``rrfp: error:`` line a rank printed. A job that outlives
its deadline is stopped (torchrun stops its ranks on SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from rrfp.app.bench.rank import PROGRESS
from rrfp.app.bench.suite import ROOT, BenchSpec
from rrfp.app.job import forked_rank


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


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun (it stops its ranks), then SIGKILL it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_job(
    spec: BenchSpec, job_dir: Path, log: Path, cost: dict[str, str], timeout_s: float, bar
) -> dict:
    """Run every case of ``spec`` on ``spec.world`` local ranks; return rank 0's rows.
    ``bar.update(1)`` per finished run. Raises JobFailed with one line."""
    job, rows = job_dir / "job.json", job_dir / "rows.json"
    job.write_text(json.dumps({"spec": spec.as_dict(), "cost": cost}))
    # each rank a fork of torchrun's agent, which has imported torch and what the ranks import
    # (rrfp/app/bench/agent.py, rrfp/app/job/forked_rank.py)
    cmd = [
        sys.executable,
        "-m",
        "rrfp.app.bench.agent",
        "--standalone",
        f"--nproc-per-node={spec.world}",
        *forked_rank.torchrun_args("rrfp.app.bench.rank"),
        str(job),
        str(rows),
    ]
    # the ranks import this rrfp and the models beside it, wherever the command was started
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        expired = threading.Event()

        def deadline() -> None:
            expired.set()
            _stop(proc)

        timer = threading.Timer(timeout_s, deadline)
        timer.daemon = True
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    bar.set_postfix_str(json.loads(line[len(PROGRESS) :])["label"], refresh=False)
                    bar.update(1)
                else:
                    err.write(line)  # nothing else should print; keep it with the log
            rc = proc.wait()
        except BaseException:  # e.g. Ctrl-C: do not leave ranks behind
            _stop(proc)
            raise
        finally:
            timer.cancel()
    first = _rank_error(log)
    if expired.is_set():
        raise JobFailed(
            f"it did not finish within {timeout_s:g} s (--timeout) and was stopped"
            f"{f'; first rank error: {first}' if first else ''} (log: {log})"
        )
    if rc != 0:
        raise JobFailed(f"{first or _last_line(log)} (torchrun exit {rc}; log: {log})")
    return json.loads(rows.read_text())
