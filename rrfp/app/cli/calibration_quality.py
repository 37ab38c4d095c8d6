"""How far a calibration can be trusted: its error on microbatches the fit never saw, whether the
machine was busy while measuring, and fitted terms below zero.

A machine busy with other work stretches some timings and not others, which no linear model of the
data explains; a negative weight says the fit bent itself to such noise (no task gets cheaper with
more tokens). ``rrfp calibrate`` prints all three beside the fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rrfp.core.cost import CostModel

Sample = tuple[int, int, dict, float]  # (stage, kind 0/1/2 for F/B/W, features, seconds)

LOAD_SHARE = 0.25  # other work on more than this share of the cores makes timings unreliable
NEGATIVE_SHARE = 0.05  # a negative term worth more than this share of a task's mean time is flagged
KIND_NAMES = "FBW"
TERMS = ("intercept", "tokens", "attn", "patches")


def split_held_out(samples: Sequence[Sample], per_microbatch: int) -> tuple[list, list]:
    """(fit, held out): alternate microbatches, each ``per_microbatch`` consecutive samples (its
    tasks on every stage), so both halves span the same range of sizes."""
    fit: list[Sample] = []
    held: list[Sample] = []
    for i in range(0, len(samples), per_microbatch):
        (fit if (i // per_microbatch) % 2 == 0 else held).extend(samples[i : i + per_microbatch])
    return fit, held


def held_out_errors(model: CostModel, held: Sequence[Sample]) -> list[float]:
    """|predicted - measured| / measured for every held-out task with a measured time above 0."""
    return [abs(model.seconds(s, k, f) - t) / t for s, k, f, t in held if t > 0]


def negative_terms(model: CostModel, samples: Sequence[Sample]) -> list[str]:
    """The fitted terms below zero that matter: one whose most negative contribution over the
    measured microbatches exceeds ``NEGATIVE_SHARE`` of that task's mean measured time, the
    largest first, each as 'stage S W: tokens -0.8 us each (-12% of its mean time)'."""
    out: list[tuple[float, str]] = []
    for s, kinds in enumerate(model.coef):
        for k, c in enumerate(kinds):
            rows = [(f, t) for ss, kk, f, t in samples if ss == s and kk == k]
            if not rows:
                continue
            mean = sum(t for _, t in rows) / len(rows)
            for j, w in enumerate(c):
                if w >= 0:
                    continue
                most = 1.0 if j == 0 else max(float(f.get(TERMS[j], 0.0)) for f, _ in rows)
                share = w * most / mean if mean > 0 else 0.0
                if -share > NEGATIVE_SHARE:
                    what = f"{w * 1e3:.3g} ms" if j == 0 else f"{w * 1e6:.3g} us each"
                    where = f"stage {s} {KIND_NAMES[k]}"
                    out.append(
                        (share, f"{where}: {TERMS[j]} {what} ({share:.0%} of its mean time)")
                    )
    return [text for _, text in sorted(out, key=lambda x: x[0])]


def load_warning(load: float | None, cores: int, threads: int) -> str | None:
    """Why the timings are unreliable, or None: other work kept more than ``LOAD_SHARE`` of the
    cores busy beside this process's ``threads`` (``load`` is the 1-minute load average)."""
    if load is None or cores <= 0:
        return None
    other = load - threads
    if other <= LOAD_SHARE * cores:
        return None
    return (
        f"the machine is busy: load average {load:.2f} on {cores} cores while measuring with "
        f"{threads} thread(s); other work stretches some timings, so the fit and its error are "
        f"unreliable: calibrate on an idle machine"
    )


def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
