"""Counting each parameter's gradient accumulations: the split backward must accumulate each one
exactly as often as autograd does."""

from __future__ import annotations

from torch import nn


def count_hooks(module: nn.Module, calls: dict) -> None:
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1)
        )
