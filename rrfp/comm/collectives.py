"""Collectives as awaitables: issue with ``async_op=True``, await the Work
through the loop's one CompletionPoller (docs/design.md, facts 1 and 2).

gloo collectives report completion by themselves (checked on torch 2.13:
``is_completed()`` turns True without ``wait()``, and a dead peer shows up
in ``exception()``), and NCCL ones must be polled anyway, so no collective
needs a thread of its own. Only gloo point-to-point keeps waiter threads.
"""

from __future__ import annotations

import asyncio
import pickle

import torch
import torch.distributed as dist

from rrfp.comm.channels import lone_peer, named_collective
from rrfp.core.errors import PeerFailure
from rrfp.loop.completions import CompletionPoller


async def completed(
    poller: CompletionPoller, work, what: str, deadline_s: float | None = None, group=None
) -> None:
    """Wait for an async ``Work`` over ``group`` (the world when None); a failure becomes one
    PeerFailure naming ``what`` (and the peer, in a two-member group).
    ``deadline_s`` (NCCL, whose watchdog only fires later): how long a peer may keep it waiting."""
    try:
        async with asyncio.timeout(deadline_s):
            with named_collective(what, group):
                await poller.watch(work, wait_after=True, wake_on_future=True)
    except TimeoutError:
        raise PeerFailure(
            f"rank {dist.get_rank()}: {what} failed (nothing within {deadline_s:g} s: a peer is "
            f"hung, too slow, or gone)",
            lone_peer(group),
        ) from None


async def all_reduce(
    poller: CompletionPoller, tensor: torch.Tensor, what: str, op=dist.ReduceOp.SUM, group=None
) -> torch.Tensor:
    await completed(
        poller, dist.all_reduce(tensor, op, group=group, async_op=True), what, group=group
    )
    return tensor


async def all_gather_object(poller: CompletionPoller, obj, what: str, group=None) -> list:
    """Every rank's ``obj``: pickled sizes first, then the padded bytes, both async."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    await completed(
        poller,
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=group, async_op=True),
        f"{what} (sizes)",
        group=group,
    )
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    await completed(
        poller, dist.all_gather(chunks, padded, group=group, async_op=True), what, group=group
    )
    return [pickle.loads(c[: int(n)].numpy().tobytes()) for c, n in zip(chunks, sizes)]
