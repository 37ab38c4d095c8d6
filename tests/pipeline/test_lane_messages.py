"""On real compute a task's message is made on the compute lane's thread as the task returns
(``Channel.prepare``: its header encoded and, where it travels whole, packed there), so the loop
only begins its transport; under emulated time the stage's sender coroutine sends it as before.
What the lane cannot make (a payload no link carries) the post refuses with the channel's line."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

M, D, ROWS = 4, 6, 3
PROGRESS_S = 5.0  # how long a rank waits with no progress anywhere before it names the peer


def _stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()).double() for _ in range(2)]


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, D, generator=g, dtype=torch.float64),) * 2 for _ in range(M)]


class RaisesOnSecond(nn.Module):
    """A first stage whose forward raises on its second microbatch: the user's bug."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.calls = nn.Linear(D, D).double(), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("the model's own bug")
        return self.lin(x)


class ToComplex(nn.Module):
    """A first stage whose output no link carries."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x):
        return torch.fft.rfft(self.lin(x), dim=-1)


def _one_iteration(rank, world, unit_ms, failing=None, caught=False):
    """One iteration of two stages; with ``failing`` (a module class) as the first stage, whose
    error leaves the runtime's block (or, ``caught``, the block catches it and leaves normally):
    what each rank then raised, and how long it took."""
    import asyncio
    import threading
    import time

    from harness.distributed import started_waits

    from rrfp.comm.channels import Channel
    from rrfp.comm.message import MessageError
    from rrfp.core.errors import PipelineError
    from rrfp.pipeline.runtime import PipelineRuntime

    made: list[tuple[str, bool]] = []  # (thread, whether it made the message)
    prepare = Channel.prepare

    def spying(self, msg):
        prepared = prepare(self, msg)
        made.append((threading.current_thread().name, prepared is not None))
        return prepared

    Channel.prepare = spying
    errors: list[str] = []
    grads: dict = {}

    async def main():
        # a failure is named after progress_s; a run that should pass keeps the default bounds
        waits = started_waits(2.0, progress_s=PROGRESS_S) if failing else None
        async with PipelineRuntime.start(
            pp=world, timeout_s=30, unit_ms=unit_ms, timeouts=waits
        ) as rt:
            module = _stages()[rt.stage]
            if failing is not None and rt.stage == 0:
                module = failing()
            ex = rt.stage_executor(
                module, nn.functional.mse_loss, n_microbatches=M, hint="bfw", dispatch="ready"
            )
            try:
                await ex.run_iteration(0, _batches())
            except (MessageError, ValueError) as e:
                if not caught:
                    raise
                errors.append(f"caught: {e}")
            # as lists: a tensor would go back through the queue as shared memory
            grads.update(
                {n: p.grad.tolist() for n, p in module.named_parameters() if p.grad is not None}
            )

    began = time.monotonic()
    try:
        asyncio.run(main())
    except (MessageError, PipelineError, ValueError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    return made, errors, grads, time.monotonic() - began


def _reference() -> dict[str, torch.Tensor]:
    first, last = _stages()
    loss = sum(nn.functional.mse_loss(last(first(x)), y) for x, y in _batches()) / M
    loss.backward()
    return {
        f"{s}.{n}": p.grad for s, m in enumerate((first, last)) for n, p in m.named_parameters()
    }


@pytest.mark.timeout(120)
def test_real_compute_makes_each_message_on_the_lane_and_matches_one_process():
    results = run_ranks(_one_iteration, 2, 0.0, timeout=90)
    want = _reference()
    for rank, (made, errors, grads, _) in results.items():
        assert errors == [], errors
        # every F (rank 0) and B (rank 1) message, made on the lane's thread
        lane = f"rrfp-lane-stage{rank}"
        assert len(made) == M and {t for t, _ in made} == {lane}, made
        assert all(ok for _, ok in made), made
        for name, grad in grads.items():
            got = torch.tensor(grad, dtype=torch.float64)
            torch.testing.assert_close(got, want[f"{rank}.{name}"], rtol=0, atol=1e-12)


@pytest.mark.timeout(120)
def test_emulated_time_sends_through_the_stages_sender():
    """A link's emulated latency delays the message, so the sender coroutine sends it."""
    for made, errors, _, _ in run_ranks(_one_iteration, 2, 1.0, timeout=90).values():
        assert errors == [] and made == [], (errors, made)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caught", [False, True])
@pytest.mark.parametrize(
    "failing,said",
    [(ToComplex, ("cannot send", "complex128")), (RaisesOnSecond, ("the model's own bug",))],
)
def test_a_failed_first_stage_fails_both_ranks_in_one_line_each(caught, failing, said):
    """A payload no link carries (the lane cannot make the message, the post refuses it with the
    channel's line) or the model's own error, on rank 0. Left to propagate, the block's exit
    closes the groups and rank 1's receive fails at once. Caught, the block leaves normally into
    the final barrier, which rank 0's heartbeat then says it is at, not in the task it
    abandoned: rank 1, waiting for its message, names it after ``PROGRESS_S`` instead of
    counting that task as progress for ever."""
    results = run_ranks(_one_iteration, 2, 0.0, failing, caught, timeout=90)
    made, errors, _, took = results[0]
    if failing is ToComplex:
        assert made and not any(ok for _, ok in made), made  # the lane could not make it
    first = errors[0]
    assert all(s in first for s in said) and "\n" not in first, errors
    if caught:  # then the final barrier ends: rank 1 never came to it (PeerStuck), or it named
        # rank 0 first and left (a lost peer)
        assert len(errors) == 2 and "final barrier" in errors[1], errors
        assert errors[1].startswith(("PeerStuck", "PeerFailure")), errors
    _, peer_errors, _, peer_took = results[1]
    assert len(peer_errors) == 1 and "rank 0" in peer_errors[0], peer_errors
    assert max(took, peer_took) < 30, (took, peer_took)
