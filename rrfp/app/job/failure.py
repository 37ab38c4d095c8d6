"""One error line per failure: which rank saw it first, and where the traceback went.

When one rank fails, every other rank fails too, a moment later, because its
peer is gone. The error types tell them apart: a ``PeerFailure`` (a dead or
silent peer, a broken group) is secondary, so its line points at the peer;
any other ``PipelineError`` (a protocol error, a corrupt header, a NaN, an
injected fault) or a ``MessageError`` was raised by this rank's own checks and
is primary; an exception raised in the user's code (marked where rrfp calls it,
rrfp/pipeline/user_code.py: ``build_stage``, a stage's forward or backward, the
loss, ``batches``, ``check``) is the user's, and its line names that function;
anything else is an internal error (a bug of rrfp's), said as such. Every
line says where the full traceback is. A secondary line names the rank that
failed first when the failure board (failure_board.py) can tell.
"""

from __future__ import annotations

import os
import re
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rrfp.app.errors import ConfigError, leaves
from rrfp.comm.channels import describe_failure, lost_peer_reason
from rrfp.comm.message import MessageError
from rrfp.core.errors import PeerFailure, PeerSilent, PeerStuck, PipelineError
from rrfp.core.placement import stages_label
from rrfp.pipeline.layout_agreement import LayoutMismatch
from rrfp.pipeline.user_code import WorkloadError, user_code

PRIMARY, SECONDARY, INTERNAL, USER = "primary", "secondary", "internal", "user"


def kind_of(e: BaseException) -> str:
    """A lost peer (even inside the user's forward: a TP layer's collective) is secondary; rrfp's
    own checks are primary; the user's code is the user's; anything else is rrfp's bug."""
    if isinstance(e, PeerFailure) or _lost_transport(e):
        return SECONDARY
    if isinstance(e, (PipelineError, MessageError, ConfigError, LayoutMismatch)):
        return PRIMARY
    if user_code(e) is not None:
        return USER
    return INTERNAL


def user_text(e: BaseException, model: str | None = None) -> str:
    """The user's error as a line names it: the task that called the user's function, which one
    (of which workload, ``model``), the exception and what rrfp passed it. ``e`` is marked
    (``user_code``)."""
    mark = user_code(e)
    assert mark is not None
    text = " ".join(str(e).split())
    task = (
        f"step {mark.iteration + 1}, task {mark.task} (microbatch {mark.task[1:]}): "
        if mark.task
        else ""
    )
    code = f"your code ({model})" if model else "your code"
    if isinstance(e, WorkloadError):  # rrfp's check of what the user's function returned
        said = f"{code}'s {mark.where} {text}"
    else:
        said = f"{code} raised {type(e).__name__} in {mark.where}: {text}"
    return f"{task}{said}" + (f"; {mark.detail}" if mark.detail else "")


def _lost_transport(e: BaseException) -> bool:
    """A gloo or NCCL error that says a peer died or hung, raised where no rrfp wrapper named it (a
    collective a model's own code calls; rrfp's TP layers name theirs inside a task,
    rrfp/pipeline/task_collectives.py): a lost peer, not a bug."""
    text = str(e)
    return (
        type(e) is RuntimeError
        and ("gloo" in text or "NCCL" in text or "nccl" in text)
        and bool(lost_peer_reason(text))
    )


@dataclass(frozen=True)
class Failure:
    """The cause that explains a rank's failure, and how this rank was involved."""

    kind: str
    cause: BaseException

    @classmethod
    def of(cls, e: BaseException) -> Failure:
        """An internal error or this rank's own failure wins over a peer failure it caused
        (the peer's channel fails as a consequence, in the same TaskGroup)."""
        order = {INTERNAL: 0, USER: 1, PRIMARY: 2, SECONDARY: 3}
        best = min(leaves(e), key=lambda leaf: order[kind_of(leaf)])
        if _lost_transport(
            best
        ):  # a collective inside the model (a TP layer's): say so, as a PeerFailure
            task = next(
                (
                    n.removeprefix("rrfp: raised in ")
                    for n in getattr(best, "__notes__", ())
                    if n.startswith("rrfp: raised in ")
                ),
                "the model",
            )
            best = PeerFailure(f"a collective in {task} failed{describe_failure(best)}")
        return cls(kind_of(best), best)

    @property
    def follows_peer(self) -> bool:
        """A secondary failure whose cause is elsewhere: the failure board says where. A silent
        or stuck peer (PeerSilent, PeerStuck) is named by the heartbeat already, and posts nothing
        to wait for."""
        return self.kind == SECONDARY and not isinstance(self.cause, (PeerSilent, PeerStuck))

    @property
    def note(self) -> str:
        """What this rank posts on the failure board (failure_board.py)."""
        if self.kind != SECONDARY:
            return "primary"
        peer = getattr(self.cause, "peer", None)
        return f"secondary {'?' if peer is None else peer}"

    def line(
        self,
        rank: int,
        stage: int | Sequence[int],
        log_path: str,
        debug: bool,
        origin: tuple[int, bool] | None = None,
        model: str | None = None,
    ) -> str:
        """The one line this rank prints (without the ``rrfp: error:`` prefix). ``stage``: what the
        rank holds (several stages with virtual stages). ``origin``: the rank that failed first and
        whether it wrote a line, when the failure board could tell. ``model``: the workload
        (``run.model``), named in a line about the user's code."""
        holds = stages_label((stage,) if isinstance(stage, int) else stage)
        where = "traceback above" if debug else f"traceback in {log_path}"
        if self.kind == USER:
            return f"rank {rank} ({holds}): {user_text(self.cause, model)} ({where})"
        text = " ".join(str(self.cause).split())
        # most causes name their rank already (and, with virtual stages, often the one stage of it)
        text = re.sub(
            rf"^rank {rank}(?: {holds}| (stage \d+))?: ",
            lambda m: f"{m[1]}: " if m[1] else "",
            text,
        )
        if self.kind == INTERNAL:
            text = f"{type(self.cause).__name__}: {text}"
        if isinstance(
            self.cause, (PeerSilent, PeerStuck)
        ):  # the cause itself: the silent or stuck peer, not a chain to follow
            return f"rank {rank}: stopped: {text} ({where})"
        if self.kind == SECONDARY:
            # short: the transport's own text (after the likely reason) stays in the log
            text = re.sub(r"(\((the peer|nothing)[^)]*\)): \w+: .*$", r"\1", text)
            if origin is not None and origin[1]:
                first = f"rank {origin[0]} failed first (see its line)"
            elif origin is not None:
                first = f"rank {origin[0]} left first without a word (killed, or hung)"
            else:
                # that peer may itself have stopped because of another: point at the line that is
                # not "stopped"
                peer = getattr(self.cause, "peer", None)
                who = f"peer rank {peer}" if peer is not None else "another rank"
                first = (
                    f"{who} failed or left first (the cause is on the line without 'stopped', "
                    "if one was written)"
                )
            return f"rank {rank}: stopped: {first}: {text} ({where})"
        if self.kind == INTERNAL:
            return f"rank {rank} ({holds}): internal error, please report it ({where}): {text}"
        return f"rank {rank} ({holds}): {text} ({where})"


def write_traceback(e: BaseException, log_dir: str, rank: int) -> str:
    """Write ``e``'s traceback to LOG_DIR/rank-N.log (a temp dir if that fails); return the path."""
    text = "".join(traceback.format_exception(e))
    for folder in (log_dir, tempfile.gettempdir()):
        path = Path(folder) / f"rank-{rank}.log"
        try:
            os.makedirs(folder, exist_ok=True)
            path.write_text(text)
            return str(path)
        except OSError:
            continue
    return "(nowhere: the log directory is not writable)"
