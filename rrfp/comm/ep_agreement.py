"""EP agreement: the members of an expert-parallel group (one pipeline rank's replicas) enter the
all-to-alls of their MoE tasks in one order, while each picks the rest of its tasks by readiness
(docs/design.md, expert parallelism under readiness).

A task issues EP all-to-alls when it is an F or a B of a stage holding a MoE layer (its *class* is
that (kind, stage)); a W and every task of a stage without one issue none, and stay free. A W is
local because the split backward restarts it behind the nodes B ran (rrfp/pipeline/split_backward/),
and the all-to-alls lie on B's path to the stage's input; except on the first stage, whose input
needs no gradient: there B has no path and W runs the whole backward, all-to-alls included, so
under a split backward the first stage's W is a class too (and its B, which a stage that cannot
split runs whole). The members agree on the class of each EP task in turn,
never on its microbatch: tokens of any microbatch may meet at an expert, a forward's all-to-alls
must not meet a backward's, nor one stage's another's.

A round is one MIN all-reduce over a gloo control group of three rows per class: the class offered
(ready and within the budget) on this member, its negation (so MAX: offered somewhere), and the
group's first member's preference (its own policy's pick first; the others send the largest value,
so the MIN is the first member's). The agreed class is the preferred one of those offered
everywhere, the same on every member; with none, the round fails alike everywhere. The all-reduce
is async and awaited through the loop's poller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist

from rrfp.comm.collectives import all_reduce
from rrfp.core.tasks import Kind
from rrfp.loop.completions import CompletionPoller

_NOT_MINE = 2**31 - 1  # a preference only the group's first member states


class EPClass(NamedTuple):
    """The all-to-alls a task issues: those of ``kind`` (F or B) at ``stage``."""

    kind: Kind
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.name}@{self.stage}"


class Outcome(NamedTuple):
    """A round's result, the same on every member: the class agreed (None: no class was offered
    everywhere), and the classes offered somewhere."""

    agreed: EPClass | None
    somewhere: frozenset[EPClass]


class EPAgreement:
    """Agrees on the next EP class over ``group`` (a gloo control group used for nothing else),
    for a rank whose stages holding MoE layers are ``moe_stages``."""

    def __init__(
        self, group, moe_stages: Iterable[int], poller: CompletionPoller, split: bool = False
    ) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.first = dist.get_rank(group) == 0
        self.poller = poller
        self.stages = tuple(sorted(set(moe_stages)))
        kinds = {
            s: (Kind.F, Kind.B, Kind.W) if split and s == 0 else (Kind.F, Kind.B)
            for s in self.stages
        }
        # a fixed order of the classes (a vector slot each), and the tie rule when the first
        # member's own pick is not offered everywhere: B and W before F (they free memory), the
        # later stage first (nearer the loss)
        self.classes = sorted(
            (EPClass(k, s) for s in self.stages for k in kinds[s]),
            key=lambda c: (c.kind is Kind.F, -c.stage, c.kind),
        )
        self._slot = {c: i for i, c in enumerate(self.classes)}
        self.rounds = 0
        self.failed = 0  # rounds that agreed on nothing

    def classify(self, stage: int, kind: Kind) -> EPClass | None:
        """The class of a task, or None for a task that issues no EP collective."""
        c = EPClass(kind, stage)
        return c if c in self._slot else None

    async def agree(self, offered: Iterable[EPClass], preferred: EPClass | None) -> Outcome:
        """One round: ``offered`` the classes this member can run now, ``preferred`` its policy's
        pick among them (read on the first member only)."""
        n = len(self.classes)
        v = torch.full((3, n), 0, dtype=torch.int64)
        for c in offered:
            v[0, self._slot[c]] = 1
        v[1] = -v[0]
        if self.first:
            v[2] = torch.arange(1, n + 1)
            if preferred is not None:
                v[2, self._slot[preferred]] = 0
        else:
            v[2] = _NOT_MINE
        await all_reduce(
            self.poller,
            v,
            f"EP agreement over ranks {self.ranks} (round {self.rounds + 1})",
            dist.ReduceOp.MIN,
            self.group,
        )
        self.rounds += 1
        everywhere = v[0].nonzero().flatten().tolist()
        somewhere = frozenset(self.classes[i] for i in (-v[1]).nonzero().flatten().tolist())
        if not everywhere:
            self.failed += 1
            return Outcome(None, somewhere)
        best = min(everywhere, key=lambda i: int(v[2, i]))
        return Outcome(self.classes[best], somewhere)
