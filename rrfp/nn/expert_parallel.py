"""Expert parallelism: a MoE layer's routed experts sharded over an EP group (dim 0 of ``w1``,
``w2``, ``w3``), the token copies dispatched to the member that holds their expert and combined
back with ``all_to_all_single``.

``ExpertParallel`` replaces ``MoELayer.experts`` and keeps its call, ``forward(x_sorted, counts)``
with ``counts`` over every global expert and the rows sorted by global expert id (docs/moe.md).
Member ``r`` of an EP group of ``n`` holds experts ``[r E/n, (r+1) E/n)``. One call is three
all-to-alls over the group, in this order on every member: the per-expert counts (so each member
learns how many rows it receives: the splits are uneven), the rows (dispatch), and after the local
experts ran, their outputs (combine). Autograd runs through both row all-to-alls, which swap their
splits in backward: the input gradients travel back in B, and the experts' weight gradients stay
local (deferred to W under a split backward by the local experts as they would be without EP).

The collectives are synchronous and run on the thread that computes the task (the lane), entered
through the task's marker (collective_marks.py) so that a peer that never comes is named. The
members of a group must therefore enter their MoE tasks in one order: the executor's EP agreement
(rrfp/comm/ep_agreement.py) sees to it. The group is used for nothing else meanwhile.

Under emulated time the layer spends its experts' and all-to-alls' time on the task's clock
(expert_time.py), from the rows this member received and exchanged.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from rrfp.nn import expert_time
from rrfp.nn.collective_marks import marked

__all__ = ["ExpertParallel", "EXPERT_WEIGHTS", "expert_parameters", "shard_experts"]

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # the routed experts' parameters, sharded along dim 0


def _all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    what: str,
    layer,
    timed: bool = False,
) -> torch.Tensor:
    """``timed``: a row all-to-all, whose transfer an emulating task's clock spends first."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    clock = expert_time.current() if timed else None
    link: contextlib.AbstractContextManager = contextlib.nullcontext()
    if clock is not None:  # the rows this member sends to or receives from the others
        me = dist.get_rank(group)
        moved = max(sum(out_splits) - out_splits[me], sum(in_splits) - in_splits[me])
        link = clock.link(moved, len(out_splits))
    with link, marked(what, layer, group):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits`` to each member, ``out_splits`` from each; backward: the gradients back,
    splits swapped. ``expert_rows``: the dispatch's, whose backward follows the local experts'
    backward over that many rows (their time, on an emulating task's clock)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what, layer, expert_rows=None):
        ctx.args = (out_splits, in_splits, group, what, layer, expert_rows)
        return _all_to_all(x, out_splits, in_splits, group, what, layer, timed=True)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, what, layer, expert_rows = ctx.args
        clock = expert_time.current()
        if clock is not None and expert_rows is not None:
            clock.experts(expert_rows)
        back = _all_to_all(
            grad, in_splits, out_splits, group, f"{what} (backward)", layer, timed=True
        )
        return back, None, None, None, None, None, None


class ExpertParallel(nn.Module):
    """``experts`` (a ``GroupedExperts`` of every global expert) sharded over ``group``: this
    member keeps its slice as its own ``w1``, ``w2``, ``w3`` (the names checkpoints and the
    gradient sync read) and computes with a copy of ``experts`` shaped for that slice."""

    def __init__(self, experts: nn.Module, group) -> None:
        super().__init__()
        self.group = group
        self.size, self.member = dist.get_world_size(group), dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)  # the members, by global rank
        if self.member < 0:
            raise ValueError(
                f"rrfp: this process (global rank {dist.get_rank()}) is not a member of the EP "
                "group it was given"
            )
        total = experts.w1.shape[0]
        if total % self.size:
            raise ValueError(
                f"the model's {total} experts do not split over an EP group of {self.size}: "
                "choose [parallel] ep dividing num_experts"
            )
        self.num_experts, self.local_experts = total, total // self.size
        lo, hi = self.member * self.local_experts, (self.member + 1) * self.local_experts
        full = {n: getattr(experts, n) for n in EXPERT_WEIGHTS}
        for n in EXPERT_WEIGHTS:  # not deep-copied: the full tensors are not kept
            setattr(experts, n, None)
        local = copy.deepcopy(experts)
        for n, p in full.items():
            setattr(experts, n, p)
            shard = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
            setattr(local, n, shard)
            self.register_parameter(n, shard)  # the same Parameter: its name here is experts.wN
        if hasattr(local, "num_experts"):
            local.num_experts = self.local_experts
        object.__setattr__(self, "local", local)  # not a submodule: its parameters are ours

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x_sorted.is_meta:  # shapes only (the start checks' measurement): no peer to ask
            return torch.empty_like(x_sorted)
        n, k = self.size, self.local_experts
        counts = counts.to(torch.int64)
        # each member learns how many rows of each of its experts every member sends
        got = _all_to_all(counts, [k] * n, [k] * n, self.group, "EP count all-to-all", self)
        send = counts.view(n, k).sum(1).tolist()
        by_source = got.view(n, k)  # [source member, local expert]
        recv = by_source.sum(1).tolist()
        received = sum(recv)
        rows = _AllToAll.apply(
            x_sorted, recv, send, self.group, "EP dispatch all-to-all", self, received
        )
        # rows arrive by source member, each source's sorted by local expert: sort by local expert
        order = _by_expert(by_source).to(x_sorted.device)
        clock = expert_time.current()
        if clock is not None:
            clock.experts(received)
        y = self.local(rows.index_select(0, order), by_source.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0, back)
        return _AllToAll.apply(y, send, recv, self.group, "EP combine all-to-all", self)

    def extra_repr(self) -> str:
        lo = self.member * self.local_experts
        return f"experts {lo}..{lo + self.local_experts - 1} of {self.num_experts}, ep={self.size}"


def _by_expert(by_source: torch.Tensor) -> torch.Tensor:
    """Row indices that regroup rows laid out [source][local expert] as [local expert][source]."""
    n, k = by_source.shape
    starts = torch.cumsum(by_source.flatten(), 0) - by_source.flatten()
    starts = starts.view(n, k)
    parts = [
        torch.arange(int(starts[j, e]), int(starts[j, e] + by_source[j, e]))
        for e in range(k)
        for j in range(n)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def expert_parameters(module: nn.Module) -> set[int]:
    """The ids of ``module``'s expert-parallel shards: each EP member holds different experts, so
    their gradients are not averaged with the other members' (rrfp/comm/grad_sync.py)."""
    return {
        id(getattr(m, n))
        for m in module.modules()
        if isinstance(m, ExpertParallel)
        for n in EXPERT_WEIGHTS
    }


def shard_experts(module: nn.Module, group) -> int:
    """Replace the routed experts of every MoE layer in ``module`` (a submodule ``experts`` with
    ``w1``, ``w2``, ``w3``) by ``ExpertParallel`` over ``group``; returns how many it replaced."""
    layers = [
        m
        for m in module.modules()
        if isinstance(getattr(m, "experts", None), nn.Module)
        and not isinstance(m.experts, ExpertParallel)
        and all(isinstance(getattr(m.experts, n, None), nn.Parameter) for n in EXPERT_WEIGHTS)
    ]
    for m in layers:
        m.experts = ExpertParallel(m.experts, group)
    return len(layers)
