"""A message's header and payload in one buffer (rrfp/comm/packed.py): both ends compute the same
payload size, one from the tensors and one from the header, and the receiver gets back every
tensor, in storage of its own, from a buffer longer than the message (as gloo delivers it)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.comm.message import DTYPE_CODES, Message, decode_header, encode_header
from rrfp.comm.packed import HEADER_BYTES, header_payload_bytes, pack, payload_bytes, unpack

DTYPES = sorted(DTYPE_CODES, key=str)

tensor = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3), st.integers()
    ),
)


def _make(spec) -> torch.Tensor | None:
    if spec is None:
        return None
    dtype, shape, seed = spec
    g = torch.Generator().manual_seed(seed % 2**31)
    return (torch.rand(shape, generator=g) * 100).to(dtype)


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(tensor, min_size=1, max_size=8), spare=st.integers(0, 300))
def test_pack_then_unpack_gives_back_every_tensor(specs, spare):
    tensors = [_make(s) for s in specs]
    header = encode_header(Message(3, 5, 0, tensors))
    buf = pack(header, tensors)
    decoded = decode_header(buf[:HEADER_BYTES].view(torch.int64))
    size = payload_bytes(tensors)
    assert size == header_payload_bytes(decoded) == buf.numel() - HEADER_BYTES
    received = torch.full((buf.numel() + spare,), 7, dtype=torch.uint8)  # a longer buffer
    received[: buf.numel()] = buf
    for sent, got in zip(tensors, unpack(received, decoded), strict=True):
        if sent is None:
            assert got is None
            continue
        assert got is not None and got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
        # storage of its own: not the buffer's, so it counts its own bytes and its own version
        assert got.untyped_storage().nbytes() == sent.numel() * sent.element_size()
