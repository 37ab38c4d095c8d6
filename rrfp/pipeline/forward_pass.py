"""A forward-only iteration over a rank's stages (evaluation): no backward tasks, no gradients.

Every rank runs the microbatches in order, each through its stages in model order: one global
order (microbatch, then stage), so one message per microbatch and channel suffices and no rank
waits on a peer that waits on it. A neighbour on the same rank (the V turn) gets the output
directly. ``StageExecutor.run_eval`` and ``ScheduleReady``'s eval both run this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rrfp.comm.message import Message
from rrfp.core.errors import ProtocolError
from rrfp.core.tasks import Kind
from rrfp.pipeline.boundary import received, requires_grad_bits
from rrfp.pipeline.workload import map_tensors

Forward = Callable[
    [int, Any, int], tuple[Any, Any]
]  # (stage, input, microbatch) -> (output, loss or None)


def detached(value):
    return map_tensors(lambda t: t.detach(), value)


async def forward_only(
    lane,
    channels_of: Callable[[int], Any],
    stages: list[int],
    num_stages: int,
    rank: int,
    iteration: int,
    n_microbatches: int,
    first_input: Callable[[int], Any],
    forward: Forward,
    keep_graph: bool = False,
) -> tuple[list, list]:
    """The last stage's outputs and losses (those ``forward`` returns that are not None), one per
    microbatch, on the rank that holds it (empty lists elsewhere). ``forward`` runs on the lane.
    ``keep_graph``: the last stage's outputs are returned as computed, else detached."""
    held = set(stages)
    outputs, losses = [], []
    for mb in range(n_microbatches):
        handed = None
        for s in sorted(held):
            last = s == num_stages - 1
            if s == 0:
                x = first_input(mb)
            elif s - 1 in held:
                x = handed
            else:
                msg = await channels_of(s).fwd_in.recv()
                if (msg.iteration, msg.microbatch, msg.kind) != (
                    iteration,
                    mb,
                    int(Kind.F),
                ) or not msg.tensors:
                    raise ProtocolError(
                        f"rank {rank} stage {s}: expected the forward message of "
                        f"microbatch {mb}, iteration {iteration}; got {msg.label()}"
                    )
                bits = msg.requires_grad or [False] * len(msg.tensors)
                x = received(msg.tensors[0] if len(msg.tensors) == 1 else tuple(msg.tensors), bits)
            out, loss = await lane.run(forward, s, x, mb)
            if last:
                outputs.append(out if keep_graph else detached(out))
                if loss is not None:
                    losses.append(loss)
            elif s + 1 in held:  # as a message would deliver it, requires-grad bits included
                handed = received(
                    detached(tuple(out) if isinstance(out, (tuple, list)) else out),
                    requires_grad_bits(out),
                )
            else:
                tensors = list(out) if isinstance(out, (tuple, list)) else [out]
                await channels_of(s).fwd_out.send(
                    Message(
                        iteration,
                        mb,
                        int(Kind.F),
                        [detached(t) for t in tensors],
                        requires_grad_bits(out),
                    )
                )
    return outputs, losses
