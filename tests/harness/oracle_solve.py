"""The clairvoyant optimum as the simulator tests call it."""

from __future__ import annotations

from rrfp.sim import (  # noqa: E402
    SimConfig,
    oracle,
)

# CP-SAT without its LP relaxation: on these small models, whose ranks run one task at a time,
# it bounds the makespan no better than the propagators and costs more than it prunes; the
# V = 2 proofs of test_oracle_virtual take a quarter of the CPU, the optima the same
PROOF_PARAMS = {"linearization_level": 0}


def solve(cfg: SimConfig, **options) -> oracle.OracleResult:
    """The oracle on one CP-SAT worker unless a test says otherwise: one worker's search is
    deterministic, so what a proof costs does not depend on the machine's load (two threads race
    on two busy cores and take about twice the CPU for the same proofs); with PROOF_PARAMS under
    the test's own."""
    params = {**PROOF_PARAMS, **(options.pop("params", None) or {})}
    return oracle.solve(cfg, **{"threads": 1, **options, "params": params})
