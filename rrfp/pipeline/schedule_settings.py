"""What a rank's executor runs and in which order, as one object: built once (from a config, or
from keyword arguments at the public edge) and passed whole to ``stage_executor``,
``ScheduleReady`` and the bench, so none of them lists the settings again."""

from __future__ import annotations

from dataclasses import dataclass, field

from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import Hint, default_split, resolve
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability


@dataclass(frozen=True)
class ScheduleSettings:
    microbatches: int
    dispatch: Dispatch = Dispatch.READY  # ready: the best-priority ready task; fixed: hint order
    hint: Hint = field(default_factory=lambda: resolve("bfw"))  # the priority order
    budget: Budget = field(default_factory=lambda: Budget.parse("2x"))  # activations in flight
    split: bool = True  # B and W apart (``of`` fills in the hint's default)
    variability: Variability = field(default_factory=Variability)  # emulated time's noise
    seed: int = 0  # the noise's seed
    cost: CostModel | None = None  # emulated times from each microbatch's features

    @classmethod
    def of(
        cls,
        microbatches: int,
        *,
        dispatch: Dispatch | str = Dispatch.READY,
        hint: Hint | str = "bfw",
        budget: Budget | str | int = "2x",
        split: bool | None = None,
        variability: Variability | None = None,
        seed: int = 0,
        cost: CostModel | None = None,
    ) -> ScheduleSettings:
        """The one place strings become settings: a hint name, ``"2x"``, ``"ready"``; ``split``
        None is the hint's default (split for zbh1 and bfw). A bad value is a ValueError."""
        h = resolve(hint)
        return cls(
            microbatches,
            Dispatch.parse(dispatch),
            h,
            Budget.parse(budget),
            default_split(h.name, split),
            variability or Variability(),
            seed,
            cost,
        )
