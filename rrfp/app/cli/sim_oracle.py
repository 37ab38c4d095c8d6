"""`rrfp sim --oracle`: each seed's clairvoyant optimum, and each row's distance to it.

The optimum is solved on the seed's realized durations with a split backward
(the most freedom the runtime has; an unsplit schedule is one of its
schedules) under the sweep's budget. A seed that hits the time limit is
compared with its proven lower bound instead, so its ratio is an upper limit
on the row's distance to the optimum, and the column says so with ``<=``.
With virtual stages each layout is its own problem (its stages, durations and
rank budgets): every layout among the rows is solved, and each row is compared
with its own layout's optimum (the fixed 1F1B baseline with V = 1's).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from rrfp.app.errors import UsageError
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.sim import SimConfig
from rrfp.sim.sweep import Row

MAX_TASKS = 512  # S * V * M above which one seed's model is too large to solve in seconds


def check(args, layouts: Sequence[VirtualLayout]) -> None:
    """Refuse, before the sweep runs, what the oracle cannot do here."""
    V = max((lay.virtual for lay in layouts), default=1)
    if args.pp * V * args.n_microbatches > MAX_TASKS:
        size = (
            f"S*V*M <= {MAX_TASKS}, here {args.pp * V * args.n_microbatches}"
            if V > 1
            else f"S*M <= {MAX_TASKS}, here {args.pp * args.n_microbatches}"
        )
        raise UsageError(
            f"--oracle is for small S and M ({size}); "
            "use the efficiency column (the lower bound) for large runs"
        )
    from rrfp.sim.oracle import OracleUnavailable, require_ortools

    try:
        require_ortools()
    except OracleUnavailable as e:
        raise UsageError(f"--oracle: {e}") from None


@dataclass
class Distance:
    """One row against the optimum, seed by seed."""

    per_seed: list[float]  # row makespan / optimum (or / proven bound where the solve timed out)
    upper_limit: bool  # some seed used the bound: the true distance is at most this
    holds_budget: (
        bool | None
    )  # False: the row held more than the budget (fixed dispatch ignores it); None: unknown

    @property
    def median(self) -> float:
        return float(np.median(self.per_seed))

    def cell(self) -> str:
        bound = "<=" if self.upper_limit else ""
        over = "*" if self.holds_budget is False else ""
        return f"{bound}{self.median:.3f}x{over}"

    def as_dict(self) -> dict:
        return {
            "median": self.median,
            "per_seed": self.per_seed,
            "upper_limit": self.upper_limit,
            "holds_budget": self.holds_budget,
        }


@dataclass
class OracleColumn:
    results: dict[str, list]  # OracleResult per seed, by layout label ("" with one stage per rank)
    rows: dict[tuple, Distance]  # by Row.key
    time_limit: float

    def cell(self, row: Row) -> str:
        return self.rows[row.key].cell()

    def summary(self, budget) -> list[str]:
        lines = []
        for label, results in self.results.items():
            solved = [r for r in results if r.optimal]
            secs = [r.seconds for r in results]
            lines.append(
                f"optimum{' ' + label if label else ''}: CP-SAT on each seed's durations, backward "
                "split, "
                f"budget {budget}; {len(solved)} of {len(results)} seeds solved to optimality "
                f"(solve time median {statistics.median(secs):.1f} s, max {max(secs):.1f} s)"
            )
            open_ = [r for r in results if not r.optimal]
            if open_:
                gaps = [r.gap for r in open_ if r.gap is not None]
                found = (
                    f"; the best schedules found are {min(gaps):.1%}..{max(gaps):.1%} above their "
                    "bounds"
                    if gaps
                    else "; no schedule found"
                )
                lines.append(
                    f"{len(open_)} seed(s) hit the {self.time_limit:g} s limit: the column divides "
                    "by "
                    f"their proven lower bound, so '<=' marks an upper limit on the distance{found}"
                )
        if len(self.results) > 1:
            lines.append(
                "each row is compared with the optimum of its own layout (V = 1 for the fixed 1f1b "
                "baseline)"
            )
        if any(d.holds_budget is False for d in self.rows.values()):
            held = (
                "bytes than the optimum's rank limit (docs/simulator.md)"
                if budget.bytes is not None
                else "microbatches than the budget"
            )
            lines.append(
                f"* held more {held} on some rank (fixed dispatch ignores the budget); "
                "the optimum keeps it, so such a row can come out below 1"
            )
        return lines

    def as_dict(self) -> dict:
        return {
            "time_limit_s": self.time_limit,
            "split_backward": True,
            "solved": sum(r.optimal for results in self.results.values() for r in results),
            "seeds": [
                {"seed": i, "layout": label or "V1", **r.as_dict()}
                for label, results in self.results.items()
                for i, r in enumerate(results)
            ],
        }


def oracle_column(
    args, base: SimConfig, runs: dict, rows: list[Row], progress: Callable
) -> OracleColumn:
    """Solve every seed's optimum for every layout among ``rows``; every row's recorded schedules
    (``runs``, from the sweep) that hold the budget are the solver's first incumbents on their
    layout."""
    from rrfp.sim.oracle import holds_budget, solve

    layouts = {r.layout: (r.virtual, r.placement) for r in rows}  # one key for a layout: its label
    holds: dict[tuple, set] = {r.key: set() for r in rows}
    results: dict[str, list] = {}
    jobs = [(seed, label) for seed in range(args.seeds) for label in layouts]
    for seed, label in progress(jobs, desc="solving the optimum", unit="solve"):
        virtual, placement = layouts[label]
        incumbents = []
        for r in rows:
            if r.layout != label:
                continue
            cfg, res = runs[r.key][seed]
            ok = True if cfg.dispatch is Dispatch.READY else holds_budget(cfg, res)
            holds[r.key].add(ok)
            if ok:
                incumbents.append(res)
        cfg = replace(base, seed=seed, split=True, virtual=virtual, placement=placement)
        results.setdefault(label, []).append(
            solve(cfg, time_limit=args.oracle_time_limit, hints=incumbents)
        )
    dist = {}
    for r in rows:
        refs = [(o.makespan, False) if o.optimal else (o.bound, True) for o in results[r.layout]]
        seen = holds[r.key]
        dist[r.key] = Distance(
            [m / ref for m, (ref, _) in zip(r.makespans, refs)],
            any(up for _, up in refs),
            False if False in seen else None if None in seen else True,
        )
    return OracleColumn(results, dist, args.oracle_time_limit)
