"""This rank's pipeline channels, created for every rank in one global order.

gloo ``Channel`` on CPU, ``NcclChannel`` on CUDA; either way one process group
per (neighbour pair, direction), created eagerly (docs/design.md, fact 3). On
CUDA each group's communicator is created by ``new_group`` (checked), and each
channel carries one element at start-up, in the same global order, so that
nothing is created or connected on the event loop later (nccl_groups.py).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from rrfp.comm.channels import Channel
from rrfp.comm.device_ops import CudaOps
from rrfp.comm.nccl_channel import NcclChannel
from rrfp.comm.nccl_groups import require_eager
from rrfp.core.layout import Layout

logger = logging.getLogger("rrfp.comm")


class PipelineChannels:
    """This rank's channels to its pipeline neighbours; None where there is no neighbour.

    ``fwd_in`` carries activations from stage s-1, ``fwd_out`` to s+1, ``bwd_in``
    gradients from s+1, ``bwd_out`` to s-1.
    """

    def __init__(
        self,
        rank: int,
        fwd_in: Channel | None = None,
        fwd_out: Channel | None = None,
        bwd_in: Channel | None = None,
        bwd_out: Channel | None = None,
    ) -> None:
        self.rank = rank
        self.fwd_in, self.fwd_out, self.bwd_in, self.bwd_out = fwd_in, fwd_out, bwd_in, bwd_out

    def all(self) -> list[Channel]:
        return [c for c in (self.fwd_in, self.fwd_out, self.bwd_in, self.bwd_out) if c is not None]

    def __repr__(self) -> str:
        names = ", ".join(c.name for c in self.all()) or "none"
        return f"<PipelineChannels rank {self.rank}: {names}>"

    async def aclose(self) -> None:
        for channel in self.all():
            await channel.aclose()

    async def __aenter__(self) -> PipelineChannels:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class RankChannels:
    """This rank's channels for each of its stages (virtual stages: several per rank), keyed by
    global stage: ``of(stage)`` is that stage's ``PipelineChannels``. A neighbour on this same
    rank (the V turn) has no channel: the executor hands the tensors over locally."""

    def __init__(self, rank: int, stages: dict[int, PipelineChannels]) -> None:
        self.rank, self.stages = rank, stages

    def of(self, stage: int) -> PipelineChannels:
        return self.stages[stage]

    def all(self) -> list[Channel]:
        return [c for ch in self.stages.values() for c in ch.all()]

    def __repr__(self) -> str:
        return f"<RankChannels rank {self.rank}: {', '.join(c.name for c in self.all()) or 'none'}>"

    async def aclose(self) -> None:
        for ch in self.stages.values():
            await ch.aclose()


def create_pipeline_channels(
    layout: Layout,
    rank: int,
    timeout: datetime.timedelta | float,
    *,
    device: torch.device | str = "cpu",
    poller=None,
    compute_stream=None,
    ops=None,
    deadline_s: float | None = None,
    wait: datetime.timedelta | None = None,
) -> PipelineChannels:
    """Create every pipeline process group on every rank; return this rank's channels (one
    stage per rank; ``create_rank_channels`` for several).

    Must be called by all ranks, with the same layout, after
    ``init_process_group``: ``new_group`` is collective over the world even for
    non-members, so the groups are created in one fixed global order (replica
    (dp, tp), then stage pair s -> s+1, forward before backward). ``timeout``
    (a timedelta or seconds) becomes each group's timeout: the dead-peer
    detector, and the longest a receive may wait for its message.

    A CUDA ``device`` makes NCCL channels: each group gets ``device_id`` so its
    communicator is created now, not at first use (refused otherwise), every
    channel is warmed up before this returns, and the loop's ``poller`` watches
    every send and receive; ``compute_stream`` is the lane's stream, ``ops`` the
    CUDA calls (``CudaOps``; tests pass a fake), ``deadline_s`` how long a send
    may take (rrfp's peer deadline; ``timeout`` is then NCCL's watchdog's). ``wait`` (gloo): how
    long one send or receive may wait, when not ``timeout`` (a heartbeat bounds silence instead).
    """
    channels = create_rank_channels(
        layout,
        rank,
        timeout,
        device=device,
        poller=poller,
        compute_stream=compute_stream,
        ops=ops,
        deadline_s=deadline_s,
        wait=wait,
    )
    return channels.of(layout.coords(rank).pp)


def create_rank_channels(
    layout: Layout,
    rank: int,
    timeout: datetime.timedelta | float,
    *,
    stages=None,
    device: torch.device | str = "cpu",
    poller=None,
    compute_stream=None,
    ops=None,
    deadline_s: float | None = None,
    wait: datetime.timedelta | None = None,
) -> RankChannels:
    """``create_pipeline_channels`` for ``stages`` (a ``VirtualLayout``: global stage ->
    pipeline rank; None: one stage per rank). One process group per (stage boundary,
    direction) whose two stages sit on different ranks, so that two stages of one rank never
    share a channel and every message is keyed by its global stage without a header field;
    the global order is replica (dp, tp), then boundary g -> g+1 over all pp x V stages,
    forward before backward. With one stage per rank: exactly ``create_pipeline_channels``'s
    groups, in its order."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call init_process_group before "
            "create_pipeline_channels"
        )
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"{layout.short()} does not match the process group's world size "
            f"{dist.get_world_size()}"
        )
    if dist.get_rank() != rank:
        raise ValueError(
            f"create_pipeline_channels was given rank {rank}, but this process is "
            f"rank {dist.get_rank()}"
        )
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    device = torch.device(device)
    if device.type == "cuda":
        if poller is None or compute_stream is None:
            raise ValueError(
                "NCCL channels need the loop's CompletionPoller and the lane's CUDA stream"
            )
        ops = ops or CudaOps(device)

        def make(name, peer, group, outbound):
            require_eager(group, device, f"channel {name}", rank)
            return NcclChannel(
                name,
                rank,
                peer,
                group,
                outbound=outbound,
                ops=ops,
                poller=poller,
                compute_stream=compute_stream,
                deadline_s=deadline_s,
            )

        group_kw = {"backend": "nccl", "device_id": device}
    else:

        def make(name, peer, group, outbound):
            return Channel(name, rank, peer, group, outbound=outbound, device=device, wait=wait)

        group_kw = {}
    num_stages = layout.pp if stages is None else stages.num_stages
    pp_of = (lambda g: g) if stages is None else stages.rank_of
    mine = layout.coords(rank).pp
    found: dict[int, dict[str, Channel]] = {g: {} for g in range(num_stages) if pp_of(g) == mine}
    in_order: list = []  # this rank's channels in the global order of their groups
    for dp in range(layout.dp):
        for tp in range(layout.tp):
            for s in range(num_stages - 1):
                if pp_of(s) == pp_of(s + 1):
                    continue  # the V turn: one rank holds both stages, nothing travels
                a, b = layout.rank_of(pp_of(s), tp, dp), layout.rank_of(pp_of(s + 1), tp, dp)
                fwd = dist.new_group([a, b], timeout=timeout, **group_kw)
                bwd = dist.new_group([b, a], timeout=timeout, **group_kw)
                fwd_name = f"fwd {s}->{s + 1} (rank {a} -> rank {b})"
                bwd_name = f"bwd {s + 1}->{s} (rank {b} -> rank {a})"
                if rank == a:
                    here = found[s]
                    here["fwd_out"] = make(fwd_name, b, fwd, True)
                    here["bwd_in"] = make(bwd_name, b, bwd, False)
                    in_order += [here["fwd_out"], here["bwd_in"]]
                elif rank == b:
                    here = found[s + 1]
                    here["fwd_in"] = make(fwd_name, a, fwd, False)
                    here["bwd_out"] = make(bwd_name, a, bwd, True)
                    in_order += [here["fwd_in"], here["bwd_out"]]
    if device.type == "cuda":
        for (
            channel
        ) in in_order:  # both ends of every channel reach it in this one order: the calls meet
            channel.warm_up()
    channels = RankChannels(rank, {g: PipelineChannels(rank, **ends) for g, ends in found.items()})
    logger.info(
        "rank %d: %d pipeline channel(s): %s",
        rank,
        len(channels.all()),
        ", ".join(c.name for c in channels.all()) or "none",
    )
    return channels
