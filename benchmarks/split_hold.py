"""What deferring W costs the unsplit backward by itself: the unsplit backward, run as usual and
again while every nn.Linear's input and output gradient (what a deferred W keeps until it runs)
stay referenced until the backward ends, alternating, one thread. If holding alone costs what
the split's B + W costs over the unsplit backward (split_cost.py), the split's code is not where
that excess is.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/split_hold.py --case llama
"""

from __future__ import annotations

import argparse
import statistics

import torch
from split_cost import CASES, Pipeline, alternated, ratio_cell

from rrfp import SplitLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="llama", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    case = CASES[args.case]()
    pipe = Pipeline(case, None)
    held: list[torch.Tensor] = []
    holding = [False]

    def keep_input(module, inputs, output):
        if holding[0]:
            held.append(inputs[0])

    def keep_grad(module, grad_inputs, grad_outputs):
        if holding[0]:
            held.append(grad_outputs[0])

    for w in pipe.workers:
        for m in w.module.modules():
            if isinstance(m, (torch.nn.Linear, SplitLinear)):  # gpt's linears are SplitLinear
                m.register_forward_hook(keep_input)
                m.register_full_backward_hook(keep_grad)

    def backward_cpu(hold: bool) -> float:
        holding[0] = hold
        spent = pipe.run()["cpu"]
        held.clear()
        return spent

    runs = alternated(backward_cpu, [False, True], args.reps, warmup=4)
    plain, kept = runs[False], runs[True]
    print(
        f"{case.name}: unsplit backward {statistics.median(plain) * 1e3:.1f} ms per microbatch; "
        f"holding each linear's input and output gradient to its end "
        f"{statistics.median(kept) * 1e3:.1f} ms: "
        f"{ratio_cell([k / p for p, k in zip(plain, kept)])} ({args.reps} alternated repetitions, "
        "thread CPU)"
    )


if __name__ == "__main__":
    main()
