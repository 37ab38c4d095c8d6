"""A mixture of experts' router statistics per step, and DeepSeek-V3's bias update after it.

Each rank reads its MoE layers' step statistics (rrfp.nn.moe_layer; a HuggingFace mixture of
experts' routers keep the same, rrfp/hf/router_steps.py) once the iteration is done:
the weighted auxiliary loss of its layers (each layer's mean over the step's microbatches, as the
loss is), the token copies nothing computed (``dropped``: 0, the layers are dropless) and the
most loaded expert's tokens over the mean, for its worst layer. They ride in the step's statistics
all-reduce like the loss: the auxiliary loss summed over stages and averaged over replicas, the
dropped copies summed, the load ratio in the rank's own slot (the report shows the largest).

After the optimizer step, the layers with a bias update move their expert bias against the step's
load, summed over the data-parallel replicas of the stage first, so every replica moves alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rrfp.comm import collectives
from rrfp.hf.router_steps import RouterSteps, router_steps
from rrfp.nn.moe_layer import MoELayer, RouterStep, moe_layers


@dataclass
class RankRouting:
    """One rank's part of the step's router statistics."""

    aux_loss: float = 0.0  # its layers' weighted auxiliary losses, each a mean over microbatches
    dropped: float = 0.0  # token copies routed but not computed
    load_max_over_mean: float = 0.0  # its worst layer's most loaded expert over the mean load


class RouterStatistics:
    """The MoE layers of a rank's stage modules; empty (and every call a no-op) without any."""

    def __init__(self, modules) -> None:
        self.layers: list[MoELayer | RouterSteps] = [*moe_layers(modules), *router_steps(modules)]
        self.steps: list[RouterStep] = []

    def __bool__(self) -> bool:
        return bool(self.layers)

    def take(self) -> RankRouting:
        """Read and clear the layers' statistics of the step just computed."""
        self.steps = [layer.take_step() for layer in self.layers]
        mine = RankRouting()
        for st in self.steps:
            if st.microbatches:
                mine.aux_loss += st.aux_loss / st.microbatches
            mine.dropped += st.dropped
            load = st.tokens_per_expert.to(torch.float64)
            if load.sum() > 0:
                ratio = float(load.max() / load.mean())
                mine.load_max_over_mean = max(mine.load_max_over_mean, ratio)
        return mine

    def own_steps(self) -> list[RouterStep]:
        """The step's statistics of rrfp's own MoE layers (not an HF router's), in layer order:
        what the routing record reads, forward by forward."""
        return [
            st
            for layer, st in zip(self.layers, self.steps, strict=True)
            if isinstance(layer, MoELayer)
        ]

    async def update_biases(self, poller, dp_group, what: str) -> None:
        """DeepSeek-V3's bias update of every layer that has one, from the load of the step just
        taken summed over ``dp_group`` (None: a group of one)."""
        moving = [
            (layer, st)
            for layer, st in zip(self.layers, self.steps, strict=True)
            if isinstance(layer, MoELayer) and layer.router.bias_update_rate > 0
        ]
        if not moving:
            return
        loads = torch.stack([st.tokens_per_expert for _, st in moving])
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            device = moving[0][0].router.expert_bias.device
            loads = await collectives.all_reduce(poller, loads.to(device), what, group=dp_group)
        for (layer, _), load in zip(moving, loads, strict=True):
            layer.update_bias(load)
