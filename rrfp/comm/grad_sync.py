"""Data-parallel gradient averaging over a stage's DP group, in flat buckets
(as DDP does), the all-reduces launched as soon as the gradients are final.

With a split backward every weight gradient is computed in W (split-aware
layers queue theirs, the rest are split with autograd), so the buckets go out
when the stage's last W finishes; otherwise when its last B does. That is
inside the iteration, before the executor returns, and every replica
launches the same buckets in the same order. The all-reduces are async Work
awaited through the loop's poller: no thread per collective.

A parameter without a gradient (unused this step) counts as zeros, so every
replica keeps the same flat layout; each bucket also carries one presence
count per parameter, so a parameter unused on every replica keeps
``grad = None`` (and the optimizer leaves it alone), as it would without DP.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from rrfp.comm.collectives import completed
from rrfp.core.tasks import Kind, Task
from rrfp.loop.completions import CompletionPoller


class GradSync:
    def __init__(self, module: nn.Module, group, size: int, poller: CompletionPoller, lane=None,
                 bucket_bytes: int = 4 << 20, deadline_s: float | None = None) -> None:
        self.group, self.size, self.poller, self.bucket_bytes = group, size, poller, bucket_bytes
        self.deadline_s = deadline_s  # NCCL: rrfp's peer deadline, before the watchdog's
        self.lane = lane  # gradients are written in the lane's order (its stream on GPU): read them there
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.ranks = dist.get_process_group_ranks(group) if size > 1 else []
        self.buckets = self._bucket()
        self._final, self._M = Kind.B, 0  # attach() sets them from the executor
        self._reset()
        self.launched_early = 0  # buckets launched before sync() was called, over all iterations

    def _bucket(self) -> list[list[nn.Parameter]]:
        """Flat buckets in parameter order, by size and dtype."""
        buckets, current, nbytes = [], [], 0
        for p in self.params:
            size = p.numel() * p.element_size()
            if current and (nbytes + size > self.bucket_bytes or p.dtype != current[0].dtype):
                buckets.append(current)
                current, nbytes = [], 0
            current.append(p)
            nbytes += size
        return buckets + ([current] if current else [])

    def _reset(self) -> None:
        self._finished = 0  # tasks of the finalising kind done this iteration
        self._launched = False
        self._inflight: list[tuple[list[nn.Parameter], torch.Tensor, set[int], object]] = []

    def attach(self, executor) -> None:
        """Launch the buckets from inside ``executor``'s iterations, once the gradients are final:
        after the last W with a split backward, after the last B otherwise (of every stage of the
        rank, with virtual stages)."""
        if self.size > 1:
            self._final = Kind.W if executor.settings.split else Kind.B
            self._M = executor.M * len(executor.workers)
            executor.on_task_done.append(self._task_done)

    def _task_done(self, task: Task) -> None:
        if task.kind is self._final:
            self._finished += 1
            if self._finished == self._M and not self._launched:
                self.launched_early += len(self.buckets)
                self._launch()

    def _launch(self) -> None:
        if self._launched:
            return
        self._launched = True
        with self._in_lane_order():
            for bucket in self.buckets:
                # the gradients, then one presence count per parameter (1: this replica has a gradient)
                # filled on the device: a host list copied there would wait for the lane's queued work
                missing = {i for i, p in enumerate(bucket) if p.grad is None}
                present = torch.ones(len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                for i in missing:
                    present[i] = 0
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in bucket] + [present])
                self._inflight.append((bucket, flat, missing,
                                       dist.all_reduce(flat, group=self.group, async_op=True)))

    def _in_lane_order(self):
        return self.lane.stream_context() if self.lane is not None else contextlib.nullcontext()

    async def sync(self) -> None:
        """Average every gradient across the replicas (no-op when dp = 1)."""
        if self.size == 1:
            return
        self._launch()  # if no executor hook launched them yet
        try:
            for bucket, flat, missing, work in self._inflight:
                await completed(self.poller, work, f"DP gradient all-reduce over ranks {self.ranks}", self.deadline_s)
                with self._in_lane_order():
                    # read the presence counts only where this replica had no gradient (a device sync)
                    present = flat[-len(bucket):].tolist() if missing else [1] * len(bucket)
                    flat /= self.size
                    offset = 0
                    for p, used in zip(bucket, present):
                        n = p.numel()
                        p.grad = flat[offset:offset + n].view_as(p).clone() if used else None
                        offset += n
            if self.lane is not None:
                self.lane.caller_waits()  # the optimizer step runs after the averaged gradients exist
        finally:
            self._reset()
