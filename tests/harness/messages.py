"""Message headers as a buggy or hostile sender makes them: one word set (checksum resealed or not),
and a header whose tensor list carries None."""

from __future__ import annotations

import torch

from rrfp.comm.message import (
    HEADER_LEN,
    Message,
    checksum,
    encode_header,
)


def _set(index: int, value: int, seal: bool = True):
    """Set one header word; ``seal``: recompute the checksum, as a buggy sender would (it reaches
    the field checks); without it, as corruption in transit would (the checksum catches it)."""

    def corrupt(h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        h[index] = value
        if seal and index != HEADER_LEN - 1:
            h[-1] = checksum(h[:-1].tolist())
        return h

    return corrupt


def _header_with_none() -> torch.Tensor:
    return encode_header(
        Message(3, 4, 0, [torch.zeros(2, 5), None, torch.zeros(7, dtype=torch.int64)])
    )
