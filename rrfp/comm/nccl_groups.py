"""NCCL groups that create no communicator, and connect no peer, after start-up.

Three things can block the thread that calls a torch NCCL operation until a
peer makes a matching call, and that thread is the event loop: a communicator
created at first use (``ProcessGroupNCCL::pointToPoint`` for a bare P2P op
before torch 2.9, or any op on a group that was not initialized eagerly), and
NCCL connecting a pair of ranks at their first point-to-point (``ncclGroupEnd``
runs ``ncclTransportP2pSetup``, a bootstrap exchange with the peer) or a group at
its first collective. In a pipeline the first operations of neighbouring ranks
are receives on different groups, so each waits for a call the other never
makes: a hang in iteration 0. rrfp therefore (docs/gpu.md, "What can block the
event loop"):

- creates every NCCL group with ``device_id`` and refuses to start unless torch
  really initialized it eagerly (``require_eager``);
- issues P2P as batches, which use the group's communicator on every torch
  (``CudaOps``);
- sends one element over every channel, and all-reduces one element over every
  other NCCL group, at start-up, in one global order (``warm_up_collective``,
  ``NcclChannel.warm_up``), with ``NCCL_RUNTIME_CONNECT=0`` so that NCCL
  connects every collective algorithm when it creates the communicator.

The same module sets up NCCL's watchdog so that rrfp's own deadline, which
names the peer and the channel, always fires first (``configure_watchdog``).
"""

from __future__ import annotations

import inspect
import logging
import os

import torch

from rrfp.core.errors import StartupError

logger = logging.getLogger("rrfp.comm")

# What rrfp needs from NCCL's environment; a user's own setting wins, except blocking wait.
NCCL_ENV = {
    # the watchdog aborts a failed communicator and marks its Works failed, so the error reaches the
    # loop's poller as one line; 1 and 3 (torch's default) would kill the process from the watchdog
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no flight-recorder dump files on the way out
    # connect every collective algorithm when the communicator is created
    "NCCL_RUNTIME_CONNECT": "0",
}


def watchdog_timeout_s(timeout_s: float) -> float:
    """The NCCL process-group timeout: longer than rrfp's peer deadline, so that rrfp's
    error (naming rank, channel and peer) comes first and the watchdog's is only a backstop."""
    return 2.0 * timeout_s + 30.0


def configure_watchdog(timeout_s: float) -> float:
    """Set NCCL's environment (before the NCCL process group exists); return its timeout in seconds.

    Refuses ``TORCH_NCCL_BLOCKING_WAIT=1``: it makes ``Work.wait()`` block the host,
    which here is the event loop."""
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0").strip().lower() not in ("", "0", "false"):
        raise StartupError(
            "TORCH_NCCL_BLOCKING_WAIT is set: it makes every NCCL wait block the event loop; "
            "unset it (rrfp's own deadline, run.timeout_s, bounds every wait)"
        )
    for key, value in NCCL_ENV.items():
        if os.environ.setdefault(key, value) != value:
            logger.warning(
                "%s=%s is set in the environment; rrfp would use %s", key, os.environ[key], value
            )
    return watchdog_timeout_s(timeout_s)


def check_torch(dist_module=None) -> None:
    """One line when this torch cannot create NCCL groups eagerly (``new_group(device_id=...)``,
    torch >= 2.6), before any NCCL group exists."""
    if dist_module is None:
        import torch.distributed as dist_module
    if "device_id" not in inspect.signature(dist_module.new_group).parameters:
        raise StartupError(
            f"torch {torch.__version__} cannot create NCCL groups eagerly (new_group has no "
            f"device_id): its communicators would be created at first use, on the event loop; "
            f"backend nccl needs torch >= 2.6"
        )


def require_eager(group, device: torch.device, what: str, rank: int) -> None:
    """Refuse to start unless ``group``'s NCCL communicator was created by ``new_group``.

    torch creates it there exactly when the group is bound to a device and its backend
    supports splitting (``_new_process_group_helper``: ``if device_id and
    pg._get_backend(device_id).supports_splitting: eager_connect_single_device``)."""
    bound = getattr(group, "bound_device_id", None)
    if bound != device:
        raise StartupError(
            f"rank {rank}: {what}: the NCCL group is bound to {bound}, not {device}: its "
            f"communicator would be created at first use, on the event loop"
        )
    backend = group._get_backend(device)
    if not getattr(backend, "supports_splitting", False):
        raise StartupError(
            f"rank {rank}: {what}: this NCCL cannot create communicators at start-up "
            f"(no ncclCommSplit; NCCL >= 2.18 has it): they would be created at first use, "
            f"on the event loop"
        )


def warm_up_collective(group, ops, what: str) -> None:
    """Start-up only, blocking: all-reduce one element over ``group`` so that NCCL connects it now.
    Every member calls this for its groups in the same global order, so the calls meet."""
    stream = ops.new_stream()
    with ops.stream(stream):
        one = ops.empty((1,), torch.float32)
        ops.dist.all_reduce(one, group=group)
    ops.synchronize(stream)
    logger.debug("warmed up %s", what)
