"""Tasks of one pipeline stage: F, B and W of each microbatch.

A task is a small frozen value with a compact printable form (``F3``, ``B3``,
``W3``) so hints, traces and error messages all speak the same language.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.IntEnum):
    """F forward; B backward for inputs (whole backward when unsplit); W weights."""

    F = 0
    B = 1
    W = 2


@dataclass(frozen=True, slots=True, order=True)
class Task:
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.name}{self.mb}"

    def __hash__(self) -> int:  # hot in the policy's priority lookup; equal tasks hash equal
        return self.mb * 3 + self.kind

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Task:
        """``"B12"`` -> Task(Kind.B, 12); raises ValueError naming the text."""
        m = _TASK_RE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"not a task: {text.strip()!r} (expected e.g. F0, B3, W3)")
        return cls(Kind[m.group(1).upper()], int(m.group(2)))


_TASK_RE = re.compile(r"([FBWfbw])(\d+)")


def F(mb: int) -> Task:
    return Task(Kind.F, mb)


def B(mb: int) -> Task:
    return Task(Kind.B, mb)


def W(mb: int) -> Task:
    return Task(Kind.W, mb)


def stage_tasks(n_microbatches: int, split: bool) -> list[Task]:
    """Every task one stage runs in an iteration (W only when the backward is split)."""
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    return [Task(k, m) for m in range(n_microbatches) for k in kinds]


def last_backward(split: bool) -> Kind:
    """The task whose end frees a microbatch's activations."""
    return Kind.W if split else Kind.B
