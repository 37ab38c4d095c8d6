"""torch.distributed.pipelining's schedules next to rrfp's executors, on one model, data and durations.

Each rank builds every variant's stages from the same seed (gpt-tiny with
n_layer 8 by default, so the two-stage-per-rank schedules have 2 x 4 stages),
then runs them one after the other on each iteration's microbatches, with the
same emulated durations (variability preset x unit_ms; CPU machine: device time
is emulated, the tiny model's real compute hides inside it) and link latency.
The order rotates every iteration; iteration 0 warms up and is left out.
Gradients are zeroed after each variant, so every variant sees the same weights.
Reported: the median (and range) of the slowest rank's iteration time.

    .venv/bin/python benchmarks/torch_anchors.py [--mb 16 --preset lang --unit-ms 20 --reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TORCH = ("1f1b", "zbv", "interleaved-zb", "dualpipev")
RRFP = {"rrfp fixed 1f1b": ("fixed", "1f1b"), "rrfp ready bfw": ("ready", "bfw")}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt-tiny.toml")
    p.add_argument("--set", action="append", default=["model.n_layer=8"], metavar="KEY=VALUE",
                   help="config overrides (default: model.n_layer=8)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--preset", default="lang")
    p.add_argument("--unit-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=5, help="measured iterations per variant")
    p.add_argument("--torch", default=",".join(TORCH), help="torch schedules, comma-separated")
    p.add_argument("--torch-sends", choices=("delayed", "native"), default="delayed",
                   help="delayed: torch's sends leave after the emulated link latency, from sender threads; "
                        "native: torch issues and waits its own sends, with no latency")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from rrfp.app.config import TrainConfig
    from rrfp.core.durations import TaskTimes
    from rrfp.core.variability import Variability
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.torch_schedules import TorchScheduleRunner, workload_stage_builder

    torch.set_num_threads(1)
    cfg = TrainConfig.load(a.config, [*a.set, f"microbatches={a.mb}", f"preset={a.preset}",
                                      f"unit_ms={a.unit_ms}"], world_size=a.world)
    wl, seed, unit_s = cfg.workload, cfg.run.seed, a.unit_ms / 1000
    var = Variability.preset(a.preset)
    build = workload_stage_builder(wl, cfg.model, seed)

    async def main():
        rt = PipelineRuntime.start(pp=a.world, timeout_s=120, unit_ms=a.unit_ms)
        rows = []
        try:
            rank = rt.rank
            variants = {}
            for name in a.torch.split(","):
                variants[f"torch {name}"] = TorchScheduleRunner(name, build, wl.loss_fn, rank, a.world, a.mb, unit_s)
            module = build(rt.stage, rt.num_stages)
            for name, (dispatch, hint) in RRFP.items():
                variants[name] = rt.stage_executor(module, wl.loss_fn, microbatches=a.mb, dispatch=dispatch,
                                                   hint=hint, variability=var, seed=seed)
            names = list(variants)
            for it in range(a.reps + 1):
                data = wl.batches(cfg.data, it, a.mb)
                for i in range(len(names)):
                    name = names[(i + it) % len(names)]
                    v = variants[name]
                    dist.barrier()
                    if name.startswith("torch"):
                        times = TaskTimes(var, seed, v.split)  # what the rrfp executors' lanes hold
                        latency = None if a.torch_sends == "native" else (
                            lambda s, m, k: times.latency(it, s, m, k))
                        res = v.run_iteration(it, data, lambda s, m, k: times.units(it, s, m, k), latency)
                        wall, params = res.wall_s, list(v.parameters())
                    else:
                        res = await v.run_iteration(it, data)
                        wall, params = res.stats.wall, list(module.parameters())
                    for p in params:
                        p.grad = None
                    vec = torch.tensor([wall], dtype=torch.float64)
                    dist.all_reduce(vec, dist.ReduceOp.MAX)
                    if it > 0:
                        rows.append({"variant": name, "iteration": it, "wall_s": vec.item()})
        except BaseException:
            await rt.aclose()
            raise
        await rt.finish()
        return rows

    rows = run(main())
    if int(os.environ["RANK"]) == 0:
        with open(a.worker, "w") as f:
            json.dump(rows, f)


def report(a, rows) -> None:
    from rrfp.core.variability import Variability
    from rrfp.sim import SimConfig, simulate

    print(f"{a.world} CPU gloo ranks, {a.config} with {' '.join(a.set)}, M={a.mb}, preset {a.preset}, "
          f"unit {a.unit_ms:g} ms of emulated device time (CPU machine: device time is emulated), "
          f"{a.reps} iterations per variant, rotating order; slowest rank's iteration time; torch sends "
          f"{a.torch_sends}")
    by = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["iteration"]] = r["wall_s"]
    base = by.get("torch 1f1b")
    for name, walls in by.items():
        w = sorted(walls.values())
        line = (f"  {name:<22} median {statistics.median(w) * 1000:7.1f} ms "
                f"(min {w[0] * 1000:.1f}, max {w[-1] * 1000:.1f})")
        if base and name != "torch 1f1b":
            ratios = [base[i] / walls[i] for i in walls if i in base]
            line += f"; speedup over torch 1f1b median {statistics.median(ratios):.3f}x"
        print(line)
    var = Variability.preset(a.preset)
    sim = sorted(simulate(SimConfig(a.world, a.mb, "1f1b", "fixed", "2x", var, seed=0, iteration=i)).makespan
                 * a.unit_ms for i in range(1, a.reps + 1))
    print(f"  simulated fixed 1f1b   median {statistics.median(sim):7.1f} ms (min {sim[0]:.1f}, max {sim[-1]:.1f}) "
          "(rrfp sim, same durations: what a 1F1B order costs with no overhead)")


def main() -> None:
    a = parse()
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.world}",
               os.path.abspath(__file__), "--worker", out, "--config", a.config, "--world", str(a.world),
               "--mb", str(a.mb), "--preset", a.preset, "--unit-ms", str(a.unit_ms), "--reps", str(a.reps),
               "--torch", a.torch, "--torch-sends", a.torch_sends]
        for s in a.set:  # the worker's parser adds the default again: later overrides win
            cmd += ["--set", s]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            rows = json.load(f)
    report(a, rows)


if __name__ == "__main__":
    main()
