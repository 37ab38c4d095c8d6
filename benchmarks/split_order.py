"""What the split costs on one stage over a step's varied microbatches, in two task orders.

``split_cost.py`` times one microbatch through every stage. In a pipeline the split stage that
matters is the one that splits (not a first stage, whose W is its plain backward), a step's
microbatches differ in length, and W runs after other tasks: ready plan holds up to 4 microbatches
in flight. This runs one stage of a workload (its last, the one with the loss, by default) as a
``StageWorker`` over the ``M`` microbatches of one step, split (mode ``functions``) and unsplit, in
two orders each:

- tight: F, B (and W) of each microbatch in turn, as 1F1B runs a stage's own tasks;
- deep: four forwards first, then B of the oldest microbatch, the next F and the oldest W, as a
  split schedule with four microbatches in flight does.

The four runs alternate per repetition (and reverse every other one), each task timed in the
thread's CPU time (``time.thread_time``), one torch thread; the stage's input is the previous
stage's output for the same microbatch. Reported: the median per step of F, of B + W and of all,
and per repetition the paired ratio split over unsplit (median and quartiles). A benchmark
reading, not a test:

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/split_order.py [--reps 15]
        [--workload gpt] [--stage -1]

To compare two trees in one window, run it with ``PYTHONPATH`` set to each tree in turn
(``git worktree add``), alternating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from split_cost import CONFIGS, ratio_cell

from rrfp import StageWorker, TrainConfig
from rrfp.loop import keep_freed_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = CONFIGS  # split_cost.py's config workloads
IN_FLIGHT = 4  # the deep order's microbatches in flight


def orders(m: int) -> dict[str, list[tuple[str, int]]]:
    """The task orders of one step, split and unsplit (the unsplit ones without W)."""
    tight = [(k, mb) for mb in range(m) for k in "FBW"]
    deep = [("F", mb) for mb in range(min(IN_FLIGHT, m))]
    for mb in range(m):
        deep.append(("B", mb))
        if mb + IN_FLIGHT < m:
            deep.append(("F", mb + IN_FLIGHT))
        deep.append(("W", mb))
    return {"tight": tight, "deep": deep}


class Stage:
    """One stage of a workload, its inputs for every microbatch of step 0 computed once."""

    def __init__(self, workload: str, stage: int) -> None:
        _, config, overrides = WORKLOADS[workload]
        cfg = TrainConfig.load(os.path.join(ROOT, config), overrides, world_size=2)
        wl, S = cfg.workload, cfg.num_stages
        self.stage = stage % S
        mods = [wl.build_stages(cfg.model, [s], S, cfg.run.seed)[0].train() for s in range(S)]
        self.m = cfg.schedule.n_microbatches
        batches = wl.batches(cfg.data, 0, self.m)
        self.module = mods[self.stage]
        # each microbatch's input: what the stages before send (their workers' forward)
        before = [
            StageWorker(mods[s], s, S, self.m, wl.loss_fn, split=False) for s in range(self.stage)
        ]
        self.inputs = []
        for mb, (x, _) in enumerate(batches):
            for w in before:
                x = w.forward(mb, x)
            self.inputs.append(x)
        last = self.stage == S - 1
        self.targets = [y if last else None for _, y in batches]
        self.grads = None
        if not last:  # a middle stage's backward: a gradient for its output
            with torch.no_grad():
                self.grads = [torch.randn_like(self.module(x)) for x in self.inputs]
        self.workers = {
            split: StageWorker(
                self.module,
                self.stage,
                S,
                self.m,
                wl.loss_fn,
                split=split,
                measure_activations=False,
                weight_split="functions",
            )
            for split in (True, False)
        }

    def step(self, split: bool, order: list[tuple[str, int]]) -> dict[str, float]:
        """One step's tasks in ``order``: thread CPU seconds per kind."""
        w, spent = self.workers[split], {"F": 0.0, "B": 0.0, "W": 0.0}
        for kind, mb in order:
            if kind == "W" and not split:
                continue
            c0 = time.thread_time()
            if kind == "F":
                w.forward(mb, self.inputs[mb], self.targets[mb])
            elif kind == "B":
                w.backward(mb, None if self.grads is None else self.grads[mb])
            else:
                w.weight(mb)
            spent[kind] += time.thread_time() - c0
        w.reset()
        self.module.zero_grad(set_to_none=True)
        return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--workload", choices=WORKLOADS, default="gpt")
    p.add_argument("--stage", type=int, default=-1, help="which stage (default: the last)")
    a = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the runtime's CPU lane does
    st = Stage(a.workload, a.stage)
    runs = [(split, name, order) for name, order in orders(st.m).items() for split in (True, False)]
    rows: dict[tuple[bool, str], list[dict[str, float]]] = {(s, n): [] for s, n, _ in runs}
    for rep in range(a.reps + 2):  # two warm-ups
        for split, name, order in runs if rep % 2 else runs[::-1]:
            got = st.step(split, order)
            if rep >= 2:
                rows[split, name].append(got)
    print(
        f"{a.workload} stage {st.stage}, {st.m} microbatches, torch {torch.__version__}, CPU, 1 "
        f"thread, {a.reps} alternated repetitions, load {os.getloadavg()[0]:.1f}; ms of thread CPU "
        "per step (medians), and split over unsplit per repetition (median, IQR)\n"
    )
    print(
        "| order | split | F | B + W | all | all, split / unsplit (IQR) "
        "| B + W, split / unsplit (IQR) |"
    )
    print("|---|---|---:|---:|---:|---|---|")
    for name in orders(st.m):
        for split in (False, True):
            r = rows[split, name]
            f = statistics.median(x["F"] for x in r) * 1e3
            bw = statistics.median(x["B"] + x["W"] for x in r) * 1e3
            cells = ["—", "—"]
            if split:
                base = rows[False, name]
                for i, part in enumerate((("F", "B", "W"), ("B", "W"))):
                    cells[i] = ratio_cell(
                        [sum(x[k] for k in part) / sum(y[k] for k in part) for x, y in zip(r, base)]
                    )
            print(
                f"| {name} | {'split' if split else 'unsplit'} | {f:.1f} | {bw:.1f} | {f + bw:.1f} "
                f"| {cells[0]} | {cells[1]} |"
            )


if __name__ == "__main__":
    main()
