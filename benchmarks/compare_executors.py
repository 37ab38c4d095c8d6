"""Fixed 1F1B vs ready BFW on real gloo ranks, in emulated device time.

Each rank runs both executors on the same iterations' durations, alternating
A and B, and reports the median ratio and its spread; the simulator's
prediction for the same durations is printed beside each measurement.
Device time is emulated by the compute lane (CPU machine): a task holds its
lane for (variability units x unit_ms); the tiny model's real compute is
hidden inside that time.

    .venv/bin/python benchmarks/compare_executors.py [--pp 4 --mb 16 --preset lang --reps 5 --unit-ms 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PAIRS = {"A": ("fixed", "1f1b"), "B": ("ready", "bfw")}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage (world = pp * tp)")
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--preset", default="lang")
    p.add_argument("--reps", type=int, default=5, help="iterations per executor (alternating)")
    p.add_argument("--unit-ms", type=float, default=20.0)
    p.add_argument("--budget", default="2x")
    p.add_argument("--also-none", action="store_true", help="also compare ready vs fixed 1F1B under preset none")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (make run)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args()


def worker(a) -> None:
    import torch

    from models.data import DataConfig, batches
    from models.gpt import GPT, GPTConfig, loss_fn, make_stage
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.core.variability import Variability

    torch.set_num_threads(1)
    model_cfg = GPTConfig(n_layer=a.pp, n_embd=32, n_head=4, block_size=64)
    # the TP group's collectives and the agreement run on gloo here
    data_cfg = DataConfig(seed=0, microbatch_size=2, min_seq_len=16, max_seq_len=48)
    plans = [(a.preset, PAIRS, a.budget)]
    if a.also_none:
        # same hint; at 1x, ready has fixed 1F1B's memory, so only dispatch differs
        plans.append(("none", {"A": ("fixed", "1f1b"), "B": ("ready", "1f1b")}, a.budget))
        plans.append(("none", {"A": ("fixed", "1f1b"), "B": ("ready", "1f1b")}, "1x"))

    async def main():
        rt = PipelineRuntime.start(pp=a.pp, tp=a.tp, timeout_s=120, unit_ms=a.unit_ms)
        out = []
        try:
            torch.manual_seed(0)
            module = make_stage(GPT(model_cfg), rt.stage, rt.num_stages, tp_group=rt.tp_group)
            for preset, pairs, budget in plans:
                var = Variability.preset(preset)
                exs = {k: rt.stage_executor(module, loss_fn, microbatches=a.mb, dispatch=e, hint=h, budget=budget,
                                      variability=var) for k, (e, h) in pairs.items()}
                for it in range(a.reps + 1):  # iteration 0 warms up
                    data = batches(data_cfg, it, a.mb)
                    for key in ("AB" if it % 2 == 0 else "BA"):
                        res = await exs[key].run_iteration(it, data)
                        module.zero_grad(set_to_none=True)
                        vec = torch.tensor([res.stats.wall, res.stats.decision_s / max(1, res.stats.decisions)], dtype=torch.float64)
                        await rt.all_reduce(vec, torch.distributed.ReduceOp.MAX)
                        if it > 0:
                            out.append({"preset": preset, "budget": budget, "key": key, "executor": pairs[key][0],
                                        "hint": pairs[key][1], "iteration": it, "wall_s": vec[0].item(),
                                        "decision_us_max_rank": vec[1].item() * 1e6})
            if a.tp > 1:  # agreement alone: back-to-back rounds, TP ranks entering together
                import time

                agreement = next(e for e in exs.values() if e.agreement is not None).agreement
                ready = {t for t in exs["B"].order[: a.mb]}
                rounds = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    await agreement.agree(ready)
                    rounds.append(time.perf_counter() - t0)
                out.append({"agreement_us": [r * 1e6 for r in rounds[50:]]})
        except BaseException:
            await rt.aclose()
            raise
        await rt.finish()
        return out

    rows = run(main())
    if int(os.environ["RANK"]) == 0:
        with open(a.worker, "w") as f:
            json.dump(rows, f)


def report(a, rows) -> None:
    from rrfp.sim import SimConfig, simulate
    from rrfp.core.variability import Variability

    agreement = [r for r in rows if "agreement_us" in r]
    rows = [r for r in rows if "agreement_us" not in r]

    print(f"PP={a.pp} TP={a.tp} M={a.mb} budget={a.budget} unit={a.unit_ms:g} ms of emulated device time per average "
          f"forward (CPU machine: the compute lane emulates device time); {a.reps} iterations each, alternating")
    for preset, budget in dict.fromkeys((r["preset"], r["budget"]) for r in rows):
        rs = [r for r in rows if (r["preset"], r["budget"]) == (preset, budget)]
        var = Variability.preset(preset)
        by = {k: {r["iteration"]: r for r in rs if r["key"] == k} for k in "AB"}
        names = {k: f"{next(iter(by[k].values()))['executor']} {next(iter(by[k].values()))['hint']}" for k in "AB"}
        ratios = [by["A"][i]["wall_s"] / by["B"][i]["wall_s"] for i in by["A"]]
        print(f"\npreset {preset}, ready budget {budget}: {names['B']} vs {names['A']}: median speedup {statistics.median(ratios):.3f}x "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)})")
        for k in "AB":
            errs = []
            for i, r in sorted(by[k].items()):
                ex, hint = r["executor"], r["hint"]
                pred = simulate(SimConfig(a.pp, a.mb, hint, ex, budget, var, seed=0, iteration=i)).makespan
                pred_s = pred * a.unit_ms / 1000
                errs.append(r["wall_s"] / pred_s - 1)
            med = statistics.median(r["wall_s"] for r in by[k].values())
            print(f"  {names[k]:<11} median {med * 1000:7.1f} ms/iteration; measured vs simulated: "
                  f"median {statistics.median(errs):+.1%} (range {min(errs):+.1%} .. {max(errs):+.1%})")
        dec = [r["decision_us_max_rank"] for r in rs if r["executor"] == "ready"]
        what = "decision cost incl. TP agreement all-reduce on gloo" if a.tp > 1 else "arbitration decision cost"
        print(f"  {what} (ready, slowest rank): median {statistics.median(dec):.1f} us")
    for r in agreement:
        us = sorted(r["agreement_us"])
        print(f"\nTP agreement alone (one MIN all-reduce of the ready vector on gloo, {len(us)} back-to-back "
              f"rounds): median {statistics.median(us):.0f} us, p10 {us[len(us) // 10]:.0f}, "
              f"p90 {us[len(us) * 9 // 10]:.0f}; in-iteration decision times above include waiting for the "
              f"slower TP peer")


def main() -> None:
    a = parse()
    if a.worker:
        return worker(a)
    if a.quick:
        a.reps = min(a.reps, 3)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.pp * a.tp}",
               os.path.abspath(__file__), "--worker", out, "--pp", str(a.pp), "--tp", str(a.tp), "--mb", str(a.mb),
               "--preset", a.preset, "--reps", str(a.reps), "--unit-ms", str(a.unit_ms), "--budget", a.budget]
        if a.also_none:
            cmd.append("--also-none")
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            rows = json.load(f)
    report(a, rows)


if __name__ == "__main__":
    main()
