"""Token documents and how a microbatch is drawn from them without crossing a boundary.

A corpus is one flat token array and the end offset of each document in it. A microbatch's
length is that of a document drawn at random (cut to ``max_seq_len``; documents shorter than
``min_seq_len + 1`` tokens are never drawn), so a run sees its data's own length distribution,
the variability rrfp schedules for. Its rows are windows of that length, each inside one
document at least as long, drawn uniformly over all such windows: no row spans two documents
and no row is padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class Documents:
    tokens: np.ndarray  # [N] integer token ids, possibly a read-only memmap
    ends: np.ndarray  # [D] int64, increasing, the last N: document d is [ends[d-1], ends[d])
    max_id: int  # the largest token id in ``tokens``
    # document starts; documents sorted by length, and the prefix sums of those lengths
    _starts: np.ndarray = field(init=False, repr=False)
    _order: np.ndarray = field(init=False, repr=False)
    _sorted: np.ndarray = field(init=False, repr=False)
    _prefix: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = np.concatenate(([0], self.ends[:-1])).astype(np.int64)
        lengths = self.ends.astype(np.int64) - starts
        order = np.argsort(lengths, kind="stable")
        srt = lengths[order]
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_sorted", srt)
        object.__setattr__(self, "_prefix", np.concatenate(([0], np.cumsum(srt))))

    @property
    def count(self) -> int:
        return len(self.ends)

    @property
    def longest(self) -> int:
        return int(self._sorted[-1]) if len(self._sorted) else 0

    def lengths(self) -> np.ndarray:
        return self.ends.astype(np.int64) - self._starts

    def draw(self, rng: np.random.Generator, rows: int, min_len: int, max_len: int) -> np.ndarray:
        """``rows`` windows of one length T + 1 (inputs and their next tokens), int64 [rows, T+1].

        T is a random document's length - 1 (among those of at least ``min_len + 1`` tokens),
        cut to ``max_len``. Every window lies inside one document."""
        first = int(np.searchsorted(self._sorted, min_len + 1))
        if first == len(self._sorted):
            raise ValueError(
                f"no document has {min_len + 1} tokens (min_seq_len + 1); the longest has "
                f"{self.longest}"
            )
        doc = int(rng.integers(first, len(self._sorted)))
        t = min(int(self._sorted[doc]) - 1, max_len)
        starts = self._window_starts(rng, rows, t + 1)
        return np.asarray(self.tokens[starts[:, None] + np.arange(t + 1)], dtype=np.int64)

    def _window_starts(self, rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
        """Start offsets of ``rows`` windows of ``n`` tokens, uniform over every window that lies
        inside one document. Document i (in length order, from the first of >= n tokens, k) holds
        len_i - n + 1 windows; windows up to i: P[i+1] - P[k] - (n-1)(i+1-k), increasing in i."""
        k = int(np.searchsorted(self._sorted, n))
        p, d = self._prefix, len(self._sorted)

        def upto(i: np.ndarray) -> np.ndarray:  # windows in sorted documents k..i
            return p[i + 1] - p[k] - (n - 1) * (i + 1 - k)

        total = int(upto(np.array(d - 1)))
        r = rng.integers(0, total, size=rows)
        lo, hi = np.full(rows, k), np.full(rows, d - 1)
        while np.any(lo < hi):  # the first i with upto(i) > r
            mid = (lo + hi) // 2
            right = upto(mid) > r
            hi = np.where(right, mid, hi)
            lo = np.where(right, lo, mid + 1)
        before = np.where(lo > k, upto(lo - 1), 0)
        return self._starts[self._order[lo]] + (r - before)


def split_at(tokens: np.ndarray, eot: int, file_ends: np.ndarray | None = None) -> np.ndarray:
    """Document ends: after every ``eot`` token (it belongs to the document it ends, so the model
    learns to end one), and at every offset of ``file_ends``; the last is len(tokens). ``eot`` < 0:
    no end token. Read in chunks, so a memmapped file is never loaded whole."""
    n = len(tokens)
    ends: list[np.ndarray] = []
    if eot >= 0:
        chunk = 1 << 24
        for lo in range(0, n, chunk):
            ends.append(np.flatnonzero(np.asarray(tokens[lo : lo + chunk]) == eot) + lo + 1)
    if file_ends is not None:
        ends.append(np.asarray(file_ends, dtype=np.int64))
    ends.append(np.array([n], dtype=np.int64))
    out = np.unique(np.concatenate(ends).astype(np.int64))
    return out[out > 0]


def max_token(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) token id, read in chunks."""
    lo, hi, chunk = None, None, 1 << 24
    for i in range(0, len(tokens), chunk):
        part = np.asarray(tokens[i : i + chunk])
        a, b = int(part.min()), int(part.max())
        lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
    if lo is None or hi is None:
        raise ValueError("no tokens")
    return lo, hi
