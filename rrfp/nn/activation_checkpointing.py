"""Per-block activation checkpointing: each block keeps only its input from F, and its forward
runs again in the backward (torch.utils.checkpoint, non-reentrant).

The block's ``forward`` is wrapped in place, so the module tree, parameter names, ties, hooks and
checkpoint keys stay those of the model. Non-reentrant checkpointing leaves ordinary autograd nodes
in the graph, which the split backward (rrfp/pipeline/split_backward/weight_split.py) cuts into B
and W as any other; W recomputes each region once for all its calls. Without grad mode
(evaluation) a block runs plainly: there is no backward to save for.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_rrfp_checkpointed"


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> int:
    """Wrap each block's forward (its class's) in torch.utils.checkpoint(use_reentrant=False); a
    block already wrapped is left as it is. The wrapper is a method bound to the block, so a deep
    copy of the module is bound to the copy. Returns how many blocks are wrapped now."""
    wrapped = 0
    for block in blocks:
        if not getattr(block, _MARK, False):
            block.forward = types.MethodType(_checkpointed_forward, block)
            setattr(block, _MARK, True)
        wrapped += 1
    return wrapped


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
