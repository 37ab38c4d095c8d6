"""In-flight budget: how many microbatches (or bytes) a stage may hold activations for.

``Budget`` is what the user writes; ``Limit`` is its value on one stage;
``InFlight`` counts what a stage holds now. Readiness needs headroom over
1F1B's memory, so the default is ``2x``: twice 1F1B's in-flight count, which
is S - s on stage s. With virtual stages see ``Budget.rank_limit``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from rrfp.core.placement import VirtualLayout

DEFAULT_BUDGET = "2x"  # every default in-flight budget: twice what 1F1B keeps in flight

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_BYTES_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]i?b|b)", re.IGNORECASE)
_MULT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*x", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``count``, ``multiple`` (of 1F1B's S - s; with virtual stages, ``rank_limit``)
    or ``bytes``."""

    count: int | None = None
    multiple: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.count, self.multiple, self.bytes) if v is not None]
        if len(given) != 1:
            raise ValueError("a budget is exactly one of a count, a multiple 'Nx' or a byte size")
        if self.count is not None and self.count < 1:
            raise ValueError(f"budget {self.count} is below 1 microbatch")
        if self.multiple is not None and self.multiple <= 0:
            raise ValueError(f"budget {self.multiple}x must be above 0x")
        if self.bytes is not None and self.bytes < 1:
            raise ValueError(f"budget of {self.bytes} bytes is below 1 byte")

    @classmethod
    def parse(cls, spec: str | int | Budget) -> Budget:
        """``4`` -> 4 microbatches; ``"2x"`` -> 2*(S-s); ``"512MiB"`` -> bytes."""
        if isinstance(spec, Budget):
            return spec
        if isinstance(spec, bool):
            raise ValueError(f"not a budget: {spec!r}")
        if isinstance(spec, int):
            return cls(count=spec)
        text = str(spec).strip()
        if re.fullmatch(r"-?\d+", text):
            return cls(count=int(text))
        if m := _MULT_RE.fullmatch(text):
            return cls(multiple=float(m.group(1)))
        if m := _BYTES_RE.fullmatch(text):
            return cls(bytes=int(float(m.group(1)) * _UNITS[m.group(2).lower()]))
        raise ValueError(f"not a budget: {text!r} (expected e.g. 4, 2x or 512MiB)")

    def limit(self, num_stages: int, stage: int) -> Limit:
        """This budget on ``stage`` of ``num_stages``."""
        return Limit(count=self.microbatches(num_stages, stage), bytes=self.bytes)

    def rank_limit(self, layout: VirtualLayout | int, rank: int, virtual: int = 1) -> Limit:
        """This budget on pipeline ``rank`` of ``layout`` (or of ``layout`` ranks holding
        ``virtual`` interleaved stages), in local-stage microbatches: a local stage holds 1/V of a
        microbatch's activations. ``Nx`` gives the fullest rank N times 1F1B's peak (S microbatches
        of its layers, what a device must fit for 1F1B) and every other rank the same share of its
        need (``rank_need``), so with V = 1 it is N(S - r), and at the same N every V has the same
        peak per device. A count budget is microbatches of the rank's whole model. At least V: one
        microbatch through every local stage."""
        if not isinstance(layout, VirtualLayout):
            layout = VirtualLayout(layout, virtual)
        V = layout.virtual
        if V == 1:
            return self.limit(layout.ranks, rank)
        count: int | None
        if self.multiple is not None:
            share = rank_need(layout, rank) / _fullest_need(layout)
            count = max(V, int(self.multiple * layout.ranks * V * share + 1e-9))
        else:
            count = None if self.count is None else max(V, V * self.count)
        return Limit(count=count, bytes=self.bytes)

    def microbatches(self, num_stages: int, stage: int) -> int | None:
        """The count limit on ``stage``; None for a byte budget."""
        if self.count is not None:
            return self.count
        if self.multiple is not None:
            return max(1, int(self.multiple * (num_stages - stage) + 1e-9))
        return None

    def __str__(self) -> str:
        if self.count is not None:
            return str(self.count)
        if self.multiple is not None:
            return f"{self.multiple:g}x"
        return f"{self.bytes}B"


def rank_need(layout: VirtualLayout, rank: int) -> float:
    """Local-stage microbatches ``rank`` holds in a full pipeline with no waits, as 1F1B's S - s
    generalises: global stage g of S*V keeps a local stage's activations while the microbatch
    crosses the SV - g stages from g to the loss and back, each 1/V of a stage's time, so it holds
    (SV - g) / V of them. V = 1: S - r. It sets how a budget is spread over ranks, not its size:
    with V > 1 a microbatch also waits at each rank for the other local stages' work, and the
    layout's own schedules hold about twice this (ZB-V: S microbatches on every rank, 1F1B's
    rank-0 peak)."""
    N, V = layout.num_stages, layout.virtual
    return sum(N - g for g in layout.stages_of(rank)) / V


@lru_cache(maxsize=64)
def _fullest_need(layout: VirtualLayout) -> float:
    """The largest ``rank_need`` of the layout: computed once per layout, not once per rank."""
    return max(rank_need(layout, q) for q in range(layout.ranks))


def peak_held(spans: Iterable[tuple[float, float, float]]) -> float:
    """The most weight held at once over ``(start, end, weight)`` spans, each held on [start, end):
    at one time a release comes before an admission."""
    events = sorted(
        (t, d) for a, b, x in spans for t, d in ((a, x), (b, -x))
    )  # at one t, negative first
    now: float = 0
    peak: float = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


@dataclass(slots=True)
class InFlight:
    """Microbatches a stage holds activations for: F started, last backward not done."""

    count: int = 0
    bytes: int = 0
    peak: int = 0

    def admit(self, size: int = 0) -> None:
        self.count += 1
        self.bytes += size
        self.peak = max(self.peak, self.count)

    def release(self, size: int = 0) -> None:
        self.count -= 1
        self.bytes -= size


@dataclass(frozen=True, slots=True)
class Limit:
    """A stage's resolved budget. A microbatch larger than ``bytes`` runs alone."""

    count: int | None = None
    bytes: int | None = None

    def admits(self, held: InFlight, size: int) -> bool:
        if self.count is not None and held.count >= self.count:
            return False
        if self.bytes is not None and held.count > 0 and held.bytes + size > self.bytes:
            return False
        return True
