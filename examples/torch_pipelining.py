"""A plain torch.distributed.pipelining training loop that switches between torch's
Schedule1F1B and rrfp's ScheduleReady with one line.

    .venv/bin/torchrun --standalone --nproc-per-node 4 examples/torch_pipelining.py

Each rank builds the same model from one seed, keeps its stage module in a PipelineStage
and trains a few steps under each schedule, from the same weights and data; the
last rank prints both schedules' losses (equal), then a step whose microbatches
differ in sequence length, which only ScheduleReady runs (torch's receive
buffers have one shape).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from rrfp import ScheduleReady

VOCAB, DIM, MICROBATCHES, STEPS = 32, 16, 4, 3


class StageModule(nn.Module):
    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, h):
        h = self.body(self.embed(h) if self.embed is not None else h)
        return self.head(h) if self.head is not None else h


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def data(step: int, length: int = 12):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2 * MICROBATCHES, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(make_schedule, rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    modules = [StageModule(s == 0, s == world - 1) for s in range(world)]  # same weights each run
    stage = PipelineStage(modules[rank], rank, world, torch.device("cpu"))
    schedule = make_schedule(stage)
    opt = torch.optim.SGD(modules[rank].parameters(), lr=0.1)
    history = []
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        if losses:
            history.append(torch.stack(losses).mean().item())
    if hasattr(schedule, "close"):
        schedule.close()
    return history


def variable_lengths(rank: int, world: int) -> list[float]:
    """Microbatches of 5, 9, 7 and 12 tokens in one step, passed pre-split (torch 2.14's way)."""
    torch.manual_seed(0)
    modules = [StageModule(s == 0, s == world - 1) for s in range(world)]
    stage = PipelineStage(modules[rank], rank, world, torch.device("cpu"))
    mbs = [data(100 + i, n) for i, n in enumerate((5, 9, 7, 12))]
    mbs = [(x[:2], y[:2]) for x, y in mbs]
    losses = []
    with ScheduleReady(stage, MICROBATCHES, loss_fn=loss_fn) as schedule:
        schedule.step(
            arg_mbs=[(x,) for x, _ in mbs] if rank == 0 else None,
            target_mbs=[y for _, y in mbs] if rank == world - 1 else None,
            losses=losses,
        )
    return [loss.item() for loss in losses]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch_losses = train(
        lambda stage: Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn), rank, world
    )
    rrfp_losses = train(
        lambda stage: ScheduleReady(stage, MICROBATCHES, loss_fn=loss_fn), rank, world
    )
    varied = variable_lengths(rank, world)
    if rank == world - 1:
        print("step  Schedule1F1B  ScheduleReady")
        for step, (a, b) in enumerate(zip(torch_losses, rrfp_losses)):
            print(f"{step:4d}  {a:12.6f}  {b:13.6f}")
        same = all(abs(a - b) < 1e-5 for a, b in zip(torch_losses, rrfp_losses))
        print(f"equal losses: {same}")
        print(
            "microbatches of 5, 9, 7, 12 tokens (ScheduleReady only): "
            + ", ".join(f"{loss:.6f}" for loss in varied)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
