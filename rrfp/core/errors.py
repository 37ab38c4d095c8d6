"""Errors a stage raises when a peer or the protocol fails. Each names the
rank, the channel or peer, and what was expected, in one line.

Two families, so the CLI can tell which rank saw a failure first: a
``PeerFailure`` means this rank is fine and another one died, hung or broke
the group (a secondary failure); any other ``PipelineError`` was raised by this
rank's own checks (a primary one).
"""


class PipelineError(RuntimeError):
    """Base of errors that end a stage."""


class PeerFailure(PipelineError):
    """This rank stopped because a peer died, went silent or broke a group.
    ``peer`` is that peer's global rank where one is known, else None."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTimeout(PeerFailure):
    """Nothing arrived from a peer within the deadline."""


class PeerStuck(PeerTimeout):
    """A peer that beats (alive) but never came where this rank waited for it (its message, a
    collective) while the job made no progress for ``timeouts.progress_s``: stuck in other code,
    or waiting elsewhere. Named by the heartbeat's view, as PeerSilent is; the cause itself (the
    stuck peer writes no line of its own)."""


class PeerSilent(PeerFailure):
    """A peer's heartbeat stopped for the deadline (rrfp/comm/heartbeat.py): it is
    stopped, hung or cut off. The cause itself, not a consequence of another failure.
    ``peer`` is None when the store that carries the heartbeats stopped answering."""


class ProtocolError(PipelineError):
    """A message that is not what the pipeline expects at this point."""


class StartupError(PipelineError):
    """The process groups could not be set up: rendezvous, store or group creation failed."""


class NonFiniteError(PipelineError):
    """A NaN or Inf in the loss or the gradients, with ``optim.on_nonfinite = "stop"``."""


class TaskOverrun(PipelineError):
    """A task of this rank ran past its bound (rrfp/pipeline/task_bound.py) and never returned:
    stuck in its compute, a collective inside it or a kernel. This rank's own failure."""


class InjectedFault(PipelineError):
    """A failure asked for by fault injection (``debug.fault``), for testing."""


def leaves(e: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; TaskGroup wraps the real
    causes."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for sub in e.exceptions for leaf in leaves(sub)]
    return [e]
