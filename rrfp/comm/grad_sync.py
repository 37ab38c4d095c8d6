"""Data-parallel gradient averaging over a stage's DP group, in flat buckets
(as DDP does), the all-reduces launched as soon as the gradients are final.

With a split backward every weight gradient is computed in W (split-aware
layers queue theirs, the rest are split with autograd), so the buckets go out
when the stage's last W finishes; otherwise when its last B does. That is
inside the iteration, before the executor returns, and every replica
launches the same buckets in the same order. The all-reduces are async Work
awaited through the loop's poller: no thread per collective. When several
iterations accumulate gradients before one ``sync()``, the first one's buckets
went out stale: ``sync()`` waits for them (every replica launched them) and
averages afresh, one wasted all-reduce per step.

A parameter without a gradient (unused this step) counts as zeros, so every
replica keeps the same flat layout; each bucket also carries one presence
count per parameter, so a parameter unused on every replica keeps
``grad = None`` (and the optimizer leaves it alone), as it would without DP.

The buckets hold the parameters that require grad; when that set changes
(progressive unfreezing, freezing) they are rebuilt at the next launch. The
layout is decided from ``requires_grad``, which the same user code sets alike
on every replica, never from which gradients exist, which differs between
replicas: replicas with different layouts would pair all-reduces of different
sizes. A sparse gradient (``nn.Embedding(sparse=True)``) is averaged dense and
handed back sparse, as sparse optimizers (``SparseAdam``) need; its rows that
average to exactly zero are left out.

Expert-parallel shards (``experts``: their ids) are not in the buckets: each member of an EP group
holds different experts, whose gradients already sum every member's tokens that reached them
(the all-to-alls carried them back). They are summed over ``expert_group``, the replicas holding
the same experts (none when dp = ep), and divided by dp like every other gradient: each replica's
loss counts once in the mean over replicas.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from rrfp.comm.collectives import completed
from rrfp.core.tasks import Kind, Task
from rrfp.loop.completions import CompletionPoller

log = logging.getLogger("rrfp.comm.grad_sync")


class GradSync:
    def __init__(
        self,
        module: nn.Module,
        group,
        size: int,
        poller: CompletionPoller,
        lane=None,
        bucket_bytes: int = 4 << 20,
        deadline_s: float | None = None,
        experts: set[int] | None = None,
        expert_group=None,
    ) -> None:
        self.group, self.size, self.poller, self.bucket_bytes = group, size, poller, bucket_bytes
        self.deadline_s = deadline_s  # NCCL: rrfp's peer deadline, before the watchdog's
        self.lane = (
            lane  # gradients are written in the lane's order (its stream on GPU): read them there
        )
        self.module = module
        self.experts = experts or set()  # ids of the expert-parallel shards: not in the buckets
        self.expert_group = expert_group  # the replicas holding this rank's experts, or None
        self.params = self._trainable()
        self.ranks = dist.get_process_group_ranks(group) if size > 1 else []
        self.buckets = self._bucket()
        self._final, self._M = Kind.B, 0  # attach() sets them from the executor
        self._ties = None  # the executor's tied parameters: summed after the averaging (attach)
        self._reset()
        self.launched_early = 0  # buckets launched before sync() was called, over all iterations

    def _trainable(self) -> list[nn.Parameter]:
        return [
            p for p in self.module.parameters() if p.requires_grad and id(p) not in self.experts
        ]

    def _refresh(self) -> None:
        """Rebuild the buckets if the parameters requiring grad changed since they were made: an
        unfrozen one would otherwise never be averaged, a frozen one's stale gradient would be."""
        now = self._trainable()
        if len(now) == len(self.params) and all(a is b for a, b in zip(now, self.params)):
            return
        before = len(self.params)
        self.params = now
        self.buckets = self._bucket()
        log.info(
            "DP gradient buckets over ranks %s rebuilt: %d parameters require grad now (%d "
            "before), %d buckets",
            self.ranks,
            len(now),
            before,
            len(self.buckets),
        )

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
        self._stale = (
            False  # a final task finished after the launch: the buckets miss its gradients
        )
        # (bucket, flat gradients and tail, missing indices, sparse_dim by index, the all-reduce's
        # Work)
        self._inflight: list[
            tuple[list[nn.Parameter], torch.Tensor, set[int], dict[int, int], object]
        ] = []

    def attach(self, executor) -> None:
        """Launch the buckets from inside ``executor``'s iterations, once the gradients are final:
        after the last W with a split backward, after the last B otherwise (of every stage of the
        rank, with virtual stages)."""
        if self.size > 1:
            self._final = Kind.W if executor.settings.split else Kind.B
            self._M = executor.M * len(executor.workers)
            executor.on_task_done.append(self._task_done)
            ties = getattr(executor, "ties", None)
            if (
                ties is not None
            ):  # the buckets hold the gradients of before the tie sum: sum after averaging
                ties.deferred, self._ties = True, ties

    def _task_done(self, task: Task) -> None:
        if task.kind is self._final:
            if (
                self._launched
            ):  # another iteration before sync(): gradients accumulate past the launch
                self._stale = True
                return
            self._finished += 1
            if self._finished == self._M and not self._launched:
                self._launch()
                self.launched_early += len(self.buckets)

    def _launch(self) -> None:
        if self._launched:
            return
        self._launched = True
        self._refresh()
        with self._in_lane_order():
            for bucket in self.buckets:
                # the gradients, then one presence count per parameter (1: this replica has a
                # gradient) and one sparse_dim per parameter (0: dense or none), filled on the
                # device: a host list copied there would wait for the lane's queued work
                n = len(bucket)
                grads = [p.grad for p in bucket]
                missing = {i for i, g in enumerate(grads) if g is None}
                sparse = {
                    i: g.sparse_dim() for i, g in enumerate(grads) if g is not None and g.is_sparse
                }
                tail = torch.zeros(2 * n, dtype=bucket[0].dtype, device=bucket[0].device)
                tail[:n] = 1
                for i in missing:
                    tail[i] = 0
                for i, dims in sparse.items():
                    tail[n + i] = dims
                flat = torch.cat([_dense(g, p).reshape(-1) for g, p in zip(grads, bucket)] + [tail])
                self._inflight.append(
                    (
                        bucket,
                        flat,
                        missing,
                        sparse,
                        dist.all_reduce(flat, group=self.group, async_op=True),
                    )
                )

    def _in_lane_order(self):
        return self.lane.stream_context() if self.lane is not None else contextlib.nullcontext()

    async def _completed(self, work) -> None:
        await completed(
            self.poller,
            work,
            f"DP gradient all-reduce over ranks {self.ranks}",
            self.deadline_s,
            self.group,
        )

    async def sync(self) -> None:
        """Average every gradient across the replicas (no-op when dp = 1)."""
        if self.size == 1:
            return
        self._launch()  # if no executor hook launched them yet
        try:
            if self._stale:  # every replica ran the same iterations, so every one relaunches alike
                for *_, work in self._inflight:
                    await self._completed(work)
                self._inflight, self._launched = [], False
                self._launch()
            for bucket, flat, missing, sparse, work in self._inflight:
                await self._completed(work)
                with self._in_lane_order():
                    n = len(bucket)
                    if (
                        missing
                    ):  # read the counts only where this replica had no gradient (a device sync)
                        tail = flat[-2 * n :].tolist()
                        present = tail[:n]
                        sparse = {
                            i: round(dims / used)
                            for i, (used, dims) in enumerate(zip(present, tail[n:]))
                            if used and dims
                        }
                    else:
                        present = [1] * n
                    flat /= self.size
                    offset = 0
                    for i, (p, used) in enumerate(zip(bucket, present)):
                        size = p.numel()
                        mean = flat[offset : offset + size].view_as(p)
                        p.grad = (
                            None
                            if not used
                            else mean.to_sparse(sparse[i])
                            if i in sparse
                            else mean.clone()
                        )
                        offset += size
            await self._sync_experts()
            if self._ties is not None:  # the mean of the sums is the sum of the means
                await self._ties.sum_grads()
            if self.lane is not None:
                # the optimizer step runs after the averaged gradients exist
                self.lane.caller_waits()
        finally:
            self._reset()

    async def _sync_experts(self) -> None:
        """The expert shards' gradients: summed over the replicas that hold the same experts,
        divided by dp."""
        grads = [
            p.grad for p in self.module.parameters() if id(p) in self.experts and p.grad is not None
        ]
        if not grads:
            return
        with self._in_lane_order():
            if self.expert_group is not None:
                flat = torch.cat([g.reshape(-1) for g in grads])
                work = dist.all_reduce(flat, group=self.expert_group, async_op=True)
        if self.expert_group is not None:
            await completed(
                self.poller,
                work,
                "expert gradient all-reduce over the replicas holding the same experts",
                self.deadline_s,
                self.expert_group,
            )
            with self._in_lane_order():
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        with self._in_lane_order():
            for g in grads:
                g /= self.size


def _dense(grad: torch.Tensor | None, param: nn.Parameter) -> torch.Tensor:
    """This replica's all-reduce input: zeros for a missing gradient, a sparse one densified."""
    if grad is None:
        return torch.zeros_like(param)
    return grad.to_dense() if grad.is_sparse else grad
