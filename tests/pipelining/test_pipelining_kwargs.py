"""Keyword arguments reach every stage through ScheduleReady, each microbatch its own, as torch's
schedules pass a rank's kwargs to each stage it holds (``forward_one_chunk``): torchtitan passes
the token positions (and attention masks) to every stage so. On 2 gloo ranks, one stage per rank and
two (interleaved and v), the losses, gradients and outputs equal torch's schedule on the same stages
and a single process, whole batches split as torch splits them and pre-split microbatches alike."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

VOCAB, DIM, LENGTH, BATCH, M = 11, 8, 5, 2, 4
TOL = 1e-10
# (stages per rank, placement) -> torch's schedule of that placement
TORCH_SCHEDULE = {
    (1, "interleaved"): "Schedule1F1B",
    (2, "interleaved"): "ScheduleInterleaved1F1B",
    (2, "v"): "ScheduleZBVZeroBubble",
}


class Shifted(nn.Module):
    """A stage whose every layer adds the microbatch's ``shift`` (a keyword argument): a stage that
    did not get it, or got another microbatch's, computes something else."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, h, *, shift):
        if self.embed is not None:
            h = self.embed(h)
        h = torch.tanh(self.body(h) + shift)
        return self.head(h) if self.head is not None else h


def full_model(stages: int) -> list[Shifted]:
    torch.manual_seed(0)
    return [Shifted(s == 0, s == stages - 1) for s in range(stages)]


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def held(rank: int, world: int, virtual: int, placement: str) -> tuple[int, ...]:
    if virtual == 1:
        return (rank,)
    return (rank, rank + world) if placement == "interleaved" else (rank, 2 * world - 1 - rank)


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH * M, LENGTH), generator=g)
    y = torch.randint(0, VOCAB, (BATCH * M, LENGTH), generator=g)
    return x, y, torch.randn(BATCH * M, 1, DIM, generator=g, dtype=torch.float64)


def reference(num_stages: int, mine, x, y, shift):
    """One process: per-microbatch losses, the mean loss's gradients of ``mine``, the output."""
    model = full_model(num_stages)
    losses, outs = [], []
    for i in range(0, len(x), BATCH):
        h = x[i : i + BATCH]
        for stage in model:
            h = stage(h, shift=shift[i : i + BATCH])
        outs.append(h)
        losses.append(loss_fn(h, y[i : i + BATCH]))
    (sum(losses) / len(losses)).backward()
    grads = {(s, n): p.grad.clone() for s in mine for n, p in model[s].named_parameters()}
    return [loss.item() for loss in losses], grads, torch.cat(outs).detach()


def _kwargs_parity(rank, world, virtual, placement):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    S = world * virtual
    mine = held(rank, world, virtual, placement)
    first, last = 0 in mine, S - 1 in mine
    model = full_model(S)
    x, y, shift = data(1)
    runs = {}
    try:
        for name in (TORCH_SCHEDULE[(virtual, placement)], "rrfp", "rrfp pre-split"):
            modules = [copy.deepcopy(model[s]) for s in mine]
            stages = [PipelineStage(c, s, S, torch.device("cpu")) for s, c in zip(mine, modules)]
            if name.startswith("rrfp"):
                schedule = ScheduleReady(stages if virtual > 1 else stages[0], M, loss_fn=loss_fn)
            else:
                cls = getattr(torch_schedules, name)
                schedule = cls(stages if virtual > 1 else stages[0], M, loss_fn=loss_fn)
            losses, eval_losses = [], []
            if name == "rrfp pre-split":
                rows = [slice(i, i + BATCH) for i in range(0, len(x), BATCH)]
                merged = schedule.step(
                    arg_mbs=[(x[r],) for r in rows] if first else None,
                    kwarg_mbs=[{"shift": shift[r]} for r in rows],
                    target_mbs=[y[r] for r in rows] if last else None,
                    losses=losses,
                )
            else:  # every rank passes the whole shift: it is split into microbatches as x is
                merged = schedule.step(
                    *((x,) if first else ()),
                    target=y if last else None,
                    losses=losses,
                    shift=shift,
                )
            grads = {
                (s, n): p.grad.clone()
                for s, c in zip(mine, modules)
                for n, p in c.named_parameters()
            }
            evaluated = None
            if name == "rrfp":  # forward only: each stage is called outside the executor
                evaluated = schedule.eval(
                    *((x,) if first else ()),
                    target=y if last else None,
                    losses=eval_losses,
                    shift=shift,
                )
                schedule.close()
            elif name == "rrfp pre-split":
                schedule.close()
            runs[name] = dict(
                losses=[loss.item() for loss in losses],
                grads=grads,
                merged=merged,
                eval_losses=[loss.item() for loss in eval_losses],
                evaluated=evaluated,
            )
    finally:
        dist.destroy_process_group()
    ref_losses, ref_grads, ref_out = reference(S, mine, x, y, shift)
    result = {}
    for name, r in runs.items():
        res = dict(
            grad=max((ref_grads[k] - r["grads"][k]).abs().max().item() for k in ref_grads),
            n_losses=len(r["losses"]),
        )
        if last:
            res["loss"] = max(abs(a - b) for a, b in zip(ref_losses, r["losses"]))
            merged = r["merged"]
            merged = torch.cat(merged) if isinstance(merged, list) else merged
            res["merged"] = (ref_out - merged).abs().max().item()
            if r["evaluated"] is not None:
                res["eval_loss"] = max(abs(a - b) for a, b in zip(ref_losses, r["eval_losses"]))
                res["evaluated"] = (ref_out - r["evaluated"]).abs().max().item()
        result[name] = res
    return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("virtual, placement", [(1, "interleaved"), (2, "interleaved"), (2, "v")])
def test_every_stage_gets_its_microbatch_kwargs_as_in_torch(virtual, placement):
    results = run_ranks(_kwargs_parity, 2, virtual, placement, timeout=90)
    holder = 0 if placement == "v" else 1  # the rank holding the last stage
    torch_name = TORCH_SCHEDULE[(virtual, placement)]
    for rank, res in sorted(results.items()):
        print(f"V {virtual} {placement} rank {rank}: {res}")
        for name in (torch_name, "rrfp", "rrfp pre-split"):
            r = res[name]
            assert r["grad"] < TOL, (rank, name, r)
            assert r["n_losses"] == (M if rank == holder else 0), (rank, name, r)
            if rank == holder:
                assert r["loss"] < TOL and r["merged"] < TOL, (rank, name, r)
        if rank == holder:
            r = res["rrfp"]
            assert r["eval_loss"] < TOL and r["evaluated"] < TOL, (rank, r)
