"""What every rank does when an iteration met a NaN or Inf: all stop, or all skip the step.

After its iteration each rank looks at its own losses (the last stage, per microbatch) and
gradients, then all ranks agree in one all-reduce (MIN) of two float64s on the control-plane
group: the first bad microbatch's loss, and the first stage whose gradients are not finite. So no
rank steps while another skips, and none waits for a peer that has already raised. Its cost per
iteration: that one 16-byte all-reduce, and one pass over the rank's gradients (their total norm).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import torch

from rrfp.comm.grad_norm import local
from rrfp.core.errors import NonFiniteError

log = logging.getLogger("rrfp.pipeline.nonfinite")

POLICIES = ("stop", "skip")
_NONE = math.inf


class NonFiniteGuard:
    """``policy`` "stop": every rank raises NonFiniteError, one line naming the stage and
    microbatch. "skip": every rank sets its parameters' ``.grad`` to None, so the caller's
    ``optimizer.step()`` leaves the parameters as they are (torch's optimizers skip parameters
    without a gradient)."""

    def __init__(
        self, policy: str, rank: int, world: int, agree: Callable[[torch.Tensor], Awaitable]
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(
                f"on_nonfinite must be one of {', '.join(POLICIES)} (or None: not checked), "
                f"got {policy!r}"
            )
        self.policy, self.rank, self.world, self.agree = policy, rank, world, agree

    async def check(self, iteration: int, workers, losses: dict[int, float]) -> bool:
        """Whether to skip the step; raises under "stop". Every rank calls it after an iteration."""
        bad_mb = min((mb for mb, v in losses.items() if not math.isfinite(v)), default=None)
        bad_stage = min((w.stage for w in workers if not _finite_grads(w.module)), default=None)
        codes = torch.tensor(
            [
                _NONE if bad_mb is None else bad_mb * self.world + self.rank,
                _NONE if bad_stage is None else bad_stage * self.world + self.rank,
            ],
            dtype=torch.float64,
        )
        await self.agree(codes)
        loss_code, grad_code = codes.tolist()
        if loss_code == _NONE and grad_code == _NONE:
            return False
        if loss_code != _NONE:
            mb, where = divmod(int(loss_code), self.world)
            what = (
                f"stage {workers[0].num_stages - 1} microbatch {mb}: the loss is NaN or Inf "
                f"(rank {where})"
            )
        else:
            stage, where = divmod(int(grad_code), self.world)
            what = f"stage {stage}: NaN or Inf in the gradients (rank {where})"
        if self.policy == "stop":
            raise NonFiniteError(
                f"rank {self.rank}: iteration {iteration}: {what}; every rank stops here "
                f'(on_nonfinite = "stop"; "skip" skips such steps)'
            )
        for w in workers:
            for p in w.module.parameters():
                p.grad = None
        log.warning(
            "rank %d: iteration %d: %s: every rank skips this step (gradients set to None)",
            self.rank,
            iteration,
            what,
        )
        return True


def _finite_grads(module: torch.nn.Module) -> bool:
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]  # an FSDP shard's
    dense = [g for g in grads if not g.is_sparse]
    # a sparse gradient (Embedding(sparse=True)): its stored values
    if not all(bool(torch.isfinite(g.coalesce().values()).all()) for g in grads if g.is_sparse):
        return False
    return not dense or bool(torch.nn.utils.get_total_norm(dense).isfinite())
