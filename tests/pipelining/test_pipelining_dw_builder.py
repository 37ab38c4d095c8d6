"""``PipelineStage(dw_builder=)`` under ScheduleReady, checked as torch's own pipelining tests check
it (a module whose custom autograd functions leave their weight gradients to the stage's
``dw_runner``, gradients against a reference module): on real gloo ranks ScheduleReady gives the
gradients, losses and outputs of torch's own schedule on the same stage modules (Schedule1F1B at
one stage per rank, ScheduleInterleavedZeroBubble at two) and of a single process with plain
linear layers, runs one runner per microbatch and stage each step, whole backward or split, and
leaves no stashed context behind."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

DIM, ROWS, M = 6, 2, 4
TOL = 1e-10


class _LinearInputGradOnly(torch.autograd.Function):
    """``x @ weight.T + bias`` whose backward gives only the input's gradient: it stashes what the
    weight gradient needs on ``owner`` for the stage's dw_runner (torch's zero-bubble pattern for
    custom functions)."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner):
        ctx.save_for_backward(x, weight)
        ctx.owner = owner
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.owner.stash.append((x, grad_out))
        return grad_out @ weight, None, None, None


class DeferredLinear(nn.Module):
    """A linear layer whose weight and bias gradients come from ``runner()`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM)
        self.bias = nn.Parameter(torch.randn(DIM) / DIM)
        self.stash: list = []

    def forward(self, x):
        return _LinearInputGradOnly.apply(x, self.weight, self.bias, self)

    def runner(self):
        """The weight gradient of the backward that ran last, as a call for later."""
        x, g = self.stash.pop()

        def run():
            for p, grad in ((self.weight, g.T @ x), (self.bias, g.sum(0))):
                p.grad = grad if p.grad is None else p.grad + grad

        return run


class Stage(nn.Module):
    """One stage: a deferred linear layer, then an ordinary one (its gradient comes from the
    backward, as torch's stage computes it with a dw_builder)."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred = DeferredLinear()
        self.plain = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.plain(torch.tanh(self.deferred(x)))

    def dw_builder(self):
        """torch's dw_builder: called once per microbatch after its backward; the runner it returns
        computes that microbatch's deferred gradients. Counts the runners run."""
        run = self.deferred.runner()

        def dw_runner():
            self.runs += 1
            run()

        return dw_runner


def _stages(n: int) -> list[Stage]:
    torch.manual_seed(0)
    return [Stage() for _ in range(n)]


def _plain(stage: Stage) -> nn.Module:
    """The same stage with an ordinary linear layer in place of the deferred one."""
    lin = nn.Linear(DIM, DIM)
    lin.weight.data.copy_(stage.deferred.weight.data)
    lin.bias.data.copy_(stage.deferred.bias.data)
    return nn.Sequential(lin, nn.Tanh(), copy.deepcopy(stage.plain))


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS * M, DIM, generator=g), torch.randn(ROWS * M, DIM, generator=g)


def _reference(n: int, x, y) -> tuple[list[float], dict]:
    """One process, plain layers: the microbatch losses and the mean loss's gradients by stage."""
    model = nn.Sequential(*[_plain(s) for s in _stages(n)])
    losses = [_loss(model(x[i : i + ROWS]), y[i : i + ROWS]) for i in range(0, len(x), ROWS)]
    (sum(losses) / M).backward()
    grads = {}
    for s, m in enumerate(model):
        for n_, p in m.named_parameters():
            name = {"0.weight": "deferred.weight", "0.bias": "deferred.bias"}.get(
                n_, n_.replace("2.", "plain.")
            )
            grads[(s, name)] = p.grad.clone()
    return [loss.item() for loss in losses], grads


def _grads(indices, modules) -> dict:
    """Each parameter's gradient by (stage, name), None where it has none."""
    return {
        (s, n): None if p.grad is None else p.grad.clone()
        for s, m in zip(indices, modules)
        for n, p in m.named_parameters()
    }


def _with_dw_builder(rank, world, V, torch_name, hints):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    S = world * V
    mine = [rank + v * world for v in range(V)]  # interleaved
    first, last = 0 in mine, S - 1 in mine
    x, y = _data(1)
    x2, y2 = _data(2)
    runs = {}
    try:
        for name in (torch_name, *hints):
            model = _stages(S)
            held = [model[s] for s in mine]
            for m in held:
                m.runs = 0
            stages = [
                PipelineStage(m, s, S, torch.device("cpu"), dw_builder=m.dw_builder)
                for s, m in zip(mine, held)
            ]
            if name == torch_name:
                schedule = getattr(schedules, name)(
                    stages if V > 1 else stages[0], M, loss_fn=_loss
                )
            else:
                schedule = ScheduleReady(
                    stages if V > 1 else stages[0], M, loss_fn=_loss, hint=name
                )
            losses: list = []
            out = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            grads1 = _grads(mine, held)
            runners = [m.runs for m in held]
            # a second step without zero_grad: the runners' gradients accumulate as autograd's do
            schedule.step(*((x2,) if first else ()), target=y2 if last else None)
            grads2 = _grads(mine, held)
            runs[name] = dict(
                grads1=grads1,
                grads2=grads2,
                runners=runners,
                stashed=sum(len(m.deferred.stash) for m in held),
                losses=[loss.item() for loss in losses],
                out=out,
            )
            if name != torch_name:
                runs[name]["kinds"] = sorted({t.kind.name for t in schedule.last_result.order})
                schedule.close()
    finally:
        dist.destroy_process_group()
    ref_losses, ref = _reference(S, x, y)
    ref = {k: v for k, v in ref.items() if k[0] in mine}

    def diff(a: dict, b: dict) -> float:
        """The largest difference; infinite where either has no gradient."""
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(
            float("inf") if a[k] is None or b[k] is None else (a[k] - b[k]).abs().max().item()
            for k in a
        )

    t = runs[torch_name]
    result = {"torch vs reference": diff(t["grads1"], ref), "torch runners": t["runners"]}
    for hint in hints:
        r = runs[hint]
        result[hint] = dict(
            ref=diff(r["grads1"], ref),
            torch1=diff(r["grads1"], t["grads1"]),
            torch2=diff(r["grads2"], t["grads2"]),
            runners=r["runners"],
            stashed=r["stashed"],
            kinds=r["kinds"],
        )
        if last:
            result[hint].update(
                loss=max(abs(a - b) for a, b in zip(r["losses"], t["losses"])),
                ref_loss=max(abs(a - b) for a, b in zip(r["losses"], ref_losses)),
                out=(r["out"] - t["out"]).abs().max().item(),
            )
    return result


@pytest.mark.parametrize(
    "V, torch_name",
    [(1, "Schedule1F1B"), (2, "ScheduleInterleavedZeroBubble")],
)
def test_dw_runner_gives_the_weight_gradients_torch_gives(V, torch_name):
    hints = ("bfw", "1f1b")  # W apart (the runner runs as W), and whole backwards (right after B)
    results = run_ranks(_with_dw_builder, 2, V, torch_name, hints, timeout=120)
    for rank, res in results.items():
        assert res["torch vs reference"] < TOL, (rank, res)  # the test's own model is right
        assert res["torch runners"] == [M] * V, (rank, res)
        for hint in hints:
            r = res[hint]
            assert r["kinds"] == (["B", "F", "W"] if hint == "bfw" else ["B", "F"]), (rank, r)
            assert r["runners"] == [M] * V and r["stashed"] == 0, (rank, hint, r)
            assert r["ref"] < TOL and r["torch1"] < TOL and r["torch2"] < TOL, (rank, hint, r)
            if "loss" in r:
                assert r["loss"] < TOL and r["ref_loss"] < TOL and r["out"] < TOL, (rank, hint, r)
    assert any("loss" in res["bfw"] for res in results.values())  # the last stage's rank checked
