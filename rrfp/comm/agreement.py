"""TP agreement: every TP rank of a stage must run the same task sequence,
because the tasks launch collectives (docs/design.md, fact 5).

Each decision all-reduces the stage's ready vector over a TP control group:
MIN gives the tasks ready everywhere, MAX those ready somewhere. One MIN
all-reduce of [v, -v] yields both. The pick is then a deterministic function
of the agreed vector, so every TP rank picks the same task. The all-reduce is
async and awaited through the loop's poller: no thread per round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from rrfp.comm.collectives import all_reduce
from rrfp.core.rank_tracker import StageTask
from rrfp.core.tasks import Kind, Task
from rrfp.loop.completions import CompletionPoller


class TPAgreement:
    """Agrees on ready sets over ``group`` (a control group used only for this,
    so it never interleaves with the layers' TP collectives on the lane).
    With virtual stages (``stages``: the rank's global stages) the ready sets hold
    (stage, task) pairs, one vector slot each."""

    def __init__(
        self,
        group,
        n_microbatches: int,
        poller: CompletionPoller,
        stages: Sequence[int] | None = None,
    ) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.M = n_microbatches
        self.poller = poller
        self.stages = tuple(stages) if stages is not None else None
        self._local = {
            s: c for c, s in enumerate(self.stages or ())
        }  # global stage -> its slot block
        self.rounds = 0

    def _slot(self, item) -> int:
        if self.stages is None:
            return int(item.kind) * self.M + item.mb
        stage, t = item
        return (self._local[stage] * 3 + int(t.kind)) * self.M + t.mb

    def _item(self, i: int):
        local, rest = divmod(i, 3 * self.M)
        task = Task(Kind(rest // self.M), rest % self.M)
        return task if self.stages is None else StageTask(self.stages[local], task)

    def _vector(self, ready: Iterable) -> torch.Tensor:
        v = torch.zeros(2, 3 * self.M * len(self.stages or (0,)), dtype=torch.int32)
        for item in ready:
            v[0, self._slot(item)] = 1
        v[1] = -v[0]
        return v

    def _tasks(self, row: torch.Tensor) -> set:
        return {self._item(i) for i in row.nonzero().flatten().tolist()}

    async def agree(self, ready: Iterable) -> tuple[set, set]:
        """(ready on every TP rank, ready on some TP rank)."""
        v = self._vector(ready)
        await all_reduce(
            self.poller,
            v,
            f"TP agreement over ranks {self.ranks} (round {self.rounds + 1})",
            dist.ReduceOp.MIN,
            self.group,
        )
        self.rounds += 1
        return self._tasks(v[0]), self._tasks(-v[1])
