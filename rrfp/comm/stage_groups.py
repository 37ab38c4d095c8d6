"""This rank's TP, TP-control, DP and control-plane groups, created on every rank in
one global order (``new_group`` is collective over the world, members or not).

Under NCCL the TP and DP groups carry device collectives: each is created with
``device_id``, checked to be eager, and warmed up by a one-element all-reduce, all
members in the same order, so that no communicator is created or connected on the
event loop later (nccl_groups.py). The TP and EP agreements and the control plane
(statistics, gather, barrier, checkpoint) stay on gloo CPU groups: their results
are read on the host, and gloo creates no NCCL communicator.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from rrfp.comm.nccl_groups import require_eager, warm_up_collective
from rrfp.core.layout import Layout


def create_stage_groups(
    layout: Layout,
    rank: int,
    timeout_s: float,
    backend: str,
    device,
    ops=None,
    nccl_timeout_s: float | None = None,
) -> dict:
    """{"tp", "tp_control", "dp", "ep", "ep_control", "expert_dp", "cpu"}: this rank's groups
    (absent: a group of one, or gloo's default group doing the control plane). ``ops``
    (``CudaOps``) is needed under NCCL."""
    gloo_timeout = datetime.timedelta(seconds=timeout_s)
    nccl = backend == "nccl"
    device_kw = (
        {"device_id": device, "timeout": datetime.timedelta(seconds=nccl_timeout_s or timeout_s)}
        if nccl
        else {"timeout": gloo_timeout}
    )
    groups: dict = {}
    warm: list[tuple[str, object]] = []
    for key, lists in (
        ("tp", layout.tp_groups()),
        ("tp_control", layout.tp_groups()),
        ("dp", layout.dp_groups()),
        # without expert parallelism none of these (expert_dp would repeat dp)
        ("ep", layout.ep_groups() if layout.ep > 1 else []),  # the experts' all-to-alls
        ("ep_control", layout.ep_groups() if layout.ep > 1 else []),  # the EP agreement
        # the sum of an expert shard's gradients over the replicas that hold it
        ("expert_dp", layout.expert_dp_groups() if layout.ep > 1 else []),
    ):
        # the agreements read their results on the host: never through the device
        on_device = key not in ("tp_control", "ep_control")
        for ranks in lists:
            if len(ranks) == 1:
                continue  # a group of one needs no process group
            kw = device_kw if on_device else {"timeout": gloo_timeout}
            g = dist.new_group(ranks, backend=None if on_device else "gloo", **kw)
            if rank in ranks:
                groups[key] = g
                if nccl and on_device:
                    what = f"{key.upper().replace('_', ' ')} group of ranks {list(ranks)}"
                    require_eager(g, device, what, rank)
                    warm.append((what, g))
    if nccl:
        groups["cpu"] = dist.new_group(timeout=gloo_timeout, backend="gloo")
        for what, g in warm:  # every member reaches its groups in this one order: the calls meet
            warm_up_collective(g, ops, what)
    return groups
