"""What one F and one B cost under rrfp's stage worker and under the bench's torch path, one thread.

``rrfp bench`` compares rrfp's executors with torch's schedules over the same stage modules; a gap
between fixed 1F1B and torch's ``Schedule1F1B`` (the same order) is either work one side does and
the other does not, or time the machine gave one side and not the other. This takes the machine
out: every stage of a config in one process, one thread, each microbatch's F through every stage
then B back, once as rrfp's ``StageWorker`` runs it and once as the bench's torch runner does (the
stage in its envelope, the boundary packed and unpacked, the backward through torch's
``stage_backward``), the two alternated per repetition. Each task is timed in the thread's CPU
time; the report gives the median per task kind and stage, and the load average.

    PYTHONPATH=. .venv/bin/python benchmarks/torch_stage_cost.py [--config configs/moe-tiny.toml]
        [--set parallel.dp=1] [--microbatches 8] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.distributed.pipelining._backward import stage_backward

from rrfp import StageWorker, TrainConfig
from rrfp.app.bench.torch_schedules import _Envelope, probe_capacity
from rrfp.nn.moe_aux_loss import aux_loss_scale


def timed(spent: list, fn, *args):
    c0 = time.thread_time()
    out = fn(*args)
    spent.append(time.thread_time() - c0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/moe-tiny.toml")
    p.add_argument("--set", action="append", default=["parallel.dp=1"], metavar="KEY=VALUE")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = TrainConfig.load(a.config, a.set, world_size=2)
    wl, S, M = cfg.workload, cfg.num_stages, a.microbatches
    batches = wl.batches(cfg.data, 0, M)

    def build(stage: int, _num: int = S):
        torch.manual_seed(cfg.run.seed)
        return wl.build_stage(cfg.model, stage, S, None).train()

    workers = [
        StageWorker(build(s), s, S, M, wl.loss_fn, split=False, measure_activations=False)
        for s in range(S)
    ]
    capacity = probe_capacity(build, S, batches)
    envs = [_Envelope(build(s), s == 0, s == S - 1, capacity, torch.float32, s) for s in range(S)]

    def rrfp_iteration(spent):
        for mb, (x, y) in enumerate(batches):
            for s, w in enumerate(workers):
                x = timed(spent["F", s], w.forward, mb, x, y if s == S - 1 else None)
            g = None
            for s in reversed(range(S)):
                g = timed(spent["B", s], workers[s].backward, mb, g)
        for w in workers:
            w.reset()
            w.module.zero_grad(set_to_none=True)

    def torch_iteration(spent):
        for x, y in batches:
            args, kept = (x,), []
            for s in range(S):

                def forward(s=s, args=args, y=y):
                    ins = (
                        args
                        if s == 0
                        else tuple(t.detach().requires_grad_(t.is_floating_point()) for t in args)
                    )
                    with aux_loss_scale(1 / M):
                        out = envs[s](*ins)
                    return ins, wl.loss_fn(out, y) / M if s == S - 1 else out

                ins, out = timed(spent["F", s], forward)
                kept.append((ins, out))
                args = out
            g = None
            for s in reversed(range(S)):
                ins, out = kept[s]
                needs = [t for t in ins if t.requires_grad]
                grads = None if s == S - 1 else (g[0], None)
                g = timed(spent["B", s], stage_backward, out, grads, needs)
        for e in envs:
            e.zero_grad(set_to_none=True)

    runs = {
        "rrfp": (rrfp_iteration, defaultdict(list)),
        "torch": (torch_iteration, defaultdict(list)),
    }
    for rep in range(a.reps + 1):  # the first is a warm-up
        for fn, spent in runs.values() if rep % 2 else list(runs.values())[::-1]:
            fn(spent if rep else defaultdict(list))
    print(
        f"thread CPU ms per task, median of {a.reps} x {M} microbatches; load "
        f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}, 1 thread\n"
    )
    print("| task | rrfp | torch path | torch / rrfp |\n|---|---:|---:|---:|")
    for key in sorted(runs["rrfp"][1]):
        r, t = (statistics.median(runs[n][1][key]) * 1e3 for n in ("rrfp", "torch"))
        print(f"| {key[0]}, stage {key[1]} | {r:.2f} | {t:.2f} | {t / r:.2f}x |")


if __name__ == "__main__":
    main()
