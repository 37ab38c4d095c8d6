"""Data-parallel gradient averaging over a stage's DP group, in flat buckets
(as DDP does) so a model with many small parameters costs a few collectives."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rrfp.loop.completions import BlockingWaiter
from rrfp.comm.channels import named_collective


class GradSync:
    def __init__(self, module: nn.Module, group, size: int, bucket_bytes: int = 4 << 20) -> None:
        self.group, self.size = group, size
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current, nbytes = [], 0
        for p in self.params:
            if current and (nbytes + p.numel() * p.element_size() > bucket_bytes or p.dtype != current[0].dtype):
                self.buckets.append(current)
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            self.buckets.append(current)
        self.waiter = BlockingWaiter("dp-sync") if size > 1 else None

    def _reduce(self) -> None:
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat /= self.size
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n

    async def sync(self) -> None:
        """Average every gradient across the replicas (no-op when dp = 1)."""
        if self.waiter is not None:
            with named_collective(f"DP gradient all-reduce over ranks {dist.get_process_group_ranks(self.group)}"):
                await self.waiter.call(self._reduce)

    def close(self) -> None:
        if self.waiter is not None:
            self.waiter.close()
