"""Hints: a priority over one stage's tasks, from a classic schedule or a class rule.

A hint is an order over the stage's tasks; ready dispatch runs the ready task
of best priority, fixed dispatch runs them in exactly this order.
Every hint validates itself: each task once, and F before B before W per
microbatch.
"""

from __future__ import annotations

import csv
import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.nominal import nominal_orders, nominal_rank_orders
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch, merge_local_priorities
from rrfp.core.rank_tracker import RankSpec
from rrfp.core.tasks import Kind, Task, stage_tasks
from rrfp.core.tracker import StageSpec
from rrfp.core.virtual_orders import VIRTUAL_SCHEDULES

HintFn = Callable[[int, int, int, bool], Sequence["Task | str"]]
"""(num_stages, stage, n_microbatches, split) -> the stage's task order."""
RankHintFn = Callable[[VirtualLayout, int, int, bool], Sequence[tuple[int, Task]]]
"""(layout, rank, n_microbatches, split) -> the rank's order over (stage, task) pairs."""


class HintError(ValueError):
    """A hint that is unknown or not a valid order of a stage's tasks."""


def _backward(m: int, split: bool) -> list[Task]:
    return [Task(Kind.B, m), Task(Kind.W, m)] if split else [Task(Kind.B, m)]


def gpipe(S: int, s: int, M: int, split: bool) -> list[Task]:
    """All forwards, then all backwards (each W right after its B)."""
    return [Task(Kind.F, m) for m in range(M)] + [t for m in range(M) for t in _backward(m, split)]


def one_f_one_b(S: int, s: int, M: int, split: bool) -> list[Task]:
    """min(S-s-1, M) warm-up forwards, then F/B alternating, then the cool-down."""
    warmup = min(S - s - 1, M)
    order = [Task(Kind.F, m) for m in range(warmup)]
    for i, f in enumerate(range(warmup, M)):
        order.append(Task(Kind.F, f))
        order += _backward(i, split)
    for b in range(M - warmup, M):
        order += _backward(b, split)
    return order


def bf(S: int, s: int, M: int, split: bool) -> list[Task]:
    """Class priority: every backward before every forward, each by microbatch."""
    return [t for m in range(M) for t in _backward(m, split)] + [Task(Kind.F, m) for m in range(M)]


def bfw(S: int, s: int, M: int, split: bool) -> list[Task]:
    """Class priority: B, then F, then W (W only exists with a split backward)."""
    return bfw_ranked(range(M), split)


def bfw_ranked(microbatches: Iterable[int], split: bool) -> list[Task]:
    """B, then F, then W, each kind in the given microbatch order (the planner's entry order)."""
    order = [Task(Kind.B, m) for m in microbatches] + [Task(Kind.F, m) for m in microbatches]
    return order + ([Task(Kind.W, m) for m in microbatches] if split else [])


def zbh1(S: int, s: int, M: int, split: bool) -> list[Task]:
    """Zero-bubble H1: 1F1B's warm-up and peak in-flight count, W deferred into waits.

    It is the nominal order of the BFW priority under 1F1B's budget (S - s):
    B first, F while memory allows, and W fills the slots where neither can
    run, which is mostly the cool-down. Without a split backward it is 1F1B.
    """
    if not split:
        return one_f_one_b(S, s, M, split)
    return list(nominal_orders(bfw, S, M, split, 1.0)[s])


def zbv_stage(S: int, s: int, M: int, split: bool) -> list[Task]:
    """ZB-V is an order over a rank's two stages: it has no one-stage form."""
    raise HintError(
        "hint zbv is an order over virtual stages: it needs virtual = 2 and placement v"
    )


BUILTIN: dict[str, HintFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zbh1": zbh1,
    "bf": bf,
    "bfw": bfw,
}
DEFAULT_HINT = "bfw"  # every default priority order: B first, then F, W when nothing else
VIRTUAL_ONLY: dict[str, HintFn] = {"zbv": zbv_stage}  # orders over virtual stages alone
SPLIT_BY_DEFAULT = {"zbh1", "bfw", "plan", "zbv"}
CLASS_HINTS = {"bf", "bfw"}


def gpipe_virtual(layout: VirtualLayout, rank: int, M: int, split: bool) -> list[tuple[int, Task]]:
    """GPipe over a rank's stages: every forward (earlier stage first, each by microbatch), then
    every backward (later stage first, each by microbatch), each W right after its B."""
    stages = layout.stages_of(rank)
    fwd = [(s, Task(Kind.F, m)) for s in stages for m in range(M)]
    return fwd + [(s, t) for s in reversed(stages) for m in range(M) for t in _backward(m, split)]


RANK_BUILTIN: dict[str, RankHintFn] = {**VIRTUAL_SCHEDULES, "gpipe": gpipe_virtual}


def default_split(name: str, split: bool | None = None) -> bool:
    """A split backward where asked for; otherwise the hints that exist to move W
    get one and the others keep B whole."""
    if split is not None:
        return split
    return name in SPLIT_BY_DEFAULT


def validate(order: Sequence[Task], M: int, split: bool, where: str = "hint") -> None:
    """Every task of the stage exactly once; F before B before W per microbatch."""
    expected = set(stage_tasks(M, split))
    seen: dict[Task, int] = {}
    for i, t in enumerate(order):
        if t not in expected:
            raise HintError(f"{where}: task {t} does not exist with M={M}, split={split}")
        if t in seen:
            raise HintError(f"{where}: task {t} appears twice")
        seen[t] = i
    missing = sorted(expected - seen.keys())
    if missing:
        names = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise HintError(f"{where}: missing {len(missing)} task(s): {names}")
    for m in range(M):
        if seen[Task(Kind.B, m)] < seen[Task(Kind.F, m)]:
            raise HintError(f"{where}: B{m} comes before F{m}")
        if split and seen[Task(Kind.W, m)] < seen[Task(Kind.B, m)]:
            raise HintError(f"{where}: W{m} comes before B{m}")


def validate_rank(
    order: Sequence[tuple[int, Task]],
    layout: VirtualLayout,
    rank: int,
    M: int,
    split: bool,
    where: str = "hint",
) -> None:
    """Every pair on one of the rank's stages, and each stage's tasks a valid order
    (``validate``)."""
    stages = layout.stages_of(rank)
    for s, t in order:
        if s not in stages:
            raise HintError(
                f"{where}: {t} of stage {s} is not on rank {rank}, which holds stages "
                f"{', '.join(map(str, stages))}"
            )
    for s in stages:
        validate([t for st, t in order if st == s], M, split, where=f"{where} stage {s}")


def peak_in_flight(order: Sequence[Task], split: bool) -> int:
    """Most microbatches ``order`` holds activations for at once: F started, last backward not done
    (what fixed dispatch needs, since it follows the order whatever the budget)."""
    last = Kind.W if split else Kind.B
    held = peak = 0
    for t in order:
        held += (t.kind is Kind.F) - (t.kind is last)
        peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Hint:
    """A named hint.

    ``priority`` is what ready dispatch compares (lower first); ``order`` is
    what fixed dispatch follows. For a schedule hint (gpipe, 1f1b, zbh1, user orders) they
    are the same list. A class hint (bf, bfw) ranks by kind, which is no
    executable order (B0 ranks above F0), so its ``order`` is the nominal one:
    what ready does with it when every task takes its average time.
    """

    name: str
    fn: HintFn
    is_class: bool = False
    # "plan": rebuilt for every iteration from its predicted costs (rrfp.core.entry_order)
    planned: bool = False
    # ranks every stage's tasks alike (bf, bfw, plan): the simulator's fast path may run it
    uniform: bool = False
    rank_fn: RankHintFn | None = (
        None  # its order over a rank's virtual stages (V > 1), if it has one
    )
    # what fixed dispatch follows, per rank over its (stage, task) pairs (a plan's, the oracle's);
    # with V = 1 a rank's pairs are its one stage's order
    fixed_rank_orders: tuple[tuple[tuple[int, Task], ...], ...] | None = None

    def order(self, S: int, s: int, M: int, split: bool) -> list[Task]:
        if self.fixed_rank_orders is not None:
            tasks = [t for pairs in self.fixed_rank_orders for st, t in pairs if st == s]
        elif self.is_class:
            tasks = list(nominal_orders(self.fn, S, M, split, NOMINAL_BUDGET)[s])
        else:
            tasks = [
                t if isinstance(t, Task) else Task.parse(str(t)) for t in self.fn(S, s, M, split)
            ]
        validate(tasks, M, split, where=f"hint {self.name} stage {s}")
        return tasks

    def rank_order(
        self, layout: VirtualLayout, rank: int, M: int, split: bool
    ) -> list[tuple[int, Task]]:
        """What fixed dispatch follows on ``rank``: an order over its (stage, task) pairs. With
        V = 1 it is ``order`` on the rank's one stage."""
        if layout.virtual == 1:
            return [(rank, t) for t in self.order(layout.ranks, rank, M, split)]
        where = f"hint {self.name} rank {rank}"
        if self.fixed_rank_orders is not None:
            pairs = list(self.fixed_rank_orders[rank])
        elif self.is_class:
            pairs = list(nominal_rank_orders(self.fn, layout, M, split, NOMINAL_BUDGET)[rank])
        elif self.rank_fn is not None:
            try:
                pairs = [
                    (int(s), t if isinstance(t, Task) else Task.parse(str(t)))
                    for s, t in self.rank_fn(layout, rank, M, split)
                ]
            except ValueError as e:
                raise HintError(f"{where}: {e}") from None
        else:
            raise HintError(
                f"hint {self.name} has no order over virtual stages (virtual = {layout.virtual}); "
                f"use {', '.join(VIRTUAL_SCHEDULES)}, gpipe, bf, bfw, plan or a stage,task CSV file"
            )
        validate_rank(pairs, layout, rank, M, split, where)
        return pairs

    def check_layout(self, layout: VirtualLayout, M: int, split: bool) -> None:
        """HintError unless every rank of ``layout`` has an order under this hint (zbh1 has none
        over virtual stages, zbv none at V = 1, a CSV file may lack a stage's rows): what the ranks
        would otherwise find only once they build their specs. A class rule ranks any stage's
        tasks."""
        if self.is_class:
            return
        for rank in range(layout.ranks):
            try:
                self.rank_order(layout, rank, M, split)
            except HintError:
                raise
            except Exception as e:  # a user's function (module:function) that cannot make the order
                raise HintError(f"hint {self.name} rank {rank}: {type(e).__name__}: {e}") from None

    def rank_peak(self, layout: VirtualLayout, rank: int, M: int, split: bool) -> int:
        """Most local-stage microbatches fixed dispatch holds on ``rank`` (``peak_in_flight`` of its
        rank order): what it needs, since it applies no budget."""
        return peak_in_flight([t for _, t in self.rank_order(layout, rank, M, split)], split)

    def rank_priority(
        self, layout: VirtualLayout, rank: int, M: int, split: bool
    ) -> dict[tuple[int, Task], int]:
        """What ready dispatch compares on ``rank`` (lower first), over (stage, task) pairs. A class
        hint ranks each stage's tasks by its own rule, and across the rank's stages by place in that
        rule, then the later stage first (``merge_local_priorities``); with V = 1 that is
        ``priority``."""
        if not self.is_class:
            return {p: i for i, p in enumerate(self.rank_order(layout, rank, M, split))}
        S = layout.num_stages
        return merge_local_priorities(
            {s: self.priority(S, s, M, split) for s in layout.stages_of(rank)}
        )

    def rank_spec(
        self,
        layout: VirtualLayout,
        rank: int,
        M: int,
        split: bool,
        dispatch: Dispatch,
        budget: Budget,
    ) -> RankSpec:
        """Everything ``rank`` needs to track an iteration over its stages under this hint and
        budget (``Budget.rank_limit``). With V = 1 it carries ``spec``'s order and limit, and its
        priority in the same order."""
        limit = budget.rank_limit(layout, rank)
        if self.is_class and dispatch is Dispatch.READY:
            return RankSpec(
                layout,
                rank,
                M,
                split,
                dispatch,
                self.rank_priority(layout, rank, M, split),
                (),
                limit,
            )
        order = tuple(self.rank_order(layout, rank, M, split))
        prio = (
            self.rank_priority(layout, rank, M, split)
            if self.is_class
            else {p: i for i, p in enumerate(order)}
        )
        return RankSpec(layout, rank, M, split, dispatch, prio, order, limit)

    def priority(self, S: int, s: int, M: int, split: bool) -> dict[Task, int]:
        if not self.is_class:
            return {t: i for i, t in enumerate(self.order(S, s, M, split))}
        prio = {t: i for i, t in enumerate(self.fn(S, s, M, split))}
        if prio.keys() != set(stage_tasks(M, split)) or len(prio) != len(stage_tasks(M, split)):
            raise HintError(f"hint {self.name} stage {s}: does not rank every task exactly once")
        return cast(dict[Task, int], prio)  # the check above leaves only Tasks

    def spec(
        self, S: int, s: int, M: int, split: bool, dispatch: Dispatch, budget: Budget
    ) -> StageSpec:
        """Everything stage ``s`` needs to track an iteration under this hint. Ready dispatch
        with a class hint needs no order, so none is built (it costs a nominal run)."""
        if self.is_class and dispatch is Dispatch.READY:
            return StageSpec(
                S, s, M, split, dispatch, self.priority(S, s, M, split), (), budget.limit(S, s)
            )
        order = self.order(S, s, M, split)
        prio = (
            {t: i for i, t in enumerate(order)}
            if not self.is_class
            else self.priority(S, s, M, split)
        )
        return StageSpec(S, s, M, split, dispatch, prio, order, budget.limit(S, s))


# class hints' fixed order assumes the default budget: its multiple of 1F1B's in-flight count
NOMINAL_BUDGET = cast(float, Budget.parse(DEFAULT_BUDGET).multiple)


def csv_rows(path: str | Path, what: str) -> list[list[str]]:
    """The rows of the CSV file at ``path``; an unreadable file is a HintError naming ``what`` it
    is."""
    try:
        return list(csv.reader(Path(path).read_text().splitlines()))
    except OSError as e:
        raise HintError(f"{what} {path}: {e.strerror}") from None


def csv_hint(path: str | Path) -> Hint:
    """A user hint from CSV rows ``stage,task`` in order (a header row is allowed)."""
    path = Path(path)
    per_stage: dict[int, list[Task]] = {}
    rows: list[tuple[int, Task]] = []  # in file order: a rank's order over its stages
    for lineno, row in enumerate(csv_rows(path, "hint file"), start=1):
        row = [c.strip() for c in row]
        if not row or not any(row) or row[0].startswith("#"):
            continue
        if lineno == 1 and row[0].lower() == "stage":
            continue
        if len(row) != 2:
            raise HintError(
                f"hint file {path}:{lineno}: expected 'stage,task', got {','.join(row)!r}"
            )
        try:
            stage = int(row[0])
            task = Task.parse(row[1])
        except ValueError as e:
            raise HintError(f"hint file {path}:{lineno}: {e}") from None
        if stage < 0:
            raise HintError(f"hint file {path}:{lineno}: stage {stage} is negative")
        per_stage.setdefault(stage, []).append(task)
        rows.append((stage, task))

    def order(S: int, s: int, M: int, split: bool) -> list[Task]:
        if s not in per_stage:
            raise HintError(f"hint file {path}: no rows for stage {s} of {S}")
        return per_stage[s]

    def rank_order(layout: VirtualLayout, rank: int, M: int, split: bool) -> list[tuple[int, Task]]:
        stages = layout.stages_of(rank)
        for s in stages:
            if s not in per_stage:
                raise HintError(f"hint file {path}: no rows for stage {s} of {layout.num_stages}")
        return [(s, t) for s, t in rows if s in stages]

    return Hint(f"csv:{path.name}", order, rank_fn=rank_order)


def resolve(spec: str | Hint | HintFn) -> Hint:
    """A builtin name, a ``.csv`` path, ``module:function``, or a callable."""
    if isinstance(spec, Hint):
        return spec
    if callable(spec):
        return Hint(getattr(spec, "__name__", "user"), spec)
    name = str(spec).strip()
    if name.lower() == "plan":  # BFW until a planner gives it this iteration's entry order
        return Hint("plan", bfw, is_class=True, planned=True, uniform=True)
    if name.lower() in BUILTIN or name.lower() in VIRTUAL_ONLY:
        is_class = name.lower() in CLASS_HINTS
        fn = BUILTIN.get(name.lower()) or VIRTUAL_ONLY[name.lower()]
        return Hint(
            name.lower(),
            fn,
            is_class=is_class,
            uniform=is_class,
            rank_fn=RANK_BUILTIN.get(name.lower()),
        )
    if name.lower().endswith(".csv"):
        return csv_hint(name)
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise HintError(f"hint {name!r}: cannot load {attr} from {mod}: {e}") from None
        if not callable(fn):
            raise HintError(f"hint {name!r} is not callable")
        return Hint(name, fn)
    raise HintError(
        f"unknown hint {name!r} (choose from {', '.join(BUILTIN)}, plan, zbv, a .csv file or "
        "module:function)"
    )
