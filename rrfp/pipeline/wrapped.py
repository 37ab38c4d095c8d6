"""Stage modules wrapped in DDP are refused; FSDP2 (``fully_shard``) stage modules are run by
rrfp/pipeline/sharded_stages.py.

DDP syncs inside its own backward hooks and needs ``no_sync`` and ``prepare_for_backward`` calls
around a whole backward; rrfp's worker runs a stage's backward in pieces (B, W, one microbatch at a
time, in the order readiness picks) and makes neither call, so gradients would be all-reduced once
per microbatch, in an order that differs between replicas. rrfp's own data parallelism (``dp``,
``PipelineRuntime.grad_sync``) syncs once per iteration instead, and FSDP2 stages are unsharded
for the iteration and reduce-scattered after it. A wrapper anywhere inside the stage module counts,
not only around it.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel


def refuse_wrapped(module: torch.nn.Module, who: str) -> None:
    """NotImplementedError, naming ``who`` (``ScheduleReady``, ``stage_executor``) and the wrapper,
    when ``module`` or one of its submodules is DDP-wrapped."""
    for name, sub in module.named_modules():
        if isinstance(sub, DistributedDataParallel):
            inside = f"; its submodule {name} is one" if name else ""
            raise NotImplementedError(
                f"{who} does not support a stage module wrapped in {type(sub).__name__}{inside}: "
                "use rrfp's data parallelism (dp, grad_sync, ScheduleReady(mesh=) with a 'dp' "
                "dimension) or FSDP2's fully_shard over the stage's replicas"
            )
