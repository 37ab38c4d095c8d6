"""TP agreement: every TP rank of a stage must run the same task sequence,
because the tasks launch collectives (docs/design.md, fact 5).

Each decision all-reduces the stage's ready vector over a TP control group:
MIN gives the tasks ready everywhere, MAX those ready somewhere. One MIN
all-reduce of [v, -v] yields both. The pick is then a deterministic function
of the agreed vector, so every TP rank picks the same task. The all-reduce is
async and awaited through the loop's poller: no thread per round.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from rrfp.comm.collectives import all_reduce
from rrfp.core.tasks import Kind, Task
from rrfp.loop.completions import CompletionPoller


class TPAgreement:
    """Agrees on ready sets over ``group`` (a control group used only for this,
    so it never interleaves with the layers' TP collectives on the lane)."""

    def __init__(self, group, num_microbatches: int, poller: CompletionPoller) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.M = num_microbatches
        self.poller = poller
        self.rounds = 0

    def _vector(self, ready: Iterable[Task]) -> torch.Tensor:
        v = torch.zeros(2, 3 * self.M, dtype=torch.int32)
        for t in ready:
            v[0, int(t.kind) * self.M + t.mb] = 1
        v[1] = -v[0]
        return v

    def _tasks(self, row: torch.Tensor) -> set[Task]:
        return {Task(Kind(i // self.M), i % self.M) for i in row.nonzero().flatten().tolist()}

    async def agree(self, ready: Iterable[Task]) -> tuple[set[Task], set[Task]]:
        """(ready on every TP rank, ready on some TP rank)."""
        v = self._vector(ready)
        await all_reduce(self.poller, v, f"TP agreement over ranks {self.ranks} (round {self.rounds + 1})",
                         dist.ReduceOp.MIN, self.group)
        self.rounds += 1
        return self._tasks(v[0]), self._tasks(-v[1])
