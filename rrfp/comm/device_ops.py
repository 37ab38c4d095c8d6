"""The few CUDA and NCCL calls an NCCL channel makes, behind one small object.

``CudaOps`` is the real thing; tests pass a fake with the same methods that
records the order of operations, so the channel's ordering logic (producer
event before send, consumer stream after receive, buffers from headers, no
host sync) is checked on machines without a GPU. Nothing here blocks the host:
every copy is ``non_blocking`` between pinned host memory and the device, and
every wait is a stream waiting on an event or a Work.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class CudaOps:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

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
        """``tensor`` is used on ``stream``: the caching allocator must not reuse it before that work ends."""
        tensor.record_stream(stream)

    def pinned(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def to_host(self, device_tensor: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(device_tensor, non_blocking=True)

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def isend(self, tensor: torch.Tensor, peer: int, group):
        return dist.isend(tensor, peer, group=group)

    def irecv(self, tensor: torch.Tensor, peer: int, group):
        return dist.irecv(tensor, peer, group=group)
