"""A message's header and payload in one buffer: one gloo operation where there were one for the
header and one per tensor.

gloo delivers a message into a longer receive buffer, so a receiver that posts a buffer as large
as the largest message it has had on a channel takes any message up to that size, header and
payload, in one operation. Both ends see the same messages in the same order (a channel is one
FIFO), so both know that capacity without telling each other: the largest payload so far, 0
before the first message. A message with no payload, or over the capacity (the first one, one
larger than all before), goes as header, then each tensor, and raises the capacity.

In the buffer the header's bytes come first, then each tensor at an offset aligned to ``ALIGN``
bytes. The receiver copies each tensor out into storage of its own: a view of the buffer would
hold the whole buffer alive, count it as the tensor's bytes (byte budgets, peak memory) and share
its version counter with the message's other tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rrfp.comm.message import HEADER_LEN, Header

ALIGN = 64
HEADER_BYTES = HEADER_LEN * 8


def _offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's offset in the buffer from its byte size (0: not in the buffer), and the
    payload's bytes after the header, padding included."""
    offsets, end = [], HEADER_BYTES
    for n in sizes:
        start = -(-end // ALIGN) * ALIGN if n else end
        offsets.append(start)
        end = start + n
    return offsets, end - HEADER_BYTES


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def payload_bytes(payload: Sequence[torch.Tensor | None]) -> int:
    """What the sender's tensors take in the buffer after the header."""
    return _offsets([_nbytes(t) for t in payload])[1]


def header_payload_bytes(header: Header) -> int:
    """What the tensors ``header`` describes take in the buffer after the header."""
    return _offsets([s.nbytes for s in header.specs])[1]


def pack(header: torch.Tensor, payload: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``header`` (int64) and ``payload`` (contiguous tensors, or None) in one uint8 buffer."""
    sizes = [_nbytes(t) for t in payload]
    offsets, size = _offsets(sizes)
    buf = torch.empty(HEADER_BYTES + size, dtype=torch.uint8, device=header.device)
    buf[:HEADER_BYTES].copy_(header.view(torch.uint8))
    for t, at, n in zip(payload, offsets, sizes):
        if t is not None and n:
            buf[at : at + n].view(t.dtype).copy_(t.reshape(-1))
    return buf


def unpack(buf: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    """The tensors ``header`` describes, copied out of ``buf`` (a received :func:`pack`)."""
    sizes = [s.nbytes for s in header.specs]
    offsets, _ = _offsets(sizes)
    out: list[torch.Tensor | None] = []
    for spec, at, n in zip(header.specs, offsets, sizes):
        if spec.is_none:
            out.append(None)
        elif not n:
            out.append(torch.empty(spec.shape, dtype=spec.dtype, device=buf.device))
        else:
            dtype = spec.dtype
            assert dtype is not None
            out.append(buf[at : at + n].view(dtype).view(spec.shape).clone())
    return out
