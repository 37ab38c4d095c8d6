"""What a rank's executor runs and in which order, as one object: built once (from a config, or
from keyword arguments at the public edge) and passed whole to ``stage_executor``,
``ScheduleReady`` and the bench, so none of them lists the settings again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import DEFAULT_HINT, Hint, default_split, resolve
from rrfp.core.policy import DEFAULT_DISPATCH, Dispatch
from rrfp.core.variability import Variability
from rrfp.nn.expert_time import ExpertTimes

# the split backward's ways of leaving weight gradients to W that a run may choose (StageWorker's
# weight_split; its "layers" is for experiments only); "auto" is resolved per job
# (``resolve_weight_split``)
WEIGHT_SPLITS = ("auto", "autograd", "functions")
DEFAULT_WEIGHT_SPLIT = "auto"
# schedule.unsplit_stages chosen from the cost model (rrfp.sim.unsplit_choice)
AUTO_UNSPLIT = "auto"


def resolve_weight_split(chosen: str, wider: list[str]) -> tuple[str, str]:
    """The StageWorker mode a job's stages run, and why, for ``chosen`` (a ``WEIGHT_SPLITS``).
    ``wider``: the parallelisms above 1 whose layers the split-aware functions do not cover
    (tensor parallel, FSDP shards, expert parallel). "auto" is "functions", whose B + W costs
    least against the unsplit backward (benchmarks/split_cost.py), unless ``wider`` is not empty:
    then the generic split, which any module's graph gets exactly."""
    if chosen != "auto":
        return chosen, f"schedule.weight_split = {chosen}"
    if wider:
        return "autograd", f"auto: the split-aware functions do not cover {', '.join(wider)}"
    return "functions", "auto: the split-aware functions, the generic split for the rest"


@dataclass(frozen=True)
class ScheduleSettings:
    n_microbatches: int
    dispatch: Dispatch = DEFAULT_DISPATCH  # ready: the best-priority ready task; fixed: hint order
    hint: Hint = field(default_factory=lambda: resolve(DEFAULT_HINT))  # the priority order
    # activations in flight
    budget: Budget = field(default_factory=lambda: Budget.parse(DEFAULT_BUDGET))
    split: bool = True  # B and W apart (``of`` fills in the hint's default)
    variability: Variability = field(default_factory=Variability)  # emulated time's noise
    seed: int = 0  # the noise's seed
    cost: CostModel | None = None  # emulated times from each microbatch's features
    # emulated time of the expert-parallel MoE layers from their routing (rrfp/nn/expert_time.py);
    # None: the preset's draw holds the whole task
    experts: ExpertTimes | None = None
    # ready dispatch with expert parallelism: while a MoE task waits at its all-to-all, the lane
    # runs a ready W that issues no collective beside it (docs/design.md)
    overlap: bool = False
    # how a split backward leaves the weight gradients to W (StageWorker's weight_split)
    weight_split: str = DEFAULT_WEIGHT_SPLIT
    # stages (negative: from the last) whose B runs the whole backward under a split schedule, W
    # nothing (``unsplit_stages_of``)
    unsplit_stages: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        n_microbatches: int,
        *,
        dispatch: Dispatch | str = DEFAULT_DISPATCH,
        hint: Hint | str = DEFAULT_HINT,
        budget: Budget | str | int = DEFAULT_BUDGET,
        split: bool | None = None,
        variability: Variability | None = None,
        seed: int = 0,
        cost: CostModel | None = None,
        experts: ExpertTimes | None = None,
        overlap: bool = False,
        weight_split: str = DEFAULT_WEIGHT_SPLIT,
        unsplit_stages: Sequence[int] = (),
    ) -> ScheduleSettings:
        """The one place strings become settings: a hint name, ``"2x"``, ``"ready"``; ``split``
        None is the hint's default (split for zbh1 and bfw). A bad value is a ValueError."""
        h = resolve(hint)
        split = default_split(h.name, split)
        unsplit = tuple(unsplit_stages)
        if unsplit and not split:
            raise ValueError(
                f"unsplit_stages {list(unsplit)} needs a split backward (split=True, or a hint "
                "that splits): without one no stage splits"
            )
        if weight_split not in WEIGHT_SPLITS:
            raise ValueError(
                f"weight_split must be one of {', '.join(WEIGHT_SPLITS)}, got {weight_split!r}"
            )
        return cls(
            n_microbatches,
            Dispatch.parse(dispatch),
            h,
            Budget.parse(budget),
            split,
            variability or Variability(),
            seed,
            cost,
            experts,
            overlap,
            weight_split,
            unsplit,
        )


def unsplit_stages_of(stages: Sequence[int], num_stages: int) -> frozenset[int]:
    """``stages`` (``ScheduleSettings.unsplit_stages``, negative counting from the last) as stage
    numbers in ``[0, num_stages)``; one out of range, not an int, or named twice is a ValueError.
    Such a stage's B runs its whole backward and its W nothing: the split costs a stage more
    compute than its unsplit backward (docs/design.md, "Which stages split"), which pays only where
    an earlier B fills a bubble, not on the stage that limits the pipeline."""
    out: list[int] = []
    for s in stages:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"unsplit_stages: {s!r} is not a stage number")
        if not -num_stages <= s < num_stages:
            raise ValueError(
                f"unsplit_stages: stage {s} is out of range for {num_stages} stages "
                f"(0..{num_stages - 1}, or -{num_stages}..-1 from the last)"
            )
        out.append(s % num_stages)
    if len(set(out)) != len(out):
        raise ValueError(f"unsplit_stages: {list(stages)} names a stage twice")
    return frozenset(out)
