"""Discrete-event simulator: the same policy and variability as the runtime."""

from rrfp.sim.engine import SimConfig, SimDeadlock, SimResult, simulate

__all__ = ["SimConfig", "SimDeadlock", "SimResult", "simulate"]
