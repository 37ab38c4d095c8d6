"""A torch ``DeviceMesh`` read as rrfp's layout, for ``ScheduleReady(mesh=)``.

The mesh names its dimensions ``("pp", "dp")`` or ``("pp", "dp_shard")``, optionally with a
trailing ``"tp"`` of size 1, and lays the world out in rrfp's rank order (rrfp/core/layout.py:
``rank = (pp * dp + d) * tp + t``, which is ``torch.arange(world).reshape(pp, dp, tp)``, what
``init_device_mesh`` builds). The stage's group is this rank's slice along ``"pp"``: one pipeline.
Along the data-parallel dimension the gradients are made equal once per step, by one of:

- ``"dp"``: rrfp's GradSync averages them over the replicas (``dp_sync``);
- ``"dp_shard"``: the stage modules are FSDP2-sharded (``fully_shard(..., mesh=mesh["dp_shard"])``)
  and FSDP reduce-scatters them after the step (rrfp/pipeline/sharded_stages.py).

``("pp", "dp", "ep")`` adds expert parallelism over the replicas: the ``dp x ep`` replicas of a
stage form blocks of ``ep`` (each ``mesh["ep"]`` slice, adjacent ranks: rrfp's EP groups), whose
members hold different experts of the stage modules' MoE layers, sharded by the script with
``rrfp.shard_experts(module, mesh["ep"].get_group())``; rrfp agrees on the order of their
all-to-alls and averages the other gradients over all ``dp x ep`` replicas.
``("pp", "dp_shard", "ep")`` is the same over FSDP2 replicas, as torchtitan borrows its dp_shard
dimension for EP: the stage modules are ``fully_shard``'ed over all ``dp_shard x ep`` replicas of
the stage (``mesh["dp_shard", "ep"]._flatten()``, torchtitan's way to a 1-D mesh of them) with
the experts left out (``ignored_params``: the EP group shards them already).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DP_DIMS = ("dp", "dp_shard")


@dataclass(frozen=True)
class MeshLayout:
    """What ScheduleReady takes from the mesh: pipeline ranks, replicas, how replicas sync, and
    this rank's pipeline (its pp slice, in stage order)."""

    pp: int
    dp: int
    dp_dim: str  # "dp" or "dp_shard"
    pipeline: list[int]
    ep: int = 1  # expert-parallel replicas, a divisor of dp (the mesh's "ep" dimension)
    ep_group: list[int] | None = None  # this rank's slice along "ep"


def read_mesh(mesh, world: int) -> MeshLayout:
    """ValueError naming what is wrong with ``mesh`` for ScheduleReady; NotImplementedError for a
    tensor-parallel dimension larger than 1."""
    names = tuple(mesh.mesh_dim_names or ())
    allowed = [("pp", d) for d in DP_DIMS] + [("pp", d, "tp") for d in DP_DIMS]
    if names not in allowed + [("pp", d, "ep") for d in DP_DIMS]:
        raise ValueError(
            f"ScheduleReady(mesh=): the mesh's dimensions are {names or 'unnamed'}; name them "
            "('pp', 'dp') or ('pp', 'dp_shard'), optionally with a trailing 'tp', or "
            "('pp', 'dp', 'ep') or ('pp', 'dp_shard', 'ep') for expert parallelism"
        )
    shape = tuple(mesh.mesh.shape)
    if len(names) == 3 and names[2] == "tp" and shape[2] != 1:
        raise NotImplementedError(
            f"ScheduleReady(mesh=): tp = {shape[2]}: ScheduleReady runs no tensor-parallel "
            "dimension yet (tp = 1 only); rrfp train and PipelineRuntime(tp=) do"
        )
    if mesh.device_type != "cpu" and mesh.device_type != "cuda":
        raise ValueError(f"ScheduleReady(mesh=): device type {mesh.device_type!r}")
    order = torch.arange(world).reshape(shape)
    if mesh.mesh.numel() != world or not torch.equal(mesh.mesh.cpu(), order):
        raise ValueError(
            f"ScheduleReady(mesh=): the mesh {mesh.mesh.tolist()} is not the world in rrfp's "
            f"rank order {order.tolist()} (rank = (pp * dp + d) * tp + t): build it with "
            f"init_device_mesh(device, {shape}, mesh_dim_names={names})"
        )
    pp, dp = shape[0], shape[1]
    if names[-1] == "ep":  # the replicas are dp x ep, in blocks of ep adjacent ranks
        ep = shape[2]
        pipeline, ep_group = mesh["pp"].mesh.tolist(), mesh["ep"].mesh.tolist()
        return MeshLayout(pp, dp * ep, names[1], pipeline, ep, ep_group)
    return MeshLayout(pp, dp, names[1], mesh[names[0]].mesh.tolist())
