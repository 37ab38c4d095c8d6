"""Task costs from the data: each stage's F, B and W time as a linear function
of what a microbatch holds (tokens, the attention term that grows with length
squared, image patches).

Fitted by least squares on measured times (``rrfp calibrate``), so emulated
device time stretches the real relative costs of the data being trained, and
the simulator can replay the same work. Pure numpy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias, TypeGuard

import numpy as np
import numpy.typing as npt

FEATURES = ("tokens", "attn", "patches")
Features: TypeAlias = Mapping[str, float]  # what a microbatch holds, by name in FEATURES


Coef: TypeAlias = tuple[float, ...]  # [intercept, one weight per feature], in seconds


@dataclass(frozen=True)
class CostModel:
    """``coef[stage][kind]`` = [intercept, one weight per feature], in seconds.

    With a split backward, ``whole[stage]`` (optional) holds the stage's F and B when it runs
    unsplit (B the whole backward, W nothing), measured beside the split ones, so a chooser can
    price each stage both ways (``rrfp.sim.unsplit_choice``); ``typical`` is the calibration's
    mean microbatch, what such a choice is made for."""

    coef: tuple[tuple[Coef, ...], ...]
    reference_s: float  # mean F time of the calibration microbatches over stages: one emulated unit
    whole: tuple[tuple[Coef, Coef], ...] | None = None
    typical: tuple[float, ...] | None = None  # mean features, in FEATURES order

    @property
    def num_stages(self) -> int:
        return len(self.coef)

    def seconds(self, stage: int, kind: int, feats: Features) -> float:
        c = self.coef[stage][kind]
        return max(0.0, c[0] + sum(w * float(feats.get(f, 0.0)) for w, f in zip(c[1:], FEATURES)))

    def units(self, stage: int, kind: int, feats: Features, split: bool = True) -> float:
        """Emulated units (one = the average forward). Unsplit B is B + W."""
        t = self.seconds(stage, kind, feats)
        if kind == 1 and not split:
            t += self.seconds(stage, 2, feats)
        return t / self.reference_s

    def with_whole(self, whole: CostModel) -> CostModel:
        """This model with ``whole``'s F and B (a fit of every stage run unsplit) as its
        unsplit-stage costs."""
        if whole.num_stages != self.num_stages:
            raise ValueError(
                f"the whole-stage fit has {whole.num_stages} stages, "
                f"the split one {self.num_stages}"
            )
        return replace(self, whole=tuple((c[0], c[1]) for c in whole.coef))

    def run_whole(self, stages: Iterable[int]) -> CostModel:
        """The costs of a run whose ``stages`` (numbers from 0) are unsplit: their F and B from
        ``whole``, their W zero. Without ``whole`` (a fit made as that run ran) the model as is."""
        stages = frozenset(stages)
        if self.whole is None or not stages:
            return self
        zero = (0.0,) * (1 + len(FEATURES))
        coef = tuple(
            (*self.whole[s], zero) if s in stages else kinds for s, kinds in enumerate(self.coef)
        )
        return replace(self, coef=coef)

    def typical_features(self) -> dict[str, float] | None:
        return None if self.typical is None else dict(zip(FEATURES, self.typical))

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, Features, float]]) -> CostModel:
        """Least squares per (stage, kind) over samples of (stage, kind, features, seconds);
        features that never vary are dropped from that fit."""
        stages = 1 + max(s for s, *_ in samples)
        coef = []
        for s in range(stages):
            per_kind = []
            for k in range(3):
                rows = [(f, t) for ss, kk, f, t in samples if ss == s and kk == k]
                if not rows:
                    per_kind.append((0.0,) * (1 + len(FEATURES)))
                    continue
                X = np.array(
                    [[1.0] + [float(f.get(name, 0.0)) for name in FEATURES] for f, _ in rows]
                )
                y = np.array([t for _, t in rows])
                used = [0] + [j for j in range(1, X.shape[1]) if np.ptp(X[:, j]) > 0]
                w, *_ = np.linalg.lstsq(X[:, used] / _scale(X[:, used]), y, rcond=None)
                full = np.zeros(X.shape[1])
                full[used] = w / _scale(X[:, used])
                per_kind.append(tuple(float(v) for v in full))
            coef.append(tuple(per_kind))
        model = cls(tuple(coef), 1.0)
        f_samples = [(s, f) for s, k, f, _ in samples if k == 0]
        f_times = [model.seconds(s, 0, f) for s, f in f_samples]
        typical = tuple(
            float(np.mean([float(f.get(name, 0.0)) for _, f in f_samples])) for name in FEATURES
        )
        return cls(
            tuple(coef),
            float(np.mean(f_times)) if f_times else 1.0,
            typical=typical if f_samples else None,
        )

    def to_json(self) -> str:
        doc: dict[str, object] = {
            "features": FEATURES,
            "coef": self.coef,
            "reference_s": self.reference_s,
        }
        if self.whole is not None:
            doc["whole"] = self.whole
        if self.typical is not None:
            doc["typical"] = self.typical
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """What ``to_json`` wrote; ValueError naming the first thing that is not (every number
        finite and within ``MAX_S``, ``reference_s`` above 0, ``coef`` one list of 3 kinds per
        stage)."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(
                "expected a JSON object with features, coef and reference_s, "
                f"got {type(doc).__name__}"
            )
        if not isinstance(doc.get("features"), list) or tuple(doc["features"]) != FEATURES:
            raise ValueError(f"cost model features {doc.get('features')} are not {list(FEATURES)}")
        ref = doc.get("reference_s")
        if not _number(ref) or not 0 < ref <= MAX_S:
            raise ValueError(f"reference_s must be a number in (0, {MAX_S:g}] seconds, got {ref!r}")
        coef = doc.get("coef")
        if not isinstance(coef, list) or not coef:
            raise ValueError(f"coef must be a list with one entry per stage, got {coef!r:.60}")
        _check_stages("coef", coef, "FBW")
        whole = doc.get("whole")
        if whole is not None:
            if not isinstance(whole, list) or len(whole) != len(coef):
                raise ValueError(
                    f"whole must be a list with one entry per stage ({len(coef)}), "
                    f"got {whole!r:.60}"
                )
            _check_stages("whole", whole, "FB")
        typical = doc.get("typical")
        if typical is not None and not (
            isinstance(typical, list)
            and len(typical) == len(FEATURES)
            and all(_number(v) and 0 <= v <= MAX_FEATURE for v in typical)
        ):
            raise ValueError(
                f"typical must be {len(FEATURES)} finite features within [0, {MAX_FEATURE:g}], "
                f"got {typical!r:.80}"
            )
        return cls(
            _floats(coef),
            float(ref),
            whole=None if whole is None else tuple((f, b) for f, b in _floats(whole)),
            typical=None if typical is None else tuple(float(v) for v in typical),
        )


def _floats(nested: list[list[list[float]]]) -> tuple[tuple[Coef, ...], ...]:
    return tuple(tuple(tuple(float(v) for v in c) for c in kinds) for kinds in nested)


def _check_stages(name: str, stages: list[object], kinds: str) -> None:
    """Each stage's entry under ``name``: one coefficient list per kind (``kinds``, e.g. "FBW")."""
    for s, per_kind in enumerate(stages):
        if not isinstance(per_kind, list) or len(per_kind) != len(kinds):
            raise ValueError(
                f"{name}[{s}] must hold {len(kinds)} kinds ({', '.join(kinds)}), "
                f"got {per_kind!r:.60}"
            )
        for k, c in enumerate(per_kind):
            _check_coef(f"{name}[{s}][{k}]", c)


def _check_coef(where: str, c: object) -> None:
    width = 1 + len(FEATURES)
    if not (
        isinstance(c, list) and len(c) == width and all(_number(v) and abs(v) <= MAX_S for v in c)
    ):
        raise ValueError(
            f"{where} must be {width} finite numbers within +-{MAX_S:g} (an intercept and one "
            f"weight per feature), got {c!r:.80}"
        )


# seconds: no task, coefficient or unit of a calibration is near it; beyond, sums overflow
MAX_S = 1e6
MAX_FEATURE = 1e15  # a microbatch's tokens, attention term or patches


def _number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _scale(X: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Column scales that keep the least-squares problem well conditioned."""
    s = np.abs(X).max(axis=0)
    return np.where(s > 0, s, 1.0)


def ranking_agreement(predicted: list[float], measured: list[float]) -> float:
    """Spearman rank correlation: 1 when the predicted order of costs is the measured one."""
    if len(predicted) < 2:
        return 1.0
    rp = np.argsort(np.argsort(predicted))
    rm = np.argsort(np.argsort(measured))
    return float(np.corrcoef(rp, rm)[0, 1])
