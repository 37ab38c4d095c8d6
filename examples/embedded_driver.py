"""An async training driver that embeds rrfp: its own stage module and loss,
one awaited pipeline iteration per step, and its own coroutine (a metrics
heartbeat standing in for data prefetch or checkpoint upload) on the same loop.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/embedded_driver.py
"""

import asyncio

import torch
from torch import nn

import rrfp
from rrfp import SplitLinear


def make_stage_module(stage: int, num_stages: int) -> nn.Module:
    """Stage s of a small MLP regressor: 16 -> 32 -> ... -> 1."""
    torch.manual_seed(stage)
    layers = [SplitLinear(16 if stage == 0 else 32, 32), nn.Tanh()]
    if stage == num_stages - 1:
        layers.append(SplitLinear(32, 1))
    return nn.Sequential(*layers)


def loss_fn(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred, target)


def batches(step: int, n_microbatches: int):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(n_microbatches):
        x = torch.randn(8, 16, generator=g)
        out.append((x, x.sum(dim=1, keepdim=True).sin()))
    return out


async def heartbeat(stop: asyncio.Event, ticks: list) -> None:
    while not stop.is_set():
        ticks.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.01)


async def main() -> None:
    torch.set_num_threads(1)
    # 5 ms of emulated device time per task; leaving the block cleanly waits for every rank
    async with rrfp.PipelineRuntime.start(unit_ms=5.0) as rt:
        module = make_stage_module(rt.stage, rt.num_stages)
        pipe = rt.stage_executor(module, loss_fn, n_microbatches=8, dispatch="ready", hint="bfw")
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        stop, ticks = asyncio.Event(), []
        async with asyncio.TaskGroup() as tg:
            tg.create_task(heartbeat(stop, ticks))
            for step in range(20):
                result = await pipe.run_iteration(step, batches(step, 8))
                opt.step()
                opt.zero_grad()
                if result.loss is not None and step % 5 == 0:
                    print(
                        f"[stage {rt.stage}] step {step} loss {result.loss:.4f} "
                        f"bubble {result.stats.bubble:.0%}"
                    )
            stop.set()
    stats = pipe.statistics()
    print(
        f"[rank {rt.rank}] heartbeat ticked {len(ticks)} times while the pipeline ran; "
        f"bubble {stats.bubble:.1%}, {stats.decisions} decisions at {stats.decision_us:.1f} us each"
    )


if __name__ == "__main__":
    rrfp.run(main())
