"""Variability model: task durations as a pure function of
(seed, iteration, stage, microbatch, kind).

The simulator and the executor (ready or fixed dispatch) all call it, so they
replay the same durations. Randomness comes from a counter-based hash
(splitmix64) instead of a stateful generator, so any one task's time can be
drawn alone, in any order, in any process, and whole arrays can be drawn at
once with numpy. Units: one average forward of one stage (F = B = W = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt

from rrfp.core.tasks import Kind

Key: TypeAlias = npt.ArrayLike  # an integer key, or an array of them broadcast like numpy
Hashes: TypeAlias = np.uint64 | npt.NDArray[np.uint64]
Draws: TypeAlias = np.float64 | npt.NDArray[np.float64]  # scalar keys give a scalar

PRESETS = ("none", "jitter", "lang", "mm")
MM_IMAGES = np.array([0, 1, 2, 4, 8], dtype=np.float64)

# One salt per random stream, so streams never share draws.
_S_LENGTH, _S_JITTER_A, _S_JITTER_B, _S_STRAGGLE, _S_IMAGES, _S_COMM_A, _S_COMM_B = range(1, 8)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(h: Hashes) -> Hashes:
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def uniform(*keys: Key) -> Draws:
    """U[0,1) that depends only on the integer keys (broadcast like numpy)."""
    with np.errstate(over="ignore"):
        h: Hashes = np.uint64(0x9E3779B97F4A7C15)
        for k in keys:
            h = _mix(h ^ (np.asarray(k).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def normal(*keys: Key) -> Draws:
    """Standard normal from two hashed uniforms (Box-Muller)."""
    u1 = uniform(*keys, 0)
    u2 = uniform(*keys, 1)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


def lognormal(sigma: float, *keys: Key) -> Draws:
    """Mean-one lognormal factor: exp(sigma*z - sigma^2/2)."""
    if sigma == 0:
        return np.ones(np.broadcast_shapes(*(np.shape(k) for k in keys)))
    return np.exp(sigma * normal(*keys) - 0.5 * sigma * sigma)


@dataclass(frozen=True)
class Variability:
    """Knobs of the model; ``Variability.preset(name, **overrides)`` builds one."""

    name: str = "none"
    f: float = 1.0  # mean cost of each kind, in average forwards
    b: float = 1.0
    w: float = 1.0
    jitter: float = 0.0  # per-task lognormal sigma
    length_sigma: float = 0.0  # per-microbatch length factor, on every task of it
    straggler_p: float = 0.0
    straggler_x: float = 3.0
    vision_stage0: bool = False  # mm: stage 0 is a vision encoder paced by images
    comm: float = 0.05  # latency per message
    comm_jitter: float = 0.0  # lognormal sigma on each message's latency
    slow_stage: int = -1  # -1: none
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        for fld in fields(self):
            v = getattr(self, fld.name)
            if isinstance(v, float) and (v < 0 or v != v):
                raise ValueError(f"variability {fld.name}={v} must be a number >= 0")
        if not 0 <= self.straggler_p <= 1:
            raise ValueError(f"variability straggler_p={self.straggler_p} must be in [0, 1]")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Variability:
        if name == "none":
            base = cls(name="none")
        elif name == "jitter":
            base = cls(name="jitter", jitter=0.3)
        elif name == "lang":
            base = cls(name="lang", length_sigma=0.5, jitter=0.2, straggler_p=0.05)
        elif name == "mm":
            base = cls(name="mm", vision_stage0=True, length_sigma=0.3, jitter=0.2)
        else:
            raise ValueError(
                f"unknown variability preset {name!r} (choose from {', '.join(PRESETS)})"
            )
        return replace(base, **overrides) if overrides else base

    def length(self, seed: Key, iteration: Key, mb: Key) -> Draws:
        """Per-microbatch size factor (mean one): sequence length, or images for mm."""
        return lognormal(self.length_sigma, seed, iteration, mb, _S_LENGTH)

    def images(self, seed: Key, iteration: Key, mb: Key) -> Draws:
        idx = np.minimum(
            (uniform(seed, iteration, mb, _S_IMAGES) * len(MM_IMAGES)).astype(np.int64), 4
        )
        return MM_IMAGES[idx]

    def _one(self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: int) -> Draws:
        base = (self.f, self.b, self.w)[kind]
        stage = np.asarray(stage)
        t = base * lognormal(self.jitter, seed, iteration, stage, mb, kind, _S_JITTER_A)
        if self.vision_stage0:
            vision = 0.2 + (0.8 / 3.0) * self.images(seed, iteration, mb)
            t = t * np.where(stage == 0, vision, self.length(seed, iteration, mb))
        else:
            t = t * self.length(seed, iteration, mb)
        if self.straggler_p > 0:
            hit = uniform(seed, iteration, stage, mb, kind, _S_STRAGGLE) < self.straggler_p
            t = t * np.where(hit, self.straggler_x, 1.0)
        if self.slow_stage >= 0:
            t = t * np.where(stage == self.slow_stage, self.slow_factor, 1.0)
        return t

    @overload
    def noise(
        self, seed: int, iteration: int, stage: int, mb: int, kind: Kind | int, split: bool = True
    ) -> float: ...

    @overload
    def noise(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int, split: bool = True
    ) -> float | Draws: ...

    def noise(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int, split: bool = True
    ) -> float | Draws:
        """What cannot be known from the data: jitter, stragglers and a slow stage, as a
        factor (mean about one). Data-driven durations multiply their predicted cost by it."""
        kind = int(kind)
        stage = np.asarray(stage)
        t = lognormal(self.jitter, seed, iteration, stage, mb, kind, _S_JITTER_A)
        if self.straggler_p > 0:
            hit = uniform(seed, iteration, stage, mb, kind, _S_STRAGGLE) < self.straggler_p
            t = t * np.where(hit, self.straggler_x, 1.0)
        if self.slow_stage >= 0:
            t = t * np.where(stage == self.slow_stage, self.slow_factor, 1.0)
        return float(t) if np.ndim(t) == 0 else t

    @overload
    def duration(
        self, seed: int, iteration: int, stage: int, mb: int, kind: Kind | int, split: bool = True
    ) -> float: ...

    @overload
    def duration(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int, split: bool = True
    ) -> float | Draws: ...

    def duration(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int, split: bool = True
    ) -> float | Draws:
        """Time of one task (or a broadcast array of them). Unsplit B is B + W."""
        kind = int(kind)
        t = self._one(seed, iteration, stage, mb, kind)
        if kind == Kind.B and not split:
            t = t + self._one(seed, iteration, stage, mb, int(Kind.W))
        return float(t) if np.ndim(t) == 0 else t

    @overload
    def latency(
        self, seed: int, iteration: int, stage: int, mb: int, kind: Kind | int
    ) -> float: ...

    @overload
    def latency(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int
    ) -> float | Draws: ...

    def latency(
        self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: Kind | int
    ) -> float | Draws:
        """Latency of the message a task of ``kind`` on ``stage`` sends."""
        t = self.comm * lognormal(
            self.comm_jitter, seed, iteration, stage, mb, int(kind), _S_COMM_A
        )
        return float(t) if np.ndim(t) == 0 else t
