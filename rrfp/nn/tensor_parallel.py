"""Megatron-style tensor-parallel linears that are also split-aware.

``ColumnParallelLinear`` holds rows ``[out/tp, in]`` of the full weight: its input
goes through "copy to the TP region" (identity forward, all-reduce SUM of the input
gradient in backward) and its output is the local shard, not gathered.
``RowParallelLinear`` holds columns ``[out, in/tp]``: its input is already sharded,
its output is the all-reduce SUM of the local products ("reduce from the TP
region": all-reduce forward, identity backward), and its bias (whole, replicated)
is added once after the reduce.

Both defer their weight and bias gradients to W exactly like SplitLinear: they
run through ``rrfp.nn.split_linear.linear`` with the queue captured at forward
time (``collect_weight_grads``); without an active queue they are plain autograd.
The input-gradient all-reduce is part of B. W launches no collective.

Collectives are synchronous ``torch.distributed.all_reduce(t, group=group)``
calls, made by whichever thread runs F and B (the compute lane). TP ranks must
therefore run the same task sequence (docs/design.md, fact 5), and the group should be
used for nothing else concurrently (the TP agreement has its own control group).
With ``group=None`` or a group of size 1 no collective is ever launched. Each collective is
entered through the marker of the task that runs it (collective_marks.py), so that a TP peer that
never comes is named.

Parameters are initialised as the *full* layer (nn.Linear's init on the full
shape, same random draws), then sliced: a TP layer built from the same seed as an
nn.Linear / SplitLinear is that layer's exact slice. ``load_full`` (or
``from_full``) slices given full tensors; ``shard_from_full`` is the rule.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from rrfp.nn.collective_marks import marked
from rrfp.nn.split_linear import init_like_linear, linear

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "shard_from_full",
    "group_size_rank",
    "sharded_parameters",
]


def group_size_rank(group) -> tuple[int, int]:
    """(tp size, this process's index in it); (1, 0) for ``None``."""
    if group is None:
        return 1, 0
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the TP group"
        )
    return size, rank


def shard_from_full(
    full: torch.Tensor, dim: int | None, tp_rank: int, tp: int, chunks: int = 1
) -> torch.Tensor:
    """TP rank ``tp_rank``'s slice of ``full`` along ``dim`` (a new contiguous tensor).

    ``dim=None``: replicated, the whole tensor. ``chunks > 1``: ``full`` is
    ``chunks`` equal blocks along ``dim`` (a fused q|k|v projection), each split
    across the TP ranks; the shard is the rank's slice of every block,
    concatenated in block order.
    """
    if dim is None:
        return full.detach().clone()
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
    size = full.size(dim)
    if size % (chunks * tp):
        raise ValueError(
            f"dimension {dim} of size {size} does not split into {chunks} block(s) x tp={tp}"
        )
    part = size // (chunks * tp)
    blocks = full.detach().chunk(chunks, dim) if chunks > 1 else (full.detach(),)
    return torch.cat([b.narrow(dim, tp_rank * part, part) for b in blocks], dim)


def _all_reduce(t: torch.Tensor, group, what: str, layer: nn.Module) -> torch.Tensor:
    """All-reduce SUM of ``t`` over ``group``, in place: ``layer``'s collective ``what``."""
    with marked(what, layer, group):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce SUM of the gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        what = "column-parallel input-gradient all-reduce"
        return _all_reduce(grad, ctx.group, what, ctx.layer), None, None


class _TPLinear(nn.Module):
    """Shared parts: sizes, full-shape init, slicing. Subclasses set ``shard_dims``."""

    shard_dims: dict[
        str, int | None
    ]  # parameter name -> sharded dim of the full tensor (None: whole)
    defers_weight_grad = True  # under a split backward its parameters' gradients are final after W

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group,
        bias: bool = True,
        *,
        chunks: int = 1,
        name: str | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kind = type(self).__name__
        label = f"{kind} {name!r}" if name else kind
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"{label} sizes must be positive, got {in_features}x{out_features}")
        if chunks <= 0:
            raise ValueError(f"{label}: chunks must be positive, got {chunks}")
        tp, rank = group_size_rank(group)
        self.group = group if tp > 1 else None  # size 1: never launch a collective
        self.tp, self.tp_rank, self.chunks = tp, rank, chunks
        self.in_features, self.out_features = in_features, out_features
        self._check_divisible(label)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self._local_shape("weight"), **kw))
        self.bias = nn.Parameter(torch.empty(self._local_shape("bias"), **kw)) if bias else None
        self.reset_parameters()

    # -- shapes and slicing ------------------------------------------------------

    def _full_shape(self, pname: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if pname == "weight" else (self.out_features,)

    def _local_shape(self, pname: str) -> tuple[int, ...]:
        shape, dim = list(self._full_shape(pname)), self.shard_dims[pname]
        if dim is not None:
            shape[dim] //= self.tp
        return tuple(shape)

    def _check_divisible(self, label: str) -> None:
        raise NotImplementedError

    def shard(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full (unsharded) parameter ``pname``."""
        if tuple(full.shape) != self._full_shape(pname):
            raise ValueError(
                f"{type(self).__name__}.{pname}: full shape {tuple(full.shape)} "
                f"!= expected {self._full_shape(pname)}"
            )
        return shard_from_full(full, self.shard_dims[pname], self.tp_rank, self.tp, self.chunks)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take this rank's slice of the full layer's weight (and bias)."""
        self.weight.copy_(self.shard("weight", weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError(f"{type(self).__name__} has a bias but load_full got none")
            self.bias.copy_(self.shard("bias", bias))
        elif bias is not None:
            raise ValueError(f"{type(self).__name__} has no bias but load_full got one")

    @classmethod
    def from_full(cls, linear: nn.Module, group, *, chunks: int = 1, name: str | None = None):
        """The TP shard of a full linear (nn.Linear / SplitLinear); consumes no random numbers."""
        w = linear.weight
        out_f, in_f = w.shape
        layer = cls(
            in_f,
            out_f,
            group,
            bias=linear.bias is not None,
            chunks=chunks,
            name=name,
            device="meta",
            dtype=w.dtype,
        )
        layer = layer.to_empty(device=w.device)
        layer.load_full(w, linear.bias)
        return layer

    def reset_parameters(self) -> None:
        """nn.Linear's init drawn on the full shape, then sliced (same draws as nn.Linear)."""
        dev, dt = self.weight.device, self.weight.dtype
        w = torch.empty(self._full_shape("weight"), device=dev, dtype=dt)
        b = (
            None
            if self.bias is None
            else torch.empty(self._full_shape("bias"), device=dev, dtype=dt)
        )
        init_like_linear(w, b)
        if dev.type != "meta":
            self.load_full(w, b)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp}, tp_rank={self.tp_rank}"
            + (f", chunks={self.chunks}" if self.chunks > 1 else "")
        )


class ColumnParallelLinear(_TPLinear):
    """y_local = x @ W[rows of this rank].T + b[same rows]; weight shard [out/tp, in].

    ``chunks=3`` for a fused q|k|v projection: each of the three output blocks is
    split across ranks, so every rank gets its own heads' q, k and v rows.
    """

    shard_dims = {"weight": 0, "bias": 0}

    def _check_divisible(self, label: str) -> None:
        if self.out_features % (self.chunks * self.tp):
            blocks = (
                f" in {self.chunks} blocks of {self.out_features // self.chunks}"
                if self.chunks > 1
                else ""
            )
            raise ValueError(
                f"{label}: out_features={self.out_features}{blocks} is not divisible by "
                f"the tensor-parallel size {self.tp}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            x = _CopyToTP.apply(x, self.group, self)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(_TPLinear):
    """y = all_reduce(x_local @ W[:, cols of this rank].T) + b; weight shard [out, in/tp], bias
    whole."""

    shard_dims = {"weight": 1, "bias": None}

    def _check_divisible(self, label: str) -> None:
        if self.chunks != 1:
            raise ValueError(f"{label}: chunks is for column-parallel layers, got {self.chunks}")
        if self.in_features % self.tp:
            raise ValueError(
                f"{label}: in_features={self.in_features} is not divisible by "
                f"the tensor-parallel size {self.tp}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = (
            None
            if self.group is None
            else partial(_all_reduce, group=self.group, what="row-parallel all-reduce", layer=self)
        )
        return linear(x, self.weight, self.bias, reduce)


def sharded_parameters(module: nn.Module) -> set[int]:
    """The ids of ``module``'s parameters that are TP shards (each TP rank holds a different part);
    every other parameter is replicated across the TP group, whole and with the same gradient."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, _TPLinear) and m.tp > 1
        for name, dim in m.shard_dims.items()
        if dim is not None
        for p in [getattr(m, name)]
        if p is not None
    }
