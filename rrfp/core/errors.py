"""Errors a stage raises when a peer or the protocol fails. Each names the
rank, the channel or peer, and what was expected, in one line."""


class PipelineError(RuntimeError):
    """Base of errors that end a stage."""


class PeerTimeout(PipelineError):
    """Nothing arrived from a peer within the deadline."""


class ProtocolError(PipelineError):
    """A message that is not what the pipeline expects at this point."""
