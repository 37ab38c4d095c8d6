"""What a job of ranks writes on stderr: each line in one write, and bad input once.

Every rank checks the command line, the config and the checkpoint itself, so
bad input fails every rank alike; printed by each, a 4-rank job said it four
times. Global rank 0 prints such a refusal and posts its text on the
rendezvous store (``failure_board.py``). Another rank stays silent when rank
0 posted the same text, and prints its own line when rank 0 posted another
text or nothing within ``REFUSAL_WAIT_S`` (a file only that rank cannot read;
a rank 0 that passed). Before any process group the store exists only under
torchrun (its agent's); without one, every rank prints.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

REFUSAL_WAIT_S = 10.0  # rank 0 may check for longer (a loaded machine, a big checkpoint)


def say(line: str) -> None:
    """``line`` and its newline on stderr in one write call, which reaches the file as one
    write(2), so the lines of ranks that share a terminal or a pipe never run together
    (``print`` writes the text and the newline apart, two write(2)s when stderr is
    unbuffered, as under ``python -u``)."""
    sys.stderr.write(line.rstrip("\n") + "\n")
    sys.stderr.flush()


def rank_and_world() -> tuple[int, int]:
    """This process's (global rank, world size) from the launcher's env; (0, 1) without one."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def tell_torchrun(line: str) -> None:
    """Leave ``line`` in the error file torchrun's agent gave this rank (TORCHELASTIC_ERROR_FILE),
    so that the agent's failure summary shows rrfp's line where it would say "To enable traceback
    see ...". The format is what torch.distributed.elastic's ProcessFailure reads: a message with
    a ``py_callstack`` (shown) and a ``timestamp`` (which rank failed first). Best effort: the
    line is printed anyway."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass


def refuse_once(text: str, line: str, board=None) -> None:
    """Print ``line``, this rank's line for a refusal whose text is ``text``, unless rank 0
    says the same for the job. ``board``: a FailureBoard already connected, if any."""
    tell_torchrun(line)
    rank, world = rank_and_world()
    if world > 1 and board is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from rrfp.app.job.failure_board import FailureBoard  # imports torch: only when it can help

        # the agent's store outlives the ranks: a loaded machine, not a gone store, is what keeps
        # a client from connecting at once, so connecting gets the refusal's own bound
        board = FailureBoard.connect(timeout_s=REFUSAL_WAIT_S)
    if board is not None:
        # torchrun's agent SIGTERMs every rank once one has exited: each still ends with its
        # line written (or known to be rank 0's) and exit code 2, not killed by the signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if rank == 0 or world <= 1 or board is None:
        say(line)
        if rank == 0 and board is not None:
            board.post_refusal(text, REFUSAL_WAIT_S)
        return
    if board.refusal(REFUSAL_WAIT_S) != text:
        say(line)
