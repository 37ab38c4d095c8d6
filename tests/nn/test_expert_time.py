"""Emulated MoE time from the routing, on two real gloo ranks: an expert-parallel layer whose
copies are routed all to member 0's experts on purpose spends member 0's experts twice the
balanced time and member 1's none, and the combine all-to-all makes member 1's task last as long
as member 0's experts: the routing, not the preset's draw, sets the task's length."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

ROWS = 24  # token copies each member sends per call
UNIT_S = 0.2  # one F (and one B) at its mean
EXPERT_SHARE, LINK_SHARE = 0.5, 0.2


def _task(rank, world, counts):
    import torch
    import torch.distributed as dist

    from rrfp.loop import run
    from rrfp.loop.lane import ComputeLane
    from rrfp.nn.expert_parallel import ExpertParallel
    from rrfp.nn.expert_time import ExpertClock, ExpertTimes, clocked
    from rrfp.nn.grouped_experts import GroupedExperts

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layer = ExpertParallel(GroupedExperts(4, 8, 12), dist.group.WORLD)
    x = torch.randn(ROWS, 8, requires_grad=True)
    times = ExpertTimes(ROWS, EXPERT_SHARE, LINK_SHARE)
    clock = ExpertClock(times, UNIT_S, layers=1)

    def f_and_b():  # one task through the layer, forward and backward
        with clocked(clock):
            layer(x, torch.tensor(counts)).square().sum().backward()

    import time

    async def main():
        lane = ComputeLane(UNIT_S)
        drawn = 2 * UNIT_S  # the task's draw: one F and one B
        t0 = time.perf_counter()
        await lane.run(f_and_b, units=2.0, more_s=lambda: clock.held_s(drawn) - drawn)
        lane.close()
        return time.perf_counter() - t0, clock.held_s(drawn)

    wall, held = run(main())
    dist.destroy_process_group()
    return clock.log, wall, held


def _expected(received: int, moved: int) -> list:
    """The clock's entries of one F and one B: dispatch, experts, combine; in backward the
    combine's all-to-all, the experts' backward, the dispatch's."""
    e = UNIT_S * EXPERT_SHARE * received / ROWS
    link = UNIT_S * LINK_SHARE / 2 * moved / (ROWS / 2)
    return [
        ("link", moved, pytest.approx(link)),
        ("experts", received, pytest.approx(e)),
        ("link", moved, pytest.approx(link)),
        ("link", moved, pytest.approx(link)),
        ("experts", received, pytest.approx(e)),
        ("link", moved, pytest.approx(link)),
    ]


@pytest.mark.timeout(120)
def test_routing_to_one_member_lengthens_every_members_task():
    balanced = run_ranks(_task, 2, [6, 6, 6, 6], timeout=100)
    skewed = run_ranks(_task, 2, [12, 12, 0, 0], timeout=100)  # experts 0, 1: member 0's
    for rank in (0, 1):  # balanced: each member's experts get half of every member's copies
        assert balanced[rank][0] == _expected(ROWS, ROWS // 2)
    # skewed: member 0 gets every copy and receives half of them from member 1, which sends them
    assert skewed[0][0] == _expected(2 * ROWS, ROWS)
    assert skewed[1][0] == _expected(0, ROWS)
    busiest_experts = 2 * UNIT_S * EXPERT_SHARE * 2  # member 0's, in F and in B: twice balanced
    dense = 2 * UNIT_S * (1 - EXPERT_SHARE - LINK_SHARE)
    for rank in (0, 1):
        wall, held = skewed[rank][1:]
        # member 1's experts idle, yet its combine waits for member 0's: its task holds the lane
        # for its dense part and the busiest member's experts at least (a lower bound, whatever
        # the load)
        assert held >= dense + busiest_experts, (rank, held)
        assert wall >= held
    # balanced, each member's own experts take their share: less than the busiest's above
    assert sum(s for what, _, s in balanced[1][0] if what == "experts") == pytest.approx(
        busiest_experts / 2
    )
