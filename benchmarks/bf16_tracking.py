"""bf16 autocast against float32: the same run (configs/gpt-tiny.toml with the whole recipe on)
trained twice on gloo ranks, once with compute.autocast = bfloat16 (float32 parameters and
optimizer) and once in float32; prints each step's losses and the largest gap between the two.

    .venv/bin/python benchmarks/bf16_tracking.py [--pp 2 --steps 50]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket

RECIPE = [
    "lr=3e-3",
    "warmup_steps=5",
    "schedule=cosine",
    "min_lr=3e-4",
    "weight_decay=0.1",
    "clip_grad_norm=1.0",
    "activation_checkpointing=layers",
]


def _rank(rank: int, world: int, port: int, sets: list[str], out) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import rrfp

    cfg = rrfp.TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=world)
    summary = rrfp.run(rrfp.stage_main(cfg))
    if rank == 0:
        out.put(summary.losses)


def train(world: int, sets: list[str]) -> list[float]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, sets, out)) for r in range(world)]
    for p in procs:
        p.start()
    losses = out.get(timeout=1800)
    for p in procs:
        p.join()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    sets = [*RECIPE, f"steps={args.steps}", f"pp={args.pp}", "log_dir=runs/logs"]
    f32 = train(args.pp, sets)
    bf16 = train(args.pp, [*sets, "compute.autocast=bfloat16"])
    print("step  float32   bfloat16  gap")
    for i, (a, b) in enumerate(zip(f32, bf16, strict=True)):
        print(f"{i + 1:>4}  {a:.5f}  {b:.5f}  {b - a:+.5f}")
    gaps = [abs(a - b) for a, b in zip(f32, bf16)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    rel = gaps[worst] / f32[worst]
    print(
        f"largest gap: {gaps[worst]:.5f} at step {worst + 1} ({rel:.2%} of the float32 loss); "
        f"mean gap {sum(gaps) / len(gaps):.5f}; final losses {f32[-1]:.4f} (float32), "
        f"{bf16[-1]:.4f} (bfloat16)"
    )


if __name__ == "__main__":
    main()
