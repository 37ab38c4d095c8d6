"""Self-describing pipeline messages (docs/design.md, fact 4).

A message is a fixed-size int64 header followed by its payload tensors. The
header carries the iteration, microbatch, kind and the dtype and shape of every
tensor, so the receiver can allocate buffers for variable sequence lengths or
image counts without padding and without knowing the schedule.

Header layout (``HEADER_LEN`` int64 values)::

    magic, version, iteration, microbatch, kind, tensor count,
    then MAX_TENSORS slots of: dtype code, ndim, MAX_DIMS dims, flags,
    then a checksum of everything before it

Unused slots and dims are zero. A ``None`` payload (a stage output or input
gradient that does not exist, e.g. the gradient of an int mask) takes a slot
with dtype code ``NONE_CODE``, ndim 0 and zero dims, and no bytes on the wire:
the header alone says where it goes, so the receiver rebuilds the same
positions. A slot's flags say what the tensor is beyond its dtype and shape:
bit 0 (``REQUIRES_GRAD``) that the sending stage produced it requiring grad, so
the receiver makes it an autograd leaf and sends a gradient back; a constant
(rotary cos/sin, an additive float mask, positions) arrives without it, and its
gradient slot in the B message is None. Only a floating tensor may carry the bit.
Decoding checks everything, so a stream that got out of step fails
loudly instead of allocating garbage. The checksum (8 bytes of BLAKE2b) catches
what the field checks cannot: a corrupted dim that is still a valid dim, and a
truncated header (gloo delivers a shorter message into a longer buffer, whose
tail then stays zero).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from rrfp.core.tasks import Kind

MAGIC = 0x52524650  # b"RRFP"
VERSION = 3  # 2: a checksum word at the end; 3: a flags word per tensor
MAX_TENSORS = 8
MAX_DIMS = 6
MAX_KIND = 1 << 16
MAX_ELEMENTS = 1 << 40  # per tensor; anything larger is a corrupt header, not an activation
MAX_MESSAGE_BYTES = (
    1 << 36
)  # 64 GiB, all of a message's tensors together: checked before any buffer exists

_PREFIX = 6  # magic, version, iteration, microbatch, kind, count
_SLOT = 3 + MAX_DIMS  # dtype code, ndim, dims, flags
REQUIRES_GRAD = 1  # flags bit 0: the sender's tensor required grad
_FLAGS = REQUIRES_GRAD  # every bit a header may set
HEADER_LEN = _PREFIX + MAX_TENSORS * _SLOT + 1  # + the checksum


def checksum(words) -> int:
    """The header's last word: a signed 64-bit BLAKE2b digest of the words before it."""
    digest = hashlib.blake2b(array("q", words).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# Code 0 marks an unused slot, so a zeroed header never decodes as a tensor.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
    torch.bool: 8,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
NONE_CODE = 9  # a None payload: a slot of its own, so positions survive without padding


class MessageError(ValueError):
    """A message cannot be encoded, or a received header is not valid."""


def kind_name(kind: int) -> str:
    """``F``/``B``/``W`` for task kinds, ``kind N`` for anything else."""
    try:
        return Kind(kind).name
    except ValueError:
        return f"kind {kind}"


@dataclass
class Message:
    """One pipeline message: which (iteration, microbatch, kind) and its tensors."""

    iteration: int
    microbatch: int
    kind: int
    tensors: list[torch.Tensor | None] = field(
        default_factory=list
    )  # None: a payload that does not exist
    # per tensor, whether the sending stage produced it requiring grad (F messages); None: none did
    requires_grad: list[bool] | None = None
    # On GPU: the event the producing task's kernels end with, recorded when that task was
    # enqueued, so a send waits for its producer and nothing enqueued after it (docs/gpu.md,
    # "Sends on time"). None: the tensors are ready now (CPU), or the sender records it.
    ready: Any = field(default=None, compare=False, repr=False)
    # Wall-clock (time.time()) stamps of the message's way, for a trace: the sender fills
    # ``posted`` (queued after its task), ``sent`` and ``taken`` (its channel thread's transport
    # operation began and ended); the receiver ``received`` (its channel thread had it whole). None:
    # nobody stamps (a CUDA channel, whose host does not see the transfer).
    times: dict[str, float] | None = field(default=None, compare=False, repr=False)

    def label(self) -> str:
        return _label(self.iteration, self.microbatch, self.kind)


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of one payload tensor, and whether its sender had it require grad;
    ``NONE_SPEC`` (dtype None) for a None payload."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    requires_grad: bool = False

    @property
    def is_none(self) -> bool:
        return self.dtype is None

    @property
    def numel(self) -> int:
        return 0 if self.is_none else math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 0 if self.is_none else self.numel * torch.empty((), dtype=self.dtype).element_size()

    def __str__(self) -> str:
        return (
            "None"
            if self.is_none
            else f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
        )


NONE_SPEC = TensorSpec(None, ())


@dataclass(frozen=True)
class Header:
    """A decoded header: enough to allocate the payload buffers."""

    iteration: int
    microbatch: int
    kind: int
    specs: tuple[TensorSpec, ...]

    def empty_tensors(self, device: torch.device | str | None = None) -> list[torch.Tensor | None]:
        """One receive buffer per payload tensor, in order; None where the payload is None."""
        return [
            None if s.is_none else torch.empty(s.shape, dtype=s.dtype, device=device)
            for s in self.specs
        ]

    @property
    def requires_grad(self) -> list[bool] | None:
        """Per payload tensor, whether its sender produced it requiring grad; None when none did
        (as Message.requires_grad)."""
        bits = [s.requires_grad for s in self.specs]
        return bits if any(bits) else None

    def label(self) -> str:
        return _label(self.iteration, self.microbatch, self.kind)


def _label(iteration: int, microbatch: int, kind: int) -> str:
    return f"{kind_name(kind)} message (iteration {iteration}, microbatch {microbatch})"


def _check_index(what: str, value: object, limit: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise MessageError(f"message {what} must be an int, got {value!r}")
    if value < 0 or (limit is not None and value >= limit):
        bound = f" and < {limit}" if limit is not None else ""
        raise MessageError(f"message {what} must be >= 0{bound}, got {value}")


def encode_header(msg: Message, device: torch.device | str | None = None) -> torch.Tensor:
    """The int64 header describing ``msg``; raises MessageError if it cannot be described. Built
    over an int64 array's buffer (the tensor keeps it alive), which costs half of converting a
    list of Python ints: every message posts one."""
    header = torch.frombuffer(array("q", header_words(msg)), dtype=torch.int64)
    return header if device is None else header.to(device)


def header_words(msg: Message) -> list[int]:
    """The header's words, checksum last; raises MessageError if ``msg`` cannot be described. A
    hand-off between two stages of one rank checks it too, so the V turn accepts only what a link
    would."""
    _check_index("iteration", msg.iteration)
    _check_index("microbatch", msg.microbatch)
    _check_index("kind", msg.kind, MAX_KIND)
    if len(msg.tensors) > MAX_TENSORS:
        raise MessageError(
            f"{msg.label()} has {len(msg.tensors)} tensors; at most {MAX_TENSORS} fit in a header"
        )
    grads = msg.requires_grad if msg.requires_grad is not None else [False] * len(msg.tensors)
    if len(grads) != len(msg.tensors) or not all(isinstance(g, bool) for g in grads):
        raise MessageError(
            f"{msg.label()}: requires_grad must be one bool per tensor ({len(msg.tensors)}), "
            f"got {grads!r}"
        )
    values = [MAGIC, VERSION, msg.iteration, msg.microbatch, msg.kind, len(msg.tensors)]
    for i, (t, grad) in enumerate(zip(msg.tensors, grads)):
        if t is None:
            if grad:
                raise MessageError(
                    f"{msg.label()}: payload {i} is None but marked as requiring grad"
                )
            values += [NONE_CODE, 0, *[0] * MAX_DIMS, 0]
            continue
        if not isinstance(t, torch.Tensor):
            raise MessageError(
                f"{msg.label()}: payload {i} is a {type(t).__name__}, not a tensor or None"
            )
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise MessageError(
                f"{msg.label()}: payload {i} has dtype {t.dtype}, which messages do not "
                f"support (supported: {supported})"
            )
        if t.dim() > MAX_DIMS:
            raise MessageError(
                f"{msg.label()}: payload {i} has {t.dim()} dims; at most {MAX_DIMS} fit in a header"
            )
        if grad and not t.is_floating_point():
            raise MessageError(
                f"{msg.label()}: payload {i} has dtype {t.dtype} but is marked as requiring grad "
                f"(only floating tensors carry gradients)"
            )
        values += [
            code,
            t.dim(),
            *t.shape,
            *[0] * (MAX_DIMS - t.dim()),
            REQUIRES_GRAD if grad else 0,
        ]
    values += [0] * (HEADER_LEN - 1 - len(values))
    return values + [checksum(values)]


def empty_header(device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> Header:
    """Check and decode a received header; raises MessageError describing the first problem."""
    if (
        not isinstance(header, torch.Tensor)
        or header.dtype != torch.int64
        or tuple(header.shape) != (HEADER_LEN,)
    ):
        got = (
            f"{header.dtype} {list(header.shape)}"
            if isinstance(header, torch.Tensor)
            else type(header).__name__
        )
        raise MessageError(f"a header is an int64 tensor of shape [{HEADER_LEN}], got {got}")
    v = header.tolist()
    magic, version, iteration, microbatch, kind, count = v[:_PREFIX]
    if magic != MAGIC:
        raise MessageError(
            f"bad header magic {magic:#x} (expected {MAGIC:#x}): not an rrfp message, "
            f"or the stream is out of step"
        )
    if version != VERSION:
        raise MessageError(f"unknown header version {version} (this build reads version {VERSION})")
    if v[-1] != checksum(v[:-1]):
        raise MessageError("header checksum mismatch: corrupted or truncated in transit")
    if iteration < 0 or microbatch < 0:
        raise MessageError(f"header has negative iteration {iteration} or microbatch {microbatch}")
    if not 0 <= kind < MAX_KIND:
        raise MessageError(f"header kind {kind} is outside 0..{MAX_KIND - 1}")
    if not 0 <= count <= MAX_TENSORS:
        raise MessageError(f"header claims {count} tensors; expected 0..{MAX_TENSORS}")
    where = _label(iteration, microbatch, kind)
    specs = []
    for i in range(MAX_TENSORS):
        slot = v[_PREFIX + i * _SLOT : _PREFIX + (i + 1) * _SLOT]
        if i >= count:
            if any(slot):
                raise MessageError(
                    f"{where}: header slot {i} is beyond its {count} tensor(s) but not zero: "
                    f"corrupt header"
                )
            continue
        code, ndim, dims, flags = slot[0], slot[1], slot[2:-1], slot[-1]
        if code == NONE_CODE:
            if ndim or any(dims) or flags:
                raise MessageError(
                    f"{where}: tensor {i} is None (dtype code {NONE_CODE}) but has ndim {ndim}, "
                    f"dims {dims} and flags {flags}: corrupt header"
                )
            specs.append(NONE_SPEC)
            continue
        dtype = DTYPES_BY_CODE.get(code)
        if dtype is None:
            raise MessageError(f"{where}: tensor {i} has unknown dtype code {code}")
        if not 0 <= ndim <= MAX_DIMS:
            raise MessageError(f"{where}: tensor {i} has {ndim} dims; expected 0..{MAX_DIMS}")
        shape, padding = tuple(dims[:ndim]), dims[ndim:]
        if any(d < 0 for d in shape):
            raise MessageError(f"{where}: tensor {i} has a negative dim in shape {list(shape)}")
        if any(padding):
            raise MessageError(
                f"{where}: tensor {i} has nonzero dims past its ndim {ndim}: corrupt header"
            )
        if any(d > MAX_ELEMENTS for d in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise MessageError(
                f"{where}: tensor {i} of shape {list(shape)} has more than {MAX_ELEMENTS} "
                f"elements: corrupt header"
            )
        if flags & ~_FLAGS or (flags & REQUIRES_GRAD and not dtype.is_floating_point):
            raise MessageError(
                f"{where}: tensor {i} ({str(dtype).removeprefix('torch.')}) has flags {flags}; "
                f"expected 0 or, for a floating tensor, {REQUIRES_GRAD} (requires grad): "
                f"corrupt header"
            )
        specs.append(TensorSpec(dtype, shape, bool(flags & REQUIRES_GRAD)))
    total = sum(s.nbytes for s in specs)
    if total > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"{where}: its {len(specs)} tensor(s) ({', '.join(map(str, specs))}) claim {total} "
            f"bytes in all, more than the {MAX_MESSAGE_BYTES} a message may carry: corrupt header"
        )
    return Header(iteration, microbatch, kind, tuple(specs))
