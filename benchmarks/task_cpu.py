"""What one task computes under rrfp and under torch's schedule, on the same stages: thread CPU
time and page faults per task, F and B of each stage at pp 2, 1F1B's order, one torch thread.

A benchmark, not a test: run it and read the numbers.
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/task_cpu.py [--workload vlm] [--iterations 7]
        [--thread] [--keep-freed]

- rrfp: ``StageWorker.forward`` and ``backward`` (split off), as fixed 1F1B calls them.
- torch: the same stage modules called as they are, the received tensors made leaves that
  require grad, and a plain autograd backward, as torch's ``PipelineStage`` computes a chunk
  (without the bench's envelope, which adds a copy of the boundary to torch's side).

Both build the stages from one seed and run the same microbatches; the two alternate, each first
in turn, and the first iteration is a warm-up. ``--thread`` runs rrfp's tasks in a thread of their
own, as the compute lane does (torch computes on the main thread); ``--keep-freed`` first keeps
freed host memory for reuse (rrfp/loop/host_memory.py), as a CPU lane does. Page faults tell the
memory that a task faults in afresh; thread CPU counts the task's own time, not the machine's
load (though a loaded machine's caches still slow it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "vlm": ("configs/vlm-tiny.toml", ["model.n_layer=8"]),
    "gpt": ("configs/gpt-tiny.toml", ["model.n_layer=8", "model.n_embd=192"]),
    "moe": ("configs/moe-tiny.toml", ["parallel.dp=1"]),
}


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--workload", choices=sorted(WORKLOADS), default="vlm")
    a.add_argument("--iterations", type=int, default=7, help="the first one a warm-up")
    a.add_argument("--microbatches", type=int, default=8)
    a.add_argument("--thread", action="store_true", help="rrfp's tasks in a thread, as the lane")
    a.add_argument("--keep-freed", action="store_true", help="as a CPU lane keeps host memory")
    args = a.parse_args()

    from rrfp import StageWorker, TrainConfig
    from rrfp.loop import keep_freed_memory

    if args.keep_freed:
        print(f"freed memory kept: {keep_freed_memory()}")
    torch.set_num_threads(1)
    path, sets = WORKLOADS[args.workload]
    S, M = 2, args.microbatches
    cfg = TrainConfig.load(
        ROOT / path, [*sets, f"parallel.pp={S}", f"schedule.n_microbatches={M}"], world_size=S
    )
    wl = cfg.workload
    batches = wl.batches(cfg.data, 0, M)
    mine = wl.build_stages(cfg.model, range(S), S, 0)
    theirs = wl.build_stages(cfg.model, range(S), S, 0)
    # as the runtime builds them without a byte budget: no hook on every saved tensor
    workers = [
        StageWorker(m, k, S, M, wl.loss_fn, split=False, measure_activations=False)
        for k, m in enumerate(mine)
    ]
    lane = concurrent.futures.ThreadPoolExecutor(1) if args.thread else None
    cpu: dict[tuple[str, int], list[float]] = {}
    faults: dict[tuple[str, int], list[int]] = {}

    def measured(key, fn, *a):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        t0 = time.thread_time()
        out = fn(*a)
        cpu.setdefault(key, []).append(time.thread_time() - t0)
        faults.setdefault(key, []).append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
        return out

    def task(name: str, mb: int, fn, *a):
        if lane is not None and name.startswith("rrfp"):
            return lane.submit(measured, (name, mb), fn, *a).result()
        return measured((name, mb), fn, *a)

    def rrfp_iteration() -> None:
        for w in workers:
            w.reset()
        for mb, (x, y) in enumerate(batches):
            out = task("rrfp F0", mb, workers[0].forward, mb, x)
            bits = workers[0].output_requires_grad(mb)
            task("rrfp F1", mb, workers[1].forward, mb, out, y, bits)
            grad = task("rrfp B1", mb, workers[1].backward, mb)
            task("rrfp B0", mb, workers[0].backward, mb, grad)

    def floating(value) -> list[torch.Tensor]:
        items = value if isinstance(value, (tuple, list)) else [value]
        return [t for t in items if t.is_floating_point()]

    def forward_first(x):
        with torch.enable_grad():
            return theirs[0](x)

    def forward_last(sent, y):
        if isinstance(sent, torch.Tensor):
            received = sent.detach().requires_grad_(True)
        else:
            received = tuple(
                t.detach().requires_grad_(t.is_floating_point()) for t in sent
            )  # fmt: skip
        with torch.enable_grad():
            loss = wl.loss_fn(theirs[1](received), y) / M
        return received, loss

    def backward_last(received, loss):
        torch.autograd.backward(loss)
        return [t.grad for t in floating(received)]

    def torch_iteration() -> None:
        for mb, (x, y) in enumerate(batches):
            sent = task("torch F0", mb, forward_first, x)
            received, loss = task("torch F1", mb, forward_last, sent, y)
            grads = task("torch B1", mb, backward_last, received, loss)
            task("torch B0", mb, torch.autograd.backward, floating(sent), grads)

    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for i in range(args.iterations):
        if i == 1:
            cpu.clear()
            faults.clear()
        for run in (rrfp_iteration, torch_iteration)[:: 1 if i % 2 else -1]:
            run()
    names = sorted({name for name, _ in cpu})
    print(f"{'task':<9} {'CPU ms per iteration: min':>26} {'median':>7} {'faults per task':>16}")
    for name in names:
        low = sum(min(cpu[(name, mb)]) for mb in range(M))
        mid = sum(statistics.median(cpu[(name, mb)]) for mb in range(M))
        fl = statistics.mean(f for mb in range(M) for f in faults[(name, mb)])
        print(f"{name:<9} {1e3 * low:26.1f} {1e3 * mid:7.1f} {fl:16.0f}")
    for how, pick in (("min", min), ("median", statistics.median)):
        side = {
            who: sum(pick(cpu[(n, mb)]) for n in names if n.startswith(who) for mb in range(M))
            for who in ("rrfp", "torch")
        }
        print(f"rrfp over torch, thread CPU per iteration (per-task {how}s): "
              f"{side['rrfp'] / side['torch']:.3f}")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
