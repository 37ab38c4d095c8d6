"""Soak: many iterations of PP=4 under preset `lang` plus link jitter, in
emulated device time, to show the runtime neither deadlocks nor leaks.

Each rank trains the tiny GPT with the ready executor (BFW), AdamW and the
step's statistics all-reduce, as `rrfp train` does, and records its resident
memory (RSS, /proc/self/statm) after iteration 20 and after the last one. The
run counts as deadlocked if it has not ended within --deadline-s. The target
is an RSS growth below 5 % from iteration 20 to the end.

    .venv/bin/python benchmarks/soak.py \
        [--iterations 200 --pp 4 --n-microbatches 8 --unit-ms 2 --comm-jitter 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WARM = 20  # the iteration whose RSS is the baseline: allocator pools and caches have filled by then


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--n-microbatches", type=int, default=8)
    p.add_argument(
        "--unit-ms", type=float, default=2.0, help="emulated device time of an average forward"
    )
    p.add_argument(
        "--comm-jitter", type=float, default=0.5, help="lognormal sigma on each message's latency"
    )
    p.add_argument("--hint", default="bfw")
    p.add_argument(
        "--deadline-s", type=float, default=900.0, help="no end by then counts as a deadlock"
    )
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(a) -> None:
    import torch

    from rrfp import PipelineRuntime, Variability, run
    from rrfp.models.data import DataConfig, batches
    from rrfp.models.gpt import GPT, GPTConfig, loss_fn, make_stage

    torch.set_num_threads(1)
    model_cfg = GPTConfig(n_layer=a.pp, n_embd=32, n_head=4, block_size=64)
    data_cfg = DataConfig(seed=0, microbatch_size=2, min_seq_len=16, max_seq_len=64)
    var = Variability.preset("lang", comm_jitter=a.comm_jitter)

    async def main():
        async with PipelineRuntime.start(pp=a.pp, timeout_s=60, unit_ms=a.unit_ms) as rt:
            torch.manual_seed(0)
            module = make_stage(GPT(model_cfg), rt.stage, rt.num_stages)
            ex = rt.stage_executor(
                module, loss_fn, n_microbatches=a.n_microbatches, hint=a.hint, variability=var
            )
            sync = rt.grad_sync(module, ex)
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
            rss, losses, t0 = {}, [], time.perf_counter()
            for it in range(a.iterations):
                res = await ex.run_iteration(it, batches(data_cfg, it, a.n_microbatches))
                await sync.sync()
                opt.step()
                opt.zero_grad(set_to_none=True)
                vec = torch.tensor([res.loss or 0.0], dtype=torch.float64)
                await rt.all_reduce(vec, what=f"iteration {it}: loss all-reduce")
                losses.append(vec.item())
                if it + 1 in (WARM, a.iterations):
                    rss[it + 1] = rss_bytes()
            wall = time.perf_counter() - t0
            gathered = await rt.gather_object({"rank": rt.rank, "rss": rss, "wall_s": wall})
            return gathered, losses

    gathered, losses = run(main())
    if int(os.environ["RANK"]) == 0:
        import rrfp

        with open(a.worker, "w") as f:
            json.dump(
                {"ranks": gathered, "losses": losses, "rrfp": os.path.dirname(rrfp.__file__)}, f
            )


def main() -> None:
    a = parse()
    if a.worker:
        return worker(a)
    if a.iterations < WARM:
        sys.exit(f"soak: --iterations must be >= {WARM}")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "soak.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={a.pp}",
            os.path.abspath(__file__),
            "--worker",
            out,
            "--pp",
            str(a.pp),
            "--n-microbatches",
            str(a.n_microbatches),
            "--iterations",
            str(a.iterations),
            "--unit-ms",
            str(a.unit_ms),
            "--comm-jitter",
            str(a.comm_jitter),
            "--hint",
            a.hint,
        ]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]
        )  # this checkout's rrfp
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                cmd,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
                timeout=a.deadline_s,
                cwd=root,
            )
        except subprocess.TimeoutExpired:
            sys.exit(f"soak: DEADLOCK? the run did not end within {a.deadline_s:g} s")
        if done.returncode != 0:
            sys.exit(f"soak: the run failed (exit {done.returncode})")
        with open(out) as f:
            doc = json.load(f)
    took = time.monotonic() - t0
    print(
        f"soak: PP={a.pp}, M={a.n_microbatches}, ready {a.hint}, "
        f"preset lang + comm_jitter={a.comm_jitter:g}, "
        f"unit {a.unit_ms:g} ms: {a.iterations} iterations ended, no deadlock "
        f"({took:.0f} s with start-up); "
        f"loss {doc['losses'][0]:.3f} -> {doc['losses'][-1]:.3f}; rrfp from {doc['rrfp']}"
    )
    worst = 0.0
    print(f"rank  RSS@{WARM} MiB  RSS@{a.iterations} MiB  growth")
    for r in sorted(doc["ranks"], key=lambda r: r["rank"]):
        warm, end = r["rss"][str(WARM)], r["rss"][str(a.iterations)]
        growth = (end - warm) / warm
        worst = max(worst, growth)
        print(
            f"{r['rank']:4d}  {warm / 2**20:10.1f}  {end / 2**20:11.1f}  {growth:+6.2%}   "
            f"({r['wall_s'] / a.iterations * 1e3:.0f} ms/iteration)"
        )
    verdict = "within" if worst < 0.05 else "ABOVE"
    print(f"largest growth {worst:+.2%}: {verdict} the 5 % target")


if __name__ == "__main__":
    main()
