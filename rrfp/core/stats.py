"""Statistics of a stage's work, with the one bubble formula.

The same record serves one iteration, a run's totals and a sum over ranks;
times are in whatever unit the producer uses (seconds in the runtime,
average forwards in the simulator).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StageStats:
    busy: float = 0.0  # time spent running tasks
    wall: float = 0.0  # time from the iteration's start to its end
    decisions: int = 0  # policy calls
    decision_s: float = 0.0  # seconds spent deciding (TP agreement included)
    peak_inflight: int = 0
    iterations: int = 0

    @property
    def bubble(self) -> float:
        """Idle fraction of the wall time."""
        return max(0.0, 1.0 - self.busy / self.wall) if self.wall > 0 else 0.0

    @property
    def decision_us(self) -> float:
        return 1e6 * self.decision_s / self.decisions if self.decisions else 0.0

    def __add__(self, other: StageStats) -> StageStats:
        return StageStats(
            self.busy + other.busy,
            self.wall + other.wall,
            self.decisions + other.decisions,
            self.decision_s + other.decision_s,
            max(self.peak_inflight, other.peak_inflight),
            self.iterations + other.iterations,
        )

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "bubble": self.bubble, "decision_us": self.decision_us}
