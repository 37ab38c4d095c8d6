"""Stage modules wrapped for data parallelism (DDP, FSDP2's ``fully_shard``) are refused.

Those wrappers sync or reshard inside their own forward and backward hooks and need torch's
``no_sync`` and post-backward calls around a whole backward; rrfp's worker runs a stage's
backward in pieces (B, W, one microbatch at a time) and makes neither call, so gradients would
be synced once per microbatch, or resharded under a later task, or a collective would wait for
ever. rrfp's own data parallelism (``dp``, ``PipelineRuntime.grad_sync``) syncs after the
iteration instead. A wrapper anywhere inside the stage module counts, not only around it.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - a torch without FSDP2
    FSDPModule = ()


def refuse_wrapped(module: torch.nn.Module, who: str) -> None:
    """NotImplementedError, naming ``who`` (``ScheduleReady``, ``stage_executor``) and the wrapper,
    when ``module`` or one of its submodules is DDP or FSDP-wrapped."""
    for name, sub in module.named_modules():
        if isinstance(sub, (DistributedDataParallel, FSDPModule)):
            inside = f"; its submodule {name} is one" if name else ""
            raise NotImplementedError(
                f"{who} does not support a stage module wrapped in {type(sub).__name__} "
                f"(data parallelism inside the stage) yet{inside}"
            )
