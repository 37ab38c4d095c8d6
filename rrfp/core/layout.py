"""Where each rank sits in a pp x tp x dp layout.

Every rank computes the same layout from the same numbers, so process groups
can be created in the same order everywhere without talking (docs/design.md, fact 3).
Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (they talk
most), then data-parallel replicas, then pipeline stages:
``rank = pp * (dp_size * tp_size) + dp * tp_size + tp``.

Expert parallelism runs over the DP dimension, as in torchtitan and Megatron-LM: ``ep`` divides
``dp``, and each block of ``ep`` adjacent replicas of a (stage, TP index) is one EP group, whose
members hold different experts of the same layers. What remains of DP (``dp / ep``) replicates
each expert shard: the members at one place of their EP groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Coords(NamedTuple):
    """A rank's pipeline stage, tensor-parallel index and data-parallel replica."""

    pp: int
    tp: int
    dp: int


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` ranks split into pipeline stages, TP ranks and DP replicas."""

    world_size: int
    pp: int
    tp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel replicas: a divisor of dp

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "tp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"layout {name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"layout needs {name} >= 1, got {name}={value}")
        product = self.pp * self.tp * self.dp
        if product != self.world_size:
            raise ValueError(
                f"layout pp={self.pp} x tp={self.tp} x dp={self.dp} = {product} "
                f"does not match world size {self.world_size}"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"layout ep={self.ep} does not divide dp={self.dp}: expert parallelism runs over "
                "the data-parallel replicas"
            )

    def coords(self, rank: int) -> Coords:
        """The (pp, tp, dp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coords(pp, tp, dp)

    def rank_of(self, pp: int, tp: int = 0, dp: int = 0) -> int:
        """The global rank at stage ``pp``, tensor-parallel index ``tp``, replica ``dp``."""
        for name, value, size in (("pp", pp, self.pp), ("tp", tp, self.tp), ("dp", dp, self.dp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} index {value} is outside 0..{size - 1} in {self.short()}")
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def tp_groups(self) -> list[list[int]]:
        """Ranks that share one stage of one replica, ordered by (pp, dp)."""
        return [
            [self.rank_of(p, t, d) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Replicas of one (stage, TP index), ordered by (pp, tp)."""
        return [
            [self.rank_of(p, t, d) for d in range(self.dp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def ep_groups(self) -> list[list[int]]:
        """Blocks of ``ep`` adjacent replicas of one (stage, TP index): one expert-parallel group
        each, ordered by (pp, tp, block)."""
        return [
            [self.rank_of(p, t, d) for d in range(b, b + self.ep)]
            for p in range(self.pp)
            for t in range(self.tp)
            for b in range(0, self.dp, self.ep)
        ]

    def expert_dp_groups(self) -> list[list[int]]:
        """Replicas of one (stage, TP index) at the same place of their EP groups: they hold the
        same experts, whose gradients they sum. Ordered by (pp, tp, place)."""
        return [
            [self.rank_of(p, t, d) for d in range(m, self.dp, self.ep)]
            for p in range(self.pp)
            for t in range(self.tp)
            for m in range(self.ep)
        ]

    def pp_groups(self) -> list[list[int]]:
        """One pipeline each, stages in order, ordered by (dp, tp)."""
        return [
            [self.rank_of(p, t, d) for p in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def short(self) -> str:
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return (
            f"layout pp={self.pp} x tp={self.tp} x dp={self.dp}{ep} (world size {self.world_size})"
        )

    def describe(self) -> str:
        """A rank -> stage/tp/dp table to log or print at start-up."""
        lines = [self.short(), "rank  stage  tp  dp"]
        for rank in range(self.world_size):
            c = self.coords(rank)
            lines.append(f"{rank:4d}  {c.pp:5d}  {c.tp:2d}  {c.dp:2d}")
        return "\n".join(lines)


def layout_for(world: int, pp: int = 0, tp: int = 1, dp: int = 1, ep: int = 1) -> Layout:
    """The one layout planner: ``pp = 0`` means world / (tp * dp). ValueError
    names the numbers that do not fit."""
    if pp == 0 and world % (tp * dp):
        raise ValueError(f"tp={tp} x dp={dp} does not divide world size {world}")
    return Layout(world, pp or world // (tp * dp), tp, dp, ep)
