"""What crosses a stage boundary: tensors without their graph, each marked if it requires grad.

A sending stage detaches its outputs; what it knows before that, and the receiver needs, is which
of them carry a gradient. Those become autograd leaves at the receiver and get a gradient sent
back; a constant the sender produced without ``requires_grad`` (rotary cos/sin, an additive
float mask, positions) arrives as a constant, and its slot in the B message is None. The bits
travel in the message header (rrfp/comm/message.py) or, between two stages of one rank (the V
turn), along with the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _flat(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def requires_grad_bits(value) -> list[bool]:
    """Whether each tensor of a stage output (tensor, None, tuple/list of them) has a gradient."""
    return [
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
        for t in _flat(value)
    ]


def leaf(t, requires_grad: bool = True):
    """A received tensor as an autograd leaf: a floating one requires grad when its sender's did.
    Anything else (None) passes as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t


def received(value, bits: Sequence[bool] | None):
    """``value`` (a tensor, or a tuple of tensors and None) as leaves per ``bits``, one per tensor;
    ``bits`` None: every floating tensor requires grad (a caller that drives workers by hand)."""
    items = _flat(value)
    if bits is None:
        bits = [True] * len(items)
    if len(bits) != len(items):
        raise ValueError(f"{len(bits)} requires-grad bit(s) for {len(items)} received tensor(s)")
    if isinstance(value, (tuple, list)):
        return tuple(leaf(t, b) for t, b in zip(items, bits))
    return leaf(value, bits[0])
