"""A HuggingFace mixture of experts' router statistics per step (Qwen3-MoE, Mixtral), as rrfp's
own MoE layers keep theirs (rrfp.nn.moe_layer): the token copies each expert received, the
weighted balance loss the layer added (rrfp/hf/router_aux_loss.py), the microbatches counted, and
no dropped copies (HF's experts compute every copy routed to them).

A forward hook on each block's router (``gate``, which returns the logits, the gates and the
chosen experts' ids) counts the ids of every training forward. A recomputation (HF's activation
checkpointing) runs inside the backward and is not counted again, nor is a forward without
gradients (evaluation). ``rrfp train`` reads the counts once per step
(rrfp/app/train/router_statistics.py).
"""

from __future__ import annotations

import torch
from torch import nn

from rrfp.nn.moe_layer import RouterStep

ATTRIBUTE = "router_steps"  # a hooked router's RouterSteps


class RouterSteps:
    """One router's statistics over the step so far."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._clear()

    def _clear(self) -> None:
        self.tokens: torch.Tensor | None = None
        self.aux, self.microbatches = 0.0, 0

    @staticmethod
    def counting(t: torch.Tensor) -> bool:
        """Whether a forward that made ``t`` counts: with gradients, not shapes only, not a
        recomputation inside a backward."""
        return torch.is_grad_enabled() and not t.is_meta and torch._C._current_graph_task_id() == -1

    def record(self, ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).detach()
        self.tokens = counts if self.tokens is None else self.tokens + counts
        self.microbatches += 1

    def add_aux(self, aux: torch.Tensor) -> None:
        self.aux += float(aux.detach())

    def take_step(self) -> RouterStep:
        """The step's statistics, cleared for the next step."""
        tokens = self.tokens if self.tokens is not None else torch.zeros(self.num_experts)
        step = RouterStep(tokens.to(torch.int64).cpu(), self.aux, self.microbatches, 0)
        self._clear()
        return step


def _count(router: nn.Module, args, output) -> None:
    _, _, ids = output
    if RouterSteps.counting(ids):
        getattr(router, ATTRIBUTE).record(ids)


def count_routes(blocks: list[nn.Module]) -> None:
    """Give each sparse block's router (``gate``) its RouterSteps and the hook that fills it."""
    for block in blocks:
        setattr(block.gate, ATTRIBUTE, RouterSteps(block.gate.num_experts))
        block.gate.register_forward_hook(_count)


def router_steps(modules) -> list[RouterSteps]:
    """Every hooked router's RouterSteps in ``modules`` (an nn.Module or a list of them), in
    module order."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    return [
        steps
        for module in modules
        for m in module.modules()
        if (steps := getattr(m, ATTRIBUTE, None)) is not None
    ]
