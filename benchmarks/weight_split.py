"""SplitLinear's queued W vs the autograd split, on one GPT stage, side by side.

Both modes run the same middle stage on the same microbatches, alternating
A and B per repetition; the report gives the median F, B and W time per
microbatch and B + W against the unsplit backward. CPU, real compute (no
emulated device time).

    .venv/bin/python benchmarks/weight_split.py [--embd 128 --layers 2 --seq 128 --reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rrfp import StageWorker
from rrfp.models.gpt import GPT, GPTConfig, loss_fn, make_stage


def worker(mode: str, stage) -> StageWorker:
    """One worker per mode for the whole run: a worker's first split microbatch also counts its
    FLOPs (split_summary), which no later one does."""
    split = mode != "unsplit"
    return StageWorker(
        stage, 1, 3, 1, loss_fn, split=split, weight_split="layers" if mode == "unsplit" else mode
    )


def one(w: StageWorker, stage, x, g) -> tuple[float, float, float]:
    split = w.split
    w.reset()
    t0 = time.perf_counter()
    w.forward(0, x)
    t1 = time.perf_counter()
    w.backward(0, g)
    t2 = time.perf_counter()
    if split:
        w.weight(0)
    t3 = time.perf_counter()
    stage.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="blocks on the measured stage")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3 * a.layers, n_embd=a.embd, n_head=4, block_size=a.seq)
    stage = make_stage(GPT(cfg), 1, 3)
    x = torch.randn(a.batch, a.seq, a.embd)
    g = torch.randn(a.batch, a.seq, a.embd)
    modes = ["layers", "autograd", "functions", "unsplit"]
    workers = {m: worker(m, stage) for m in modes}
    times = {m: [] for m in modes}
    for rep in range(a.reps + 1):  # the first repetition warms up
        for m in modes if rep % 2 else modes[::-1]:
            t = one(workers[m], stage, x, g)
            if rep:
                times[m].append(t)
    print(
        f"GPT middle stage: {a.layers} blocks, n_embd {a.embd}, batch {a.batch} x {a.seq} tokens, "
        f"CPU 1 thread, {a.reps} alternating repetitions (median per microbatch)"
    )
    base = statistics.median(t[1] for t in times["unsplit"])
    for m in modes:
        f, b, w = (statistics.median(t[i] for t in times[m]) for i in range(3))
        label = {
            "layers": "SplitLinear queue",
            "autograd": "autograd split",
            "functions": "split functions",
            "unsplit": "unsplit backward",
        }[m]
        print(
            f"  {label:<18} F {f * 1e3:7.2f} ms  B {b * 1e3:7.2f} ms  W {w * 1e3:7.2f} ms  "
            f"B+W {(b + w) * 1e3:7.2f} ms ({(b + w) / base:.2f}x unsplit)  "
            f"W share {w / (b + w):.0%}"
        )


if __name__ == "__main__":
    main()
