"""The bench's order of contenders within an iteration: balanced for position and predecessor."""

from __future__ import annotations

from collections import Counter

import pytest

from rrfp.app.bench.rank import run_order


@pytest.mark.parametrize("n", range(1, 8))
def test_each_contender_takes_every_position_and_follows_every_other_equally_often(n):
    names = [f"c{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    rows = [run_order(names, k) for k in range(period)]
    assert all(sorted(row) == names for row in rows), "each iteration runs every contender once"
    positions = Counter((name, i) for row in rows for i, name in enumerate(row))
    assert set(positions.values()) == {period // n}
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    pairs = {(a, b) for a in names for b in names if a != b}
    assert set(follows) == pairs
    assert len(set(follows.values())) <= 1, f"one contender follows another more often: {follows}"
    assert rows == [run_order(names, k + period) for k in range(period)], "the design repeats"
