"""Virtual stages: which of the S x V global stages each of the S pipeline ranks holds.

A rank holds V local stages ("virtual stages") so the pipeline fills and
drains in local-stage-sized steps. ``interleaved`` (Megatron, torch's
ScheduleInterleaved1F1B): rank r holds r, r+S, r+2S, ... ``v`` (ZB-V,
DualPipeV; V = 2 only): rank r holds r and 2S-1-r, so the last rank holds
S-1 and S, and that turn is local: no message. V = 1 is the plain pipeline.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Placement(enum.StrEnum):
    """How a rank's V stages sit in the global stage order."""

    INTERLEAVED = "interleaved"
    V = "v"

    @classmethod
    def parse(cls, spec: str | Placement) -> Placement:
        try:
            return cls(str(spec).strip().lower()) if not isinstance(spec, Placement) else spec
        except ValueError:
            raise ValueError(f"unknown placement {spec!r} (choose from interleaved, v)") from None


@dataclass(frozen=True)
class VirtualLayout:
    """S ranks x V stages per rank; global stages 0..S*V-1 in model order."""

    ranks: int
    virtual: int = 1
    placement: Placement | str = Placement.INTERLEAVED

    def __post_init__(self) -> None:
        for name in ("ranks", "virtual"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"virtual layout needs {name} >= 1, got {value!r}")
        object.__setattr__(self, "placement", Placement.parse(self.placement))
        if self.placement is Placement.V and self.virtual != 2:
            raise ValueError(
                "placement v needs exactly 2 stages per rank (virtual = 2), "
                f"got virtual = {self.virtual}"
            )

    @property
    def num_stages(self) -> int:
        return self.ranks * self.virtual

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages ``rank`` holds, in model order (its local stage 0 first)."""
        S = self.ranks
        if not 0 <= rank < S:
            raise ValueError(f"rank {rank} is outside 0..{S - 1}")
        if self.placement is Placement.V:
            return (rank, 2 * S - 1 - rank)
        return tuple(rank + c * S for c in range(self.virtual))

    def rank_of(self, stage: int) -> int:
        """The rank that holds global ``stage``."""
        S = self.ranks
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside 0..{self.num_stages - 1}")
        if self.placement is Placement.V and stage >= S:
            return 2 * S - 1 - stage
        return stage % S

    def local_index(self, stage: int) -> int:
        """Which of its rank's V stages ``stage`` is (0: the one nearest the model's input)."""
        return stage // self.ranks

    def leads(self, rank: int) -> tuple[int, ...]:
        """How many stages a microbatch crosses from each of ``rank``'s local stages to its next:
        the most forwards local stage c may run ahead of local stage c + 1 there (RankTracker). Of
        one microbatch's way from local stage c to c + 1, the rank can fill that many forward slots
        and no more, so a further forward of local stage c only delays the next local stage's
        forward that is in flight to the rank."""
        stages = self.stages_of(rank)
        return tuple(b - a for a, b in zip(stages, stages[1:]))

    def is_local(self, a: int, b: int) -> bool:
        """Stages ``a`` and ``b`` sit on one rank: what passes between them is no message."""
        return self.rank_of(a) == self.rank_of(b)

    def describe(self) -> str:
        return (
            f"{self.ranks} rank(s) x {self.virtual} stage(s) per rank ({self.placement}): "
            + "; ".join(
                f"rank {r}: {', '.join(map(str, self.stages_of(r)))}" for r in range(self.ranks)
            )
        )


def stages_label(stages: Iterable[int]) -> str:
    """``stage 3`` or ``stages 3, 4``: how errors and logs name what a rank holds."""
    stages = tuple(stages)
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
