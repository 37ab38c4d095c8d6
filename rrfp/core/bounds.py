"""Lower bound on an iteration's time for given task durations (docs/design.md):
max(busiest rank's total work, longest microbatch chain with its sends)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lower_bound(
    dur: np.ndarray,
    lat_fwd: np.ndarray,
    lat_bwd: np.ndarray,
    split: bool,
    rank_of: Sequence[int] | None = None,
) -> float:
    """``dur[s, m, k]`` for k in F, B, W (B already whole when unsplit, W then 0);
    ``lat_fwd[s, m]``: latency of F(s,m)'s send to s+1; ``lat_bwd[s, m]``: of B(s,m)'s to s-1.
    ``rank_of[s]``: the rank that runs stage s (virtual stages; default: one stage per rank),
    whose total work bounds it since a rank runs one task at a time."""
    S, M, _ = dur.shape
    per_stage = dur.sum(axis=(1, 2))
    if rank_of is not None:
        per_stage = np.bincount(np.asarray(rank_of), weights=per_stage)
    work = float(per_stage.max())
    fwd = dur[:, :, 0].sum(axis=0) + lat_fwd[: S - 1].sum(axis=0)  # end of F on the last stage
    # Backward chain from the last stage down to stage s, then that stage's W.
    b_suffix = np.cumsum(dur[::-1, :, 1], axis=0)[::-1]  # sum of B over stages s..S-1
    l_suffix = np.zeros((S, M))
    if S > 1:
        l_suffix[: S - 1] = np.cumsum(lat_bwd[:0:-1], axis=0)[::-1]  # sends from s+1..S-1 down
    w = dur[:, :, 2] if split else np.zeros((S, M))
    chain = fwd[None, :] + b_suffix + l_suffix + w
    return max(work, float(chain.max()))
