"""Fixed 1F1B, the fixed nominal BFW order, and ready BFW on a workload whose
task times come from its data (cost model x the preset's noise), side by side.

The parent calibrates the cost model on this machine (rrfp calibrate's
measurement), then real gloo ranks run the three executors on the same
iterations, rotating their order, with the lane emulating each task's
predicted time (CPU machine: device time is emulated). The fixed nominal BFW
order has the same order and memory as ready BFW, so their difference is
dispatch alone. Beside each measurement: the simulator replaying the same
durations.

    .venv/bin/python benchmarks/data_driven.py [--config configs/vlm-tiny.toml --pp 4 --mb 8 --reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CONFIGS = {"A": ("fixed", "1f1b"), "N": ("fixed", "bfw"), "R": ("ready", "bfw")}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/vlm-tiny.toml")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--preset", default="jitter", help="noise on top of the data's costs (default jitter)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--unit-ms", type=float, default=20.0)
    p.add_argument("--worker", nargs=2, metavar=("COST", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args()


def worker(a, cost_path: str, out_path: str) -> None:
    import torch

    from rrfp.app.config import TrainConfig
    from rrfp.core.cost import CostModel
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_num_threads(1)
    cfg = TrainConfig.load(a.config, [f"pp={a.pp}", f"microbatches={a.mb}", f"preset={a.preset}"])
    wl, cost = cfg.workload, CostModel.from_json(open(cost_path).read())

    async def main():
        rows = []
        async with PipelineRuntime.start(layout=cfg.layout, timeout_s=120, unit_ms=a.unit_ms) as rt:
            torch.manual_seed(0)
            module = wl.build_stage(cfg.model, rt.stage, rt.num_stages, None)
            exs = {k: rt.stage_executor(module, wl.loss_fn, microbatches=a.mb, dispatch=d, hint=h, budget="2x",
                                        variability=cfg.run.variability, cost=cost) for k, (d, h) in CONFIGS.items()}
            keys = list(CONFIGS)
            for it in range(a.reps + 1):  # iteration 0 warms up
                data = wl.batches(cfg.data, it, a.mb)
                feats = [wl.features(b) for b in data]
                for key in keys[it % 3:] + keys[:it % 3]:
                    res = await exs[key].run_iteration(it, data, feats)
                    module.zero_grad(set_to_none=True)
                    wall = torch.tensor([res.stats.wall], dtype=torch.float64)
                    await rt.all_reduce(wall, torch.distributed.ReduceOp.MAX)
                    if it > 0:
                        rows.append({"key": key, "iteration": it, "wall_s": wall.item(), "features": feats,
                                     "split": exs[key].settings.split})
        return rows

    rows = run(main())
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def main() -> None:
    a = parse()
    if a.worker:
        return worker(a, *a.worker)
    from rrfp.app.calibrate_command import measure
    from rrfp.app.config import TrainConfig
    from rrfp.core.cost import CostModel
    from rrfp.core.variability import Variability
    from rrfp.sim import SimConfig, simulate
    from rrfp.sim.replay import replay_durations

    cfg = TrainConfig.load(a.config, [f"pp={a.pp}"], world_size=a.pp)
    cost = CostModel.fit(measure(cfg, 16))
    with tempfile.TemporaryDirectory() as d:
        cost_path, out = os.path.join(d, "cost.json"), os.path.join(d, "rows.json")
        open(cost_path, "w").write(cost.to_json())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.pp}",
               os.path.abspath(__file__), "--worker", cost_path, out, "--config", a.config, "--pp", str(a.pp),
               "--mb", str(a.mb), "--preset", a.preset, "--reps", str(a.reps), "--unit-ms", str(a.unit_ms)]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.load(open(out))
    var = Variability.preset(a.preset)
    by = {k: {r["iteration"]: r for r in rows if r["key"] == k} for k in CONFIGS}
    print(f"{cfg.run.model}: PP={a.pp} M={a.mb}, task times from the data (cost model calibrated here) x preset "
          f"{a.preset}; {a.unit_ms:g} ms per unit of emulated device time (CPU machine); {a.reps} iterations "
          f"each, rotating A/N/R")
    for k, (dispatch, hint) in CONFIGS.items():
        ratios = [by["A"][i]["wall_s"] / by[k][i]["wall_s"] for i in by["A"]]
        errs = []
        for i, r in by[k].items():
            dur = replay_durations(cost, var, r["features"], 0, i, r["split"])
            sim = simulate(SimConfig(a.pp, a.mb, hint, dispatch, "2x", var, seed=0, iteration=i, split=r["split"],
                                     durations=dur.tolist())).makespan * a.unit_ms / 1000
            errs.append(r["wall_s"] / sim - 1)
        med = statistics.median(r["wall_s"] for r in by[k].values())
        print(f"  {k} {dispatch} {hint:<5} median {med * 1e3:7.1f} ms/iteration, speedup vs fixed 1F1B "
              f"{statistics.median(ratios):.3f}x (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"measured vs simulated {statistics.median(errs):+.1%}")


if __name__ == "__main__":
    main()
