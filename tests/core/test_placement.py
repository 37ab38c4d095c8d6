"""Virtual stage placement: which global stages each rank holds."""

import pytest

from rrfp.core.placement import Placement, VirtualLayout


@pytest.mark.parametrize(
    "S,V,placement",
    [
        (1, 1, "interleaved"),
        (4, 1, "interleaved"),
        (4, 2, "interleaved"),
        (3, 3, "interleaved"),
        (4, 2, "v"),
        (1, 2, "v"),
        (8, 2, "v"),
    ],
)
def test_stages_partition_and_rank_of_inverts(S, V, placement):
    lay = VirtualLayout(S, V, placement)
    held = [s for r in range(S) for s in lay.stages_of(r)]
    assert sorted(held) == list(range(S * V)) == list(range(lay.num_stages))
    for r in range(S):
        stages = lay.stages_of(r)
        assert list(stages) == sorted(stages)  # chunk 0 first
        for c, s in enumerate(stages):
            assert lay.rank_of(s) == r and lay.local_index(s) == c


def test_interleaved_and_v_shapes():
    assert VirtualLayout(4, 2).stages_of(1) == (1, 5)
    assert VirtualLayout(4, 3).stages_of(3) == (3, 7, 11)
    assert VirtualLayout(4, 2, "v").stages_of(0) == (0, 7)
    assert VirtualLayout(4, 2, "v").stages_of(3) == (3, 4)
    assert VirtualLayout(4, 1).stages_of(2) == (2,)  # V = 1 is the plain pipeline


def test_local_turn_only_at_the_v_bottom():
    v = VirtualLayout(4, 2, "v")
    local = [s for s in range(7) if v.is_local(s, s + 1)]
    assert local == [3]  # S-1 -> S on the last rank: no message
    inter = VirtualLayout(4, 2)
    assert [s for s in range(7) if inter.is_local(s, s + 1)] == []
    assert VirtualLayout(1, 3).is_local(0, 1)  # one rank holds every stage


def test_bad_layouts_refused_clearly():
    with pytest.raises(ValueError, match="placement v needs exactly 2 stages per rank"):
        VirtualLayout(4, 3, "v")
    with pytest.raises(ValueError, match="unknown placement 'zigzag'"):
        VirtualLayout(4, 2, "zigzag")
    with pytest.raises(ValueError, match="virtual >= 1"):
        VirtualLayout(4, 0)
    with pytest.raises(ValueError, match="stage 8 is outside"):
        VirtualLayout(4, 2).rank_of(8)
    assert VirtualLayout(2, 2, "V").placement is Placement.V
