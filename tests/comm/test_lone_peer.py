"""A collective over a two-member group that fails names the other member as the lost peer
(a TP pair, a world of two), so the rank's line says which rank died; in a larger group it
names none (the failure board then goes by the other ranks' posts)."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _lost(rank, world):
    import asyncio
    import datetime

    import torch
    import torch.distributed as dist

    from rrfp.comm.collectives import all_reduce
    from rrfp.core.errors import PeerFailure
    from rrfp.loop.completions import CompletionPoller

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    pair = dist.new_group([0, 1])  # every rank creates every group
    dist.barrier()
    if rank == 1:
        return "left"  # the process ends without gloo's teardown: its sockets close

    async def reduce(group):
        async with CompletionPoller() as poller:
            await all_reduce(poller, torch.ones(4), "test all-reduce", group=group)

    try:
        asyncio.run(reduce(pair if rank == 0 else None))
    except PeerFailure as e:
        return e.peer
    return "no failure"


@pytest.mark.timeout(60)
def test_a_failed_collective_of_two_names_the_other_member():
    got = run_ranks(_lost, 3, timeout=40)
    assert got[0] == 1, "the pair [0, 1]: rank 1 is the one rank 0 lost"
    assert got[2] is None, "the world of 3: the collective alone cannot tell which rank left"
