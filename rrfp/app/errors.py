"""Bad input from the user (the CLI prints one line and exits 2), and a rank's failure as one line."""

from rrfp.core.errors import PipelineError


class UsageError(Exception):
    """A command line, flag or value that cannot be used; the message says which."""


class ConfigError(UsageError, ValueError):
    """A config file or override that cannot be used; the message says which key."""


def root_cause(e: BaseException) -> BaseException:
    """The first leaf of an exception group: TaskGroup wraps the real cause."""
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def one_line(e: BaseException, rank: int) -> str:
    """A rank's failure as one line that names the rank (most causes name it already)."""
    cause = root_cause(e)
    text = str(cause) if isinstance(cause, (PipelineError, ConfigError)) else f"{type(cause).__name__}: {cause}"
    line = " ".join(text.split())
    if line.split(":")[0].split()[:2] != ["rank", str(rank)]:
        line = f"rank {rank}: {line}"
    return line
