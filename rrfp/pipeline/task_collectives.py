"""A task's collectives (a TP layer's all-reduce) as waits its peers can see, and their failure as
one line that names the collective and the peer that never reached it.

A TP collective runs inside a task, on the compute lane's thread, where the runtime's watcher does
not look; its group's own timeout bounds it (``timeouts.progress_s`` with a heartbeat, the process
group's timeout without). Meanwhile this rank's heartbeat says ``at the row-parallel all-reduce of
h.0.attn.c_proj in task F3 of stage 1`` (the executor installs ``marker`` around each task:
rrfp/nn/collective_marks.py). When gloo ends the wait, the TP peers whose heartbeat does not say
the same never reached it: one PeerStuck line names them, with what their heartbeat says, and the
key that set the bound. The watcher's own rule could not name them: a peer inside a task counts
as progress of the job (rrfp/comm/heartbeat.py), and here a TP peer in the same task but not at
its collective is exactly the stuck one. So only the rank that waited there blames, and only the
members of that collective's group.

Without a heartbeat the line says what timed out and the bound, and names no one: nothing then
tells a stuck peer from one still computing. A collective that fails because a peer died is one
PeerFailure line naming the collective; any other error of the collective is left as it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch.nn as nn

from rrfp.comm.channels import describe_failure, lost_peer_reason, timed_out
from rrfp.comm.collective_wait import AT, Unreached, absent_from, peers_of, stuck
from rrfp.comm.heartbeat import Heartbeat
from rrfp.core.errors import PeerFailure, PeerTimeout, PipelineError
from rrfp.core.tasks import Task
from rrfp.nn.collective_marks import Marker


class TaskCollectives:
    """This rank's markers for the collectives its tasks' layers issue. ``bound``: the timeout of
    their groups as a line says it (``timeouts.progress_s = 4 s``)."""

    def __init__(self, rank: int, heartbeat: Heartbeat | None, bound: str) -> None:
        self.rank, self.heartbeat, self.bound = rank, heartbeat, bound
        self._names: dict[int, dict[int, str]] = {}  # id(stage module) -> {id(layer): its name}

    def marker(self, task: Task, stage: int, module: nn.Module) -> Marker:
        """The marker for ``task`` of ``stage``, whose layers are in ``module``."""
        names = self._names.get(id(module))
        if names is None:
            names = self._names[id(module)] = {id(m): n for n, m in module.named_modules() if n}

        def mark(what: str, layer: nn.Module, group) -> contextlib.AbstractContextManager:
            name = names.get(id(layer), type(layer).__name__)
            return self.at(f"the {what} of {name} in task {task} of stage {stage}", group)

        return mark

    @contextlib.contextmanager
    def at(self, what: str, group) -> Iterator[None]:
        """This rank waits at the collective ``what`` over ``group`` meanwhile; its failure for a
        hung or dead peer is one line (``failed``)."""
        hb = self.heartbeat
        before = hb.activity if hb is not None else ""
        if hb is not None:
            hb.doing(AT + what)
        began = time.monotonic()
        try:
            yield
        except PipelineError:
            raise
        except RuntimeError as e:
            if not lost_peer_reason(str(e)):
                raise  # not a peer's doing (a shape mismatch, a bug): as it is
            raise self.failed(what, peers_of(group), e, time.monotonic() - began) from e
        finally:
            if hb is not None and hb.activity == AT + what:
                hb.doing(before)

    def failed(
        self, what: str, peers: tuple[int, ...], error: BaseException, waited: float
    ) -> PeerFailure:
        """The line for the collective ``what`` with ``peers`` that ``error`` ended after
        ``waited`` seconds: the peers not at it, named from their heartbeats, when it timed out."""
        lone = peers[0] if len(peers) == 1 else None
        if not timed_out(str(error)):  # a peer died
            return PeerFailure(f"rank {self.rank}: {what} failed{describe_failure(error)}", lone)
        hb = self.heartbeat
        if hb is None:
            members = " and ".join(f"rank {p}" for p in peers)
            return PeerTimeout(
                f"rank {self.rank}: {what}: not completed in {waited:.1f} s ({self.bound}) with "
                f"{members}: a peer stuck, too slow, gone or at another collective (no heartbeat "
                "to tell which)"
            )
        late = Unreached(what, absent_from(hb, what, peers), waited)
        return stuck(self.rank, hb, late, self.bound)
