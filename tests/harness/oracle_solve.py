"""The clairvoyant optimum as the simulator tests call it."""

from __future__ import annotations

from rrfp.sim import (  # noqa: E402
    SimConfig,
    oracle,
)


def solve(cfg: SimConfig, **options) -> oracle.OracleResult:
    """The oracle on one CP-SAT worker unless a test says otherwise: one worker's search is
    deterministic, so what a proof costs does not depend on the machine's load (two threads race
    on two busy cores and take about twice the CPU for the same proofs)."""
    return oracle.solve(cfg, **{"threads": 1, **options})
