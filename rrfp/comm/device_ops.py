"""The few CUDA and NCCL calls an NCCL channel makes, behind one small object.

``CudaOps`` is the real thing. Tests subclass it with a fake device (tests/harness/fake_cuda.py)
and hand it a fake ``torch.distributed`` that models NCCL's communicators, so the
channel's ordering logic and the choice of NCCL calls below are checked on machines
without a GPU. Nothing here blocks the host after start-up: every copy is
``non_blocking`` between pinned host memory and the device, and every wait is a
stream waiting on an event or a Work (``synchronize`` is for start-up only).

Point-to-point goes through ``batch_isend_irecv``, a batch of one, never a bare
``isend``/``irecv``: in every torch rrfp supports, ``ProcessGroupNCCL::pointToPoint``
runs a batched P2P on the group's own communicator, the one ``new_group(device_id=...)``
created at start-up. A bare one does so only on torch >= 2.9 and only for an eagerly
initialized group; before that it creates a two-rank communicator on first use,
blocking the calling thread (the event loop) until the peer creates it too
(docs/gpu.md, "What can block the event loop").
"""

from __future__ import annotations

import contextlib

import torch


class CudaOps:
    def __init__(self, device: torch.device | str, dist_module=None) -> None:
        self.device = torch.device(device)
        if dist_module is None:
            import torch.distributed as dist_module
        self.dist = dist_module

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def stream(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` current: the kernels, copies and collectives issued inside run on it."""
        return torch.cuda.stream(stream)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def wait_work(self, work) -> None:
        """The current stream waits for ``work``; NCCL's ``wait`` does not block the host."""
        work.wait()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """``tensor`` is used on ``stream``: the allocator keeps it until that work ends."""
        tensor.record_stream(stream)

    def synchronize(self, stream) -> None:
        """Block the host until ``stream`` has run everything issued on it. Start-up only."""
        stream.synchronize()

    def pinned(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(device_tensor, non_blocking=True)

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def isend(self, tensor: torch.Tensor, peer: int, group):
        return self._batch_of_one(self.dist.isend, tensor, peer, group)

    def irecv(self, tensor: torch.Tensor, peer: int, group):
        return self._batch_of_one(self.dist.irecv, tensor, peer, group)

    def _batch_of_one(self, op, tensor: torch.Tensor, peer: int, group):
        """One P2P op as a batch: on the group's own communicator in every supported torch."""
        works = self.dist.batch_isend_irecv([self.dist.P2POp(op, tensor, peer, group)])
        return works[0]
