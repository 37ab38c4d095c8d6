"""Hints: a priority over one stage's tasks, from a classic schedule or a class rule.

A hint is an order over the stage's tasks; ready dispatch runs the ready task
of best priority, fixed dispatch runs them in exactly this order.
Every hint validates itself: each task once, and F before B before W per
microbatch.
"""
from __future__ import annotations

import csv
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from rrfp.core.budget import Budget
from rrfp.core.nominal import nominal_orders
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import Kind, Task, stage_tasks
from rrfp.core.tracker import StageSpec

HintFn = Callable[[int, int, int, bool], Sequence["Task | str"]]
"""(num_stages, stage, num_microbatches, split) -> the stage's task order."""


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


def bfw_ranked(microbatches, split: bool) -> list[Task]:
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


BUILTIN: dict[str, HintFn] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zbh1, "bf": bf, "bfw": bfw}
SPLIT_BY_DEFAULT = {"zbh1", "bfw", "plan"}
CLASS_HINTS = {"bf", "bfw"}


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
    planned: bool = False  # "plan": rebuilt for every iteration from its predicted costs (rrfp.core.planner)
    uniform: bool = False  # ranks every stage's tasks alike (bf, bfw, plan): the simulator's fast path may run it
    fixed_orders: tuple[tuple[Task, ...], ...] | None = None  # a plan's per-stage orders, for fixed dispatch

    def order(self, S: int, s: int, M: int, split: bool) -> list[Task]:
        if self.fixed_orders is not None:
            tasks = list(self.fixed_orders[s])
        elif self.is_class:
            tasks = list(nominal_orders(self.fn, S, M, split, NOMINAL_BUDGET)[s])
        else:
            tasks = [t if isinstance(t, Task) else Task.parse(str(t)) for t in self.fn(S, s, M, split)]
        validate(tasks, M, split, where=f"hint {self.name} stage {s}")
        return tasks

    def priority(self, S: int, s: int, M: int, split: bool) -> dict[Task, int]:
        if not self.is_class:
            return {t: i for i, t in enumerate(self.order(S, s, M, split))}
        prio = {t: i for i, t in enumerate(self.fn(S, s, M, split))}
        if prio.keys() != set(stage_tasks(M, split)) or len(prio) != len(stage_tasks(M, split)):
            raise HintError(f"hint {self.name} stage {s}: does not rank every task exactly once")
        return prio

    def spec(self, S: int, s: int, M: int, split: bool, dispatch: Dispatch, budget: Budget) -> StageSpec:
        """Everything stage ``s`` needs to track an iteration under this hint. Ready dispatch
        with a class hint needs no order, so none is built (it costs a nominal run)."""
        if self.is_class and dispatch is Dispatch.READY:
            return StageSpec(S, s, M, split, dispatch, self.priority(S, s, M, split), (), budget.limit(S, s))
        order = self.order(S, s, M, split)
        prio = {t: i for i, t in enumerate(order)} if not self.is_class else self.priority(S, s, M, split)
        return StageSpec(S, s, M, split, dispatch, prio, order, budget.limit(S, s))


NOMINAL_BUDGET = 2.0  # class hints' fixed order assumes the default 2x budget



def csv_rows(path: str | Path, what: str) -> list[list[str]]:
    """The rows of the CSV file at ``path``; an unreadable file is a HintError naming ``what`` it is."""
    try:
        return list(csv.reader(Path(path).read_text().splitlines()))
    except OSError as e:
        raise HintError(f"{what} {path}: {e.strerror}") from None


def csv_hint(path: str | Path) -> Hint:
    """A user hint from CSV rows ``stage,task`` in order (a header row is allowed)."""
    path = Path(path)
    per_stage: dict[int, list[Task]] = {}
    for lineno, row in enumerate(csv_rows(path, "hint file"), start=1):
        row = [c.strip() for c in row]
        if not row or not any(row) or row[0].startswith("#"):
            continue
        if lineno == 1 and row[0].lower() == "stage":
            continue
        if len(row) != 2:
            raise HintError(f"hint file {path}:{lineno}: expected 'stage,task', got {','.join(row)!r}")
        try:
            stage = int(row[0])
            task = Task.parse(row[1])
        except ValueError as e:
            raise HintError(f"hint file {path}:{lineno}: {e}") from None
        if stage < 0:
            raise HintError(f"hint file {path}:{lineno}: stage {stage} is negative")
        per_stage.setdefault(stage, []).append(task)

    def order(S: int, s: int, M: int, split: bool) -> list[Task]:
        if s not in per_stage:
            raise HintError(f"hint file {path}: no rows for stage {s} of {S}")
        return per_stage[s]

    return Hint(f"csv:{path.name}", order)


def resolve(spec: "str | Hint | HintFn") -> Hint:
    """A builtin name, a ``.csv`` path, ``module:function``, or a callable."""
    if isinstance(spec, Hint):
        return spec
    if callable(spec):
        return Hint(getattr(spec, "__name__", "user"), spec)
    name = str(spec).strip()
    if name.lower() == "plan":  # BFW until a planner gives it this iteration's entry order
        return Hint("plan", bfw, is_class=True, planned=True, uniform=True)
    if name.lower() in BUILTIN:
        is_class = name.lower() in CLASS_HINTS
        return Hint(name.lower(), BUILTIN[name.lower()], is_class=is_class, uniform=is_class)
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
    raise HintError(f"unknown hint {name!r} (choose from {', '.join(BUILTIN)}, plan, a .csv file or "
                    "module:function)")
