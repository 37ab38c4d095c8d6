"""Discrete-event simulator: the same policy and variability as the runtime."""

from rrfp.sim.engine import SimConfig, SimDeadlock, SimResult, simulate
from rrfp.sim.sweep import sweep

__all__ = ["SimConfig", "SimDeadlock", "SimResult", "simulate", "sweep"]
