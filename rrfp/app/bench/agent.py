"""torchrun's agent for the bench's job: a fork of the `rrfp bench` process, set up as the
``python -m torch.distributed.run`` it stands for, with what every rank imports imported first.

The `rrfp bench` process has imported torch and rrfp already; an interpreter of its own for the
agent would import them again, about 4 CPU-s a job. It is one only where a fork would not compute
as the ranks must (``forkable``): CUDA known to this process, whose forks cannot use it, or this
process's torch loaded with more than one OpenMP thread, which a fork's
``torch.set_num_threads(1)`` does not undo. The fork is the process torchrun's agent would
be (rrfp/app/job/forked_rank.py's ``as_fresh_interpreter``): stdin /dev/null, stdout a pipe to the
bench, stderr the job's log, the job's environment, the stop signals' default handlers. It leaves
by ``os._exit`` with the exit status torchrun's would have (an exception: its traceback on stderr,
and 1), never returning into the bench's own code.

The bench's ranks are forks of this agent (``--start-method fork``, rrfp/app/job/forked_rank.py).
Imported here once, before any fork, torch._dynamo (each rank's first optimizer imports it), rrfp's
bench modules and the workloads' models cost their CPU once per job instead of once per rank:
about 2.5 CPU-s a rank. Imports start no thread, so the agent still forks a single-threaded
process. The rank module itself is left to the ranks, which run it as ``__main__``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback
from typing import NoReturn

from rrfp.app.job import forked_rank

# what a bench rank imports before its first run, the workloads' models included
PRELOAD = (
    "torch._dynamo",
    "torch.distributed.pipelining",
    "rrfp.app.bench.runners",
    "rrfp.app.bench.torch_schedules",
    "rrfp.app.bench.dropin",
    "rrfp.app.bench.threads",
    "rrfp.loop",
    "rrfp.nn.moe_layer",
    "rrfp.pipeline.runtime",
    "rrfp.models.gpt",
    "rrfp.models.vlm",
)
POLL_S = 0.02  # how often a wait for the agent's end looks


class Agent:
    """The agent's process as the bench sees it: its pid, the read end of its stdout, and its exit
    status once it has ended (as Popen's ``returncode``: minus the signal that ended it)."""

    def __init__(self, pid: int, stdout: int, popen: subprocess.Popen | None = None) -> None:
        self.pid, self.stdout, self.popen = pid, stdout, popen
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                if self.popen is not None:  # reaped here: Popen must not wait for it again
                    self.popen.returncode = self.returncode
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None while the agent still runs after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < end:
            time.sleep(POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still the agent's
            os.kill(self.pid, sig)


def forkable() -> bool:
    """Whether the agent, and so the ranks, can be forks of this process (the module's docstring):
    the `rrfp` command loads torch with OMP_NUM_THREADS=1 unless the user set another count."""
    from rrfp.app.job.launcher import can_fork

    return os.environ.get("OMP_NUM_THREADS") == "1" and can_fork()


def start_agent(argv: list[str], env: dict[str, str], stderr: int) -> Agent:
    """torchrun's agent with torchrun's arguments ``argv``, ``env`` as its environment and the file
    descriptor ``stderr`` as its stderr: a fork of this process where ``forkable``, else
    ``python -m rrfp.app.bench.agent``."""
    if forkable():
        return fork_agent(argv, env, stderr)
    popen = subprocess.Popen(
        [sys.executable, "-m", "rrfp.app.bench.agent", *argv],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    assert popen.stdout is not None
    stdout = os.dup(popen.stdout.fileno())
    popen.stdout.close()
    return Agent(popen.pid, stdout, popen)


def fork_agent(argv: list[str], env: dict[str, str], stderr: int) -> Agent:
    """torchrun's agent in a fork of this process (``start_agent``)."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_forked(argv, env, write, stderr)
    os.close(write)
    return Agent(pid, read)


def _run_forked(argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> NoReturn:
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, std in ((null, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, std)
        os.close(null)
        os.close(stdout)
        os.environ.clear()
        os.environ.update(env)
        forked_rank.as_fresh_interpreter("torch.distributed.run", argv)
        run(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def run(argv: list[str]) -> None:
    """``python -m torch.distributed.run ARGV`` after PRELOAD."""
    for name in PRELOAD:
        importlib.import_module(name)
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":  # the agent as an interpreter of its own (start_agent)
    run(sys.argv[1:])
