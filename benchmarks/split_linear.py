"""What the split linear costs alone: a stack of linears, B then W, against nn.Linear's backward.

``split_cost.py`` times whole stages, where the linears' own overhead (a Python node or hook per
linear in F and B, W's closure per linear) is a few percent inside the spread of the memory-bound
ops around them. This isolates it: ``--layers`` linears of ``--width`` over ``--rows`` rows, run
as a middle stage by the runtime's ``StageWorker`` (``weight_split="functions"``: its nn.Linear
modules take the split linear; an input that wants a gradient and no saved-tensor hooks, the form
a stage without checkpointing takes). F and the backward (B, then W) are timed in the thread's
CPU time, one torch thread, split and unsplit alternating per repetition. Reported: the medians of
F and of the backward (B + W split), and per repetition the paired ratio split over unsplit
(median and quartiles). A benchmark reading, not a test:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/split_linear.py [--reps 101]
        [--layers 12] [--width 192] [--rows 512]

To compare two trees in one window, run it with ``PYTHONPATH`` set to each tree in turn
(``git worktree add``), alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from split_cost import alternated, ratio_cell

from rrfp import StageWorker

STAGE, STAGES = 1, 3  # a middle stage: its input wants a gradient, and B returns it


def one(worker: StageWorker, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """F and the backward (B + W when split) of one microbatch: thread CPU seconds."""
    c0 = time.thread_time()
    worker.forward(0, x)
    c1 = time.thread_time()
    worker.backward(0, grad)
    if worker.split:
        worker.weight(0)
    c2 = time.thread_time()
    worker.reset()
    return c1 - c0, c2 - c1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=101)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--rows", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(torch.nn.Linear(a.width, a.width) for _ in range(a.layers)))
    workers = {
        split: StageWorker(
            stack,
            STAGE,
            STAGES,
            1,
            None,
            split=split,
            measure_activations=False,
            weight_split="functions",
        )
        for split in (True, False)
    }
    x = torch.randn(a.rows // 64 or 1, 64, a.width)
    grad = torch.randn_like(x)

    def run(split: bool) -> tuple[float, float]:
        spent = one(workers[split], x, grad)
        stack.zero_grad(set_to_none=False)  # W adds into a gradient, as from microbatch 2 on
        return spent

    times = alternated(run, [False, True], a.reps, warmup=6)
    f_ratio = [s[0] / u[0] for s, u in zip(times[True], times[False])]
    b_ratio = [s[1] / u[1] for s, u in zip(times[True], times[False])]
    print(
        f"{a.layers} linears of {a.width} over {x.shape[0] * x.shape[1]} rows, torch "
        f"{torch.__version__}, 1 thread, thread CPU, {a.reps} alternated repetitions\n"
    )
    print("| | F ms | backward ms | F ratio (IQR) | B + W over the backward (IQR) |")
    print("|---|---:|---:|---|---|")
    for split, name in ((False, "nn.Linear's backward"), (True, "split: B, then W")):
        f = statistics.median(t[0] for t in times[split]) * 1e3
        b = statistics.median(t[1] for t in times[split]) * 1e3
        ratios = f"{ratio_cell(f_ratio)} | {ratio_cell(b_ratio)}" if split else "— | —"
        print(f"| {name} | {f:.3f} | {b:.3f} | {ratios} |")


if __name__ == "__main__":
    main()
