"""Bad user input (the CLI prints one line and exits 2), and a rank's failure as one line."""

import logging
import os
import sys
from collections.abc import Callable

from rrfp.core.errors import PipelineError, leaves


class UsageError(Exception):
    """A command line, flag or value that cannot be used; the message says which."""


class ConfigError(UsageError, ValueError):
    """A config file or override that cannot be used; the message says which key."""


def root_cause(e: BaseException) -> BaseException:
    """The first leaf of an exception group."""
    return leaves(e)[0]


# how a rank forked by torchrun's agent leaves once done (rrfp/app/job/forked_rank.py sets it): the
# agent counts such a rank done by its function's return, and torch's multiprocessing then ends it
# without the C++ teardown
forked_done: Callable[[], None] | None = None


def exit_now(code: int) -> None:
    """End a rank's process at once, its output flushed: a peer may be dead with gloo threads
    blocked in it, and torch's C++ teardown after gloo async collectives sometimes aborts
    ("terminate called without an active exception", about 1 run in 7 on 4 CPU ranks), which
    would turn a finished run into exit 134. A forked rank that finished leaves by
    ``forked_done``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and forked_done is not None:
        forked_done()
    os._exit(code)


def one_line(e: BaseException, rank: int) -> str:
    """A rank's failure as one line that names the rank (most causes name it already)."""
    cause = root_cause(e)
    text = (
        str(cause)
        if isinstance(cause, (PipelineError, ConfigError))
        else f"{type(cause).__name__}: {cause}"
    )
    line = " ".join(text.split())
    if line.split(":")[0].split()[:2] != ["rank", str(rank)]:
        line = f"rank {rank}: {line}"
    return line
