"""``rrfp train --nproc-per-node N``: check the config and the layout in this one process, then
hand the job to torchrun's agent.

Under a bare ``torchrun`` a refusal reaches the user after N interpreters have started, once per
job from rrfp and then again as torchrun's failure summary. Checked here first, bad input is one
line and exit 2 within seconds of the command, and only a run that can start starts the ranks.
The ranks check the config again (they must: torchrun may be started by hand), quietly.
"""

from __future__ import annotations

import os
import sys

from rrfp.app.errors import UsageError, exit_now
from rrfp.app.job import forked_rank
from rrfp.app.job.launch_agent import main as run_agent

# set for the ranks this launcher starts: the launcher has said the config's warnings already
LAUNCHED = "RRFP_LAUNCHED"


def agent_args(args, fork: bool) -> list[str]:
    """torchrun's arguments that run this ``rrfp train`` on ``args.nproc_per_node`` local ranks,
    for its agent as ``launch_agent.py`` runs it, which prints rrfp's lines and not its own.
    ``fork``: each rank is a fork of this process (forked_rank.py), which has imported torch and
    rrfp; else a fresh ``python -m rrfp train``."""
    argv = ["--standalone", "--nproc-per-node", str(args.nproc_per_node)]
    if fork:
        argv += [*forked_rank.torchrun_args("rrfp"), "train"]
    else:
        argv += ["-m", "rrfp", "train"]
    argv += ["--config", args.config]
    for item in args.set:
        argv += ["--set", item]
    argv += [flag for flag, on in (("--resume", args.resume), ("--debug", args.debug)) if on]
    return argv


def check_launch(args) -> None:
    """Refuse what cannot launch: a launcher inside a launcher, or no rank to start."""
    if "WORLD_SIZE" in os.environ:
        raise UsageError(
            "--nproc-per-node starts the ranks itself: drop it when running under torchrun"
        )
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")


def start_ranks(args) -> None:
    """Run torchrun's agent in this process (launch_agent.py), which has imported torch already:
    signals (Ctrl-C, SIGTERM) reach the agent directly, as when the user runs torchrun, and the
    job starts without a second interpreter importing torch again, nor one per rank where there
    is no CUDA. Does not return: the process exits with the job's code, that of the rank that
    failed first."""
    os.environ[LAUNCHED] = "1"
    forked_rank.save_launcher_signals()
    # rrfp sets each rank's threads (compute.threads); without this torchrun prints a banner
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(run_agent(agent_args(args, fork=can_fork())))


def can_fork() -> bool:
    """Whether the ranks can be forks of this process: not once it has asked CUDA for its devices
    (the config's checks do where there is CUDA), after which a forked process cannot use CUDA."""
    import torch

    return not torch.cuda.is_available()
