"""Discrete-event simulator: the same policy and variability as the runtime."""
from .engine import SimConfig, SimDeadlock, SimResult, simulate

__all__ = ["SimConfig", "SimDeadlock", "SimResult", "simulate"]
