"""rrfp/pipelining/mesh.py: how ScheduleReady reads a DeviceMesh's named dimensions, on a stand-in
with a DeviceMesh's surface (a real one needs a process group): expert parallelism over rrfp's
gradient averaging ("dp") and over FSDP2 replicas ("dp_shard"), and a layout it refuses."""

from __future__ import annotations

import pytest
import torch

from rrfp.pipelining.mesh import MeshLayout, read_mesh


class _Mesh:
    """What read_mesh uses of a DeviceMesh: names, the rank grid, the device, this rank's slices
    (rank 0's)."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
        self.mesh = torch.arange(torch.Size(shape).numel()).reshape(shape)
        self.mesh_dim_names, self.device_type = names, "cpu"

    def __getitem__(self, name: str):
        along = self.mesh_dim_names.index(name)
        index = [0] * self.mesh.dim()
        index[along] = slice(None)
        sliced = object.__new__(_Mesh)
        sliced.mesh = self.mesh[tuple(index)]
        return sliced


@pytest.mark.parametrize("dp_dim", ["dp", "dp_shard"])
def test_an_ep_dimension_makes_the_replicas_dp_times_ep(dp_dim):
    layout = read_mesh(_Mesh((2, 2, 2), ("pp", dp_dim, "ep")), 8)
    assert layout == MeshLayout(pp=2, dp=4, dp_dim=dp_dim, pipeline=[0, 4], ep=2, ep_group=[0, 1])


def test_ep_before_the_replicas_is_refused_naming_both_ep_layouts():
    with pytest.raises(ValueError) as refused:
        read_mesh(_Mesh((2, 2, 2), ("pp", "ep", "dp_shard")), 8)
    assert "('pp', 'ep', 'dp_shard')" in str(refused.value)
    assert "('pp', 'dp', 'ep') or ('pp', 'dp_shard', 'ep') for expert" in str(refused.value)
