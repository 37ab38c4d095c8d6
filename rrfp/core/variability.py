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
from typing import Any, TypeAlias, cast, overload

import numpy as np
import numpy.typing as npt

from rrfp.core.tasks import Kind

Key: TypeAlias = npt.ArrayLike  # an integer key, or an array of them broadcast like numpy
Hashes: TypeAlias = np.uint64 | npt.NDArray[np.uint64]
Draws: TypeAlias = np.float64 | npt.NDArray[np.float64]  # scalar keys give a scalar

PRESETS = ("none", "jitter", "lang", "mm", "moe")
MM_IMAGES = np.array([0, 1, 2, 4, 8], dtype=np.float64)

# One salt per random stream, so streams never share draws.
(
    _S_LENGTH,
    _S_JITTER_A,
    _S_JITTER_B,
    _S_STRAGGLE,
    _S_IMAGES,
    _S_COMM_A,
    _S_COMM_B,
    _S_ROUTING,
) = range(1, 9)

# The moe preset, from published measurements (docs/simulator.md, "The moe preset"): the
# busiest expert rank's tokens over the mean is 1 + excess, a mean-one lognormal times MOE_EXCESS.
MOE_EXCESS = 0.23  # mean max/mean 1.23: 18.6% of an MoE layer's GPU time waits (FEPLB, EP 8)
MOE_SIGMA = 0.65  # its 99th percentile near 1.9x: up to 47.6% from balancing alone (MicroMoE)
MOE_EXPERT = 0.45  # routed experts' share of a balanced MoE task (DeepSeek-V3's layer shapes)
MOE_A2A = 0.10  # the all-to-all's share when balanced: under 10% (LAER-MoE, Mixtral 8x7B)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(h: Hashes) -> Hashes:
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 0xFFFFFFFFFFFFFFFF


def _mix_int(h: int) -> int:
    """``_mix`` of one 64-bit value in Python's integers."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
    return h ^ (h >> 31)


def _uniform_ints(keys: list[int]) -> np.float64:
    """``uniform`` of integer keys alone in Python's integers: the same bits, without numpy's cost
    per operation on one value (the simulator draws one task's at a time)."""
    h = _GOLDEN
    for k in keys:
        h = _mix_int(h ^ ((k + _GOLDEN) & _MASK))
    return np.float64((h >> 11) * (1.0 / 2**53))


def _scalar_int(key: Key) -> int | None:
    """``key`` as a Python integer where it is one value (an int, a numpy integer, a 0-d integer
    array: what a caller's ``np.asarray`` of one stage gives); None for an array of several."""
    if isinstance(key, int):
        return key
    if isinstance(key, np.integer) or (
        isinstance(key, np.ndarray) and key.ndim == 0 and key.dtype.kind in "iub"
    ):
        return int(key)
    return None


def uniform(*keys: Key) -> Draws:
    """U[0,1) that depends only on the integer keys (broadcast like numpy)."""
    ints = [_scalar_int(k) for k in keys]
    if None not in ints:
        return _uniform_ints(cast("list[int]", ints))
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
    # mixture of experts: every stage's tasks route tokens to experts on an EP group, which waits
    # for its busiest rank; zero shares: a dense model
    moe_expert: float = 0.0  # the routed experts' share of a task at balanced load
    moe_a2a: float = 0.0  # the all-to-all's share of an F or B at balanced load (W sends none)
    moe_excess: float = 0.0  # mean of (busiest EP rank's tokens / mean) - 1
    moe_sigma: float = 0.0  # lognormal sigma of that excess, per (stage, microbatch)

    def __post_init__(self) -> None:
        for fld in fields(self):
            v = getattr(self, fld.name)
            if isinstance(v, float) and (v < 0 or v != v):
                raise ValueError(f"variability {fld.name}={v} must be a number >= 0")
        if not 0 <= self.straggler_p <= 1:
            raise ValueError(f"variability straggler_p={self.straggler_p} must be in [0, 1]")
        if self.moe_expert + self.moe_a2a > 1:
            raise ValueError(
                f"variability moe_expert={self.moe_expert} + moe_a2a={self.moe_a2a} are shares of "
                "one task and must sum to at most 1"
            )

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
        elif name == "moe":
            base = cls(
                name="moe",
                moe_expert=MOE_EXPERT,
                moe_a2a=MOE_A2A,
                moe_excess=MOE_EXCESS,
                moe_sigma=MOE_SIGMA,
            )
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

    def load(self, seed: Key, iteration: Key, stage: Key, mb: Key) -> Draws:
        """Busiest EP rank's tokens over the mean (>= 1) for one microbatch on one stage. Keyed
        without the kind: the backward routes the forward's tokens, so B and W see F's load."""
        return 1.0 + self.moe_excess * lognormal(
            self.moe_sigma, seed, iteration, stage, mb, _S_ROUTING
        )

    def routing(self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: int) -> Draws:
        """Factor (mean one) the router puts on a task: its dense part stays, its expert part and
        its all-to-all (F and B; W sends nothing) wait for the busiest rank, ``load``."""
        a2a = 0.0 if kind == Kind.W else self.moe_a2a
        routed = self.moe_expert + a2a
        if routed == 0:
            return np.ones(
                np.broadcast_shapes(*(np.shape(k) for k in (seed, iteration, stage, mb)))
            )
        dense = 1.0 - routed
        load = self.load(seed, iteration, stage, mb)
        return (dense + routed * load) / (dense + routed * (1.0 + self.moe_excess))

    def _one(self, seed: Key, iteration: Key, stage: Key, mb: Key, kind: int) -> Draws:
        base = (self.f, self.b, self.w)[kind]
        stage = np.asarray(stage)
        t = base * lognormal(self.jitter, seed, iteration, stage, mb, kind, _S_JITTER_A)
        if self.vision_stage0:
            vision = 0.2 + (0.8 / 3.0) * self.images(seed, iteration, mb)
            t = t * np.where(stage == 0, vision, self.length(seed, iteration, mb))
        else:
            t = t * self.length(seed, iteration, mb)
        t = t * self.routing(seed, iteration, stage, mb, kind)
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
        """What cannot be known from the data: jitter, stragglers, a slow stage and the router's
        load, as a factor (mean about one). Data-driven durations multiply their predicted cost
        by it."""
        kind = int(kind)
        stage = np.asarray(stage)
        t = lognormal(self.jitter, seed, iteration, stage, mb, kind, _S_JITTER_A)
        t = t * self.routing(seed, iteration, stage, mb, kind)
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
