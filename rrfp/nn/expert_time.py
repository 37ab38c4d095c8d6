"""Emulated device time of a MoE layer's experts and all-to-alls, from what its router routed.

Where the runtime emulates device time (a CPU lane holding each task for its drawn duration), a
preset's draw cannot know the routing: the router decides at run time how many token copies each
expert-parallel member computes, and an all-to-all ends when its slowest member reaches it. So
whoever runs a task installs an ``ExpertClock`` on the computing thread for the task's span
(``clocked``), and ``ExpertParallel`` spends, on this thread, between its collectives:

- the experts' time, in proportion to the copies this member's experts received
  (``experts(rows)``): each member sleeps its own load, and the combine all-to-all that follows
  waits for the busiest member, so every member's task lasts as long as the busiest one's experts;
- each row all-to-all's transfer time, in proportion to the rows (of one width: bytes) this member
  sends to or receives from the others, the larger of the two (``link(rows)``), then the
  collective itself.

With ``window`` (the lane's ``yielding``), the transfer and the collective run as a wait that
leaves the device to other work: the lane may compute another ready task meanwhile (one that
issues no collective of the group), and the task goes on once its rows are back and that task
is done.

Both are in units of the task's own kind (``ExpertTimes``): at balanced routing of the reference
microbatch the experts take ``expert_share`` of the task and the all-to-alls ``link_share``; the
rest of the task (its dense part) stays with the preset's draw. ``spent_s`` is the wall time the
task spent in these blocks, collectives included: the lane holds the task for its dense part plus
that. Without a clock (a layer used outside rrfp's executor) nothing is spent; in real compute
(``times`` None) a clock only opens the window.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

_CLOCK: contextvars.ContextVar[ExpertClock | None] = contextvars.ContextVar(
    "rrfp_expert_clock", default=None
)


@dataclass(frozen=True)
class ExpertTimes:
    """How a task of a stage with MoE layers divides, at balanced routing of a microbatch that
    sends ``rows`` token copies (tokens x top_k): ``expert_share`` of it in the routed experts,
    ``link_share`` in the row all-to-alls (dispatch and combine), summed over the stage's MoE
    layers; the rest is the dense part."""

    rows: float
    expert_share: float = 0.4
    link_share: float = 0.1

    def __post_init__(self) -> None:
        if not self.rows > 0:
            raise ValueError(f"ExpertTimes rows={self.rows} must be > 0 (a microbatch's copies)")
        for name in ("expert_share", "link_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"ExpertTimes {name}={getattr(self, name)} must be in [0, 1]")
        if self.expert_share + self.link_share > 1:
            raise ValueError(
                f"ExpertTimes expert_share + link_share = "
                f"{self.expert_share + self.link_share:g} exceeds the whole task (1)"
            )

    @property
    def dense_share(self) -> float:
        """The part of a task the preset's draw keeps."""
        return 1.0 - self.expert_share - self.link_share


@dataclass
class ExpertClock:
    """One task's emulated MoE time: ``task_s`` seconds is the task's kind at its mean (one unit
    of F, of B ...), ``layers`` the MoE layers its stage holds, each called once per task."""

    times: ExpertTimes | None  # None: real compute, nothing emulated
    task_s: float
    layers: int
    window: Callable[[], contextlib.AbstractContextManager] | None = None  # around each wait
    spent_s: float = 0.0  # wall time in the blocks below, collectives included
    log: list[tuple[str, float, float]] = field(default_factory=list)  # (what, rows, seconds)

    def held_s(self, drawn_s: float) -> float:
        """How long the task holds the lane whose draw was ``drawn_s`` seconds: its dense part
        and the time spent here, when it ran MoE layers; else the draw alone (a W that runs
        none)."""
        if self.times is None or not self.log:
            return drawn_s
        return drawn_s * self.times.dense_share + self.spent_s

    def experts(self, rows: float) -> None:
        """This member's experts compute ``rows`` copies: sleep their share of the task."""
        if self.times is None:
            return
        s = self.task_s * self.times.expert_share / self.layers * rows / self.times.rows
        self.log.append(("experts", rows, s))
        began = time.perf_counter()
        time.sleep(s)
        self.spent_s += time.perf_counter() - began

    @contextlib.contextmanager
    def link(self, rows: float, members: int) -> Iterator[None]:
        """Around a row all-to-all over ``members`` that moves ``rows`` to or from the others:
        their transfer time first, then the collective (which waits for the slowest member); in
        the window, when there is one."""
        s = 0.0
        if self.times is not None:  # at balance a member keeps 1/n of its copies, sends the rest
            balanced = self.times.rows * (members - 1) / members
            s = self.task_s * self.times.link_share / (2 * self.layers) * rows / balanced
            self.log.append(("link", rows, s))
        began = time.perf_counter()
        try:
            with self.window() if self.window is not None else contextlib.nullcontext():
                time.sleep(s)
                yield
        finally:
            self.spent_s += time.perf_counter() - began


@contextlib.contextmanager
def clocked(clock: ExpertClock | None) -> Iterator[ExpertClock | None]:
    """The MoE layers this thread runs meanwhile spend their emulated time on ``clock``."""
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


def current() -> ExpertClock | None:
    """The clock installed on this thread, or None (nothing is emulated)."""
    return _CLOCK.get()
