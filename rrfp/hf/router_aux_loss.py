"""The load-balancing loss of a HuggingFace mixture of experts (Qwen3-MoE, Mixtral), per layer.

With ``output_router_logits`` HF adds ``router_aux_loss_coef * load_balancing_loss_func(every
layer's router logits)`` to the loss at the model's end. That function averages the experts' token
fractions and probabilities over all layers together before it multiplies them, so no pipeline
stage, holding some of the layers, can compute it, and the loss function sees only the last
stage's output. rrfp.hf therefore splits it by layer: each MoE layer's router adds
``router_aux_loss_coef / L * load_balancing_loss_func((its own logits,))`` (the family's function
on that one layer; L the model's MoE layers, so when every layer routes alike it is HF's value),
its gradient injected where the router runs (rrfp/nn/moe_aux_loss.py), on every stage. Padding is
counted like any token: the router sees no attention mask.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from rrfp.hf.router_steps import ATTRIBUTE
from rrfp.nn.moe_aux_loss import inject


def moe_blocks(layers) -> list[nn.Module]:
    """The decoder layers' sparse MLP blocks (a ``gate`` router and ``experts``), in order."""
    return [
        layer.mlp
        for layer in layers
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")
    ]


def _balance_loss(block: nn.Module) -> Callable:
    """The family's ``load_balancing_loss_func``, from the module that defines the block."""
    return importlib.import_module(type(block).__module__).load_balancing_loss_func


def add_router_aux_losses(blocks: list[nn.Module], config, moe_layers: int) -> int:
    """Hook each block's router so that its layer's share of the balance loss reaches the
    gradients (nothing without ``config.output_router_logits``). Returns the blocks hooked."""
    if not getattr(config, "output_router_logits", False) or not blocks:
        return 0
    coeff = float(getattr(config, "router_aux_loss_coef", 0.0)) / moe_layers
    balance = _balance_loss(blocks[0])
    top_k = config.num_experts_per_tok

    def hook(router: nn.Module, args, output):
        logits, weights, ids = output
        aux = coeff * balance((logits,), router.num_experts, top_k)
        steps = getattr(router, ATTRIBUTE, None)  # the router's statistics (router_steps.py)
        if steps is not None and steps.counting(logits):
            steps.add_aux(aux)
        return logits, inject(weights, aux), ids

    for block in blocks:
        block.gate.register_forward_hook(hook)
    return len(blocks)
