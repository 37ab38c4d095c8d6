"""One rank of the `rrfp bench` torchrun job:

    python -m torch.distributed.run --nproc-per-node W -m rrfp.app.bench.rank JOB.json ROWS.json

Every workload of the job runs every contender on the same iterations: one
warm-up, then ``reps`` measured ones, the contenders' order changed each
iteration so that none always goes first or always follows the same other
one. After each run the ranks all-reduce its wall time (the slowest rank's is
the iteration's). Rank 0 prints one progress line per run on stdout for the
parent's bar and writes every row and span to ROWS.json. A failure prints one
``rrfp: error: rank R: ...`` line (after its traceback) on stderr and exits 1
at once: torchrun then stops the other ranks, and the parent reports that line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from dataclasses import astuple, replace
from pathlib import Path

import torch
import torch.distributed as dist

from rrfp.app.bench import threads as thread_stats
from rrfp.app.bench.runners import DropInRunner, RrfpRunner, Runner, TorchRunner
from rrfp.app.bench.suite import BenchSpec, Case, Contender, cost_key
from rrfp.app.errors import exit_now, one_line
from rrfp.core.cost import CostModel
from rrfp.core.hints import resolve
from rrfp.loop import run as run_loop
from rrfp.nn.expert_time import ExpertTimes
from rrfp.nn.moe_layer import moe_layers
from rrfp.observe.trace import Span, write_json
from rrfp.pipeline.runtime import PipelineRuntime

PROGRESS = "@rrfp-bench-progress "  # prefix of the progress lines rank 0 prints for the parent
log = logging.getLogger("rrfp.app.bench.rank")


def run_order(items: list, k: int) -> list:
    """The contenders' order in iteration ``k``: a row of a Williams design, balanced for what ran
    just before. A rotation keeps one cyclic order, so each contender would always follow the same
    other one and inherit its caches and allocator state (a split row's held tensors before an
    unsplit one); here, over ``n`` iterations (``2n`` for an odd count), each takes every position
    equally often and follows every other one equally often within an iteration."""
    n = len(items)
    # 0, 1, n-1, 2, n-2, ...: the differences between neighbours are all apart
    first = [(j + 1) // 2 if j % 2 else (n - j // 2) % n for j in range(n)]
    row = [items[(i + k) % n] for i in first]
    return row[::-1] if n % 2 and (k // n) % 2 else row


def _on(device: torch.device, value):
    """A microbatch's tensors (a tensor, or tuples and lists of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        moved = [_on(device, v) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value


def cost_of(
    spec: BenchSpec, case: Case, contender: Contender, cost_paths: dict[str, str], emulated
) -> CostModel | None:
    """The cost model ``contender`` runs with: with emulated time the workload's (calibrated, or
    its config's); with real compute the one calibrated for its layout, and only for a planned
    hint (it prices the plan; the tasks take what they take)."""
    if not spec.real:
        path = cost_paths.get(case.name)
        return CostModel.from_json(Path(path).read_text()) if path else emulated
    path = cost_paths.get(cost_key(case.name, contender))
    if path is None or contender.is_torch or not resolve(contender.hint).planned:
        return None
    return CostModel.from_json(Path(path).read_text())


def expert_times(spec: BenchSpec, wl, cfg, modules: list) -> ExpertTimes | None:
    """Emulated time with expert parallelism: the MoE tasks' experts and all-to-alls timed by
    their routing (rrfp/nn/expert_time.py), the reference microbatch the mean of the first
    iteration's over every replica (the same on every rank)."""
    layers = moe_layers(modules)
    if spec.ep == 1 or spec.real or not layers:
        return None
    data = wl.batches(cfg.data, 0, spec.n_microbatches * spec.dp)
    tokens = sum(wl.features(b)["tokens"] for b in data) / len(data)
    return ExpertTimes(rows=tokens * layers[0].top_k)


async def run_case(
    runtimes: dict,
    spec: BenchSpec,
    case: Case,
    cost_paths: dict[str, str],
    progress,
    replica_groups: list | None = None,
) -> dict:
    """``runtimes``: by (virtual, placement), the rank's runtime of each layout the contenders
    use; ``replica_groups``: with replicas, each one's pipeline ranks as a group (torch's
    schedules)."""
    rt = runtimes[(1, "interleaved")]
    cfg = case.train_config(spec)
    wl = cfg.workload
    var = cfg.emulation.variability
    device = rt.device

    # the rrfp contenders of one layout share its stage modules; torch's runners build their own
    modules = {
        key: [
            r.shard_experts(m.to(device))
            for m in wl.build_stages(cfg.model, r.stages, r.num_stages, spec.seed, r.tp_group)
        ]
        for key, r in runtimes.items()
    }
    module = modules[(1, "interleaved")][0]
    experts = expert_times(spec, wl, cfg, modules[(1, "interleaved")])
    replica = rt.dp_rank  # its own data and its own duration seed
    runners: dict[str, Runner] = {}
    for contender in case.contenders:
        cost = cost_of(spec, case, contender, cost_paths, cfg.emulation.cost)
        if contender.is_torch:
            group = replica_groups[replica] if replica_groups else None
            runners[contender.name] = TorchRunner(
                rt, contender, wl, cfg.model, spec, var, cost, group, experts
            )
        elif contender.drop_in:  # the rrfp contenders' module again, behind torch's PipelineStage
            runners[contender.name] = DropInRunner(rt, contender, module, wl, spec, var, cost)
        else:
            key = (contender.virtual, contender.placement)
            runners[contender.name] = RrfpRunner(
                runtimes[key],
                contender,
                modules[key] if contender.virtual > 1 else module,
                wl,
                spec,
                var,
                cost,
                experts,
            )
    rows, iterations, threads = [], [], []
    names = list(runners)
    M = spec.n_microbatches

    def inputs(it: int):
        data = wl.batches(cfg.data, it, M * spec.dp)[replica * M : (replica + 1) * M]
        moved = data if device.type == "cpu" else [_on(device, b) for b in data]
        return moved, [wl.features(b) for b in data]

    upcoming = inputs(0)
    for r in runners.values():
        r.prepare(0, upcoming[1])
    for it in range(spec.reps + 1):  # iteration 0 warms up
        data, feats = upcoming
        if it < spec.reps:  # e.g. planned while this iteration runs, as rrfp train does
            upcoming = inputs(it + 1)
            for r in runners.values():
                r.prepare(it + 1, upcoming[1])
        if it > 0:
            iterations.append({"iteration": it, "features": feats})
        for position, name in enumerate(run_order(names, it)):
            before = thread_stats.snapshot()
            m = await runners[name].run(it, data, feats)
            used = thread_stats.between(before, thread_stats.snapshot())
            if it > 0 and used:
                threads.append({"contender": name, "iteration": it, "rank": rt.rank, "roles": used})
            vec = torch.tensor(m.reduced(), dtype=torch.float64)
            await rt.all_reduce(
                vec, dist.ReduceOp.MAX, what=f"{case.name} {name} iteration {it}: statistics"
            )
            wall, peak, decision_us, plan_s, plan_waited_s, overhead_s = [
                None if v < 0 else v for v in vec.tolist()
            ]
            if it > 0:
                rows.append(
                    {
                        "contender": name,
                        "iteration": it,
                        "position": position,
                        "wall_s": wall,
                        "peak_inflight": None
                        if peak is None
                        else int(peak)
                        if peak.is_integer()
                        else peak,
                        "decision_us": decision_us,
                        "plan_s": plan_s,
                        "plan_waited_s": plan_waited_s,
                        "overhead_s": overhead_s,
                        "plan_order": None if m.plan_order is None else list(m.plan_order),
                    }
                )
            progress(f"{case.name} iteration {it} {name}")
    for r in runners.values():
        r.close()
    spans = [
        list(astuple(by_rank(sp, rt.rank) if spec.dp > 1 else sp))
        for r in runners.values()
        for sp in r.spans
        if sp.args.get("iteration", 0) > 0
    ]
    gathered = await rt.gather_object((spans, threads))
    return {
        "name": case.name,
        "rows": rows,
        "iterations": iterations,
        "spans": None if gathered is None else [sp for part, _ in gathered for sp in part],
        "threads": None if gathered is None else [t for _, part in gathered for t in part],
    }


def by_rank(sp: Span, rank: int) -> Span:
    """With replicas, a span on its rank's row (the replicas of a stage would share one), its
    stage kept in its args."""
    return replace(sp, stage=rank, args={**sp.args, "stage": sp.stage})


async def run_job(spec: BenchSpec, cost_paths: dict[str, str], progress) -> list[dict]:
    """One runtime per layout the contenders use (one stage per rank, and each virtual layout),
    all on the first one's process group, started in one order on every rank and finished in
    reverse."""
    torch.set_num_threads(1)  # one compute thread per rank: ranks do not fight over the cores
    backend = "nccl" if spec.device == "cuda" else "gloo"
    layouts = dict.fromkeys(
        [(1, "interleaved")]
        + [
            (contender.virtual, contender.placement)
            for c in spec.cases
            for contender in c.contenders
            if not contender.is_torch
        ]
    )
    async with contextlib.AsyncExitStack() as stack:
        runtimes = {}
        for virtual, placement in layouts:
            runtimes[(virtual, placement)] = await stack.enter_async_context(
                PipelineRuntime.start(
                    pp=spec.pp,
                    tp=spec.tp,
                    dp=spec.dp,
                    ep=spec.ep,
                    timeout_s=spec.timeout_s,
                    unit_ms=spec.unit_ms,
                    virtual=virtual,
                    placement=placement,
                    backend=backend,
                )
            )
        replica_groups = None
        if spec.dp > 1 and any(c.is_torch for case in spec.cases for c in case.contenders):
            # each replica's pipeline for torch's schedules: created in one order on every rank
            layout = runtimes[(1, "interleaved")].layout
            replica_groups = [
                dist.new_group([layout.rank_of(p, 0, d) for p in range(spec.pp)])
                for d in range(spec.dp)
            ]
        return [
            await run_case(runtimes, spec, case, cost_paths, progress, replica_groups)
            for case in spec.cases
        ]


def pin_to_core(local_rank: int) -> int | None:
    """Real compute on CPU: this rank's threads on one core of its own (the ``local_rank``-th it
    may use), so that ranks do not trade cores and a process pinned beside it slows it alone.
    The core, or None where the system cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local_rank % len(cores)]
    for tid in os.listdir("/proc/self/task"):  # threads started since; later ones inherit it
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {core})
    return core


def main(argv: list[str]) -> None:
    logging.basicConfig(level=os.environ.get("RRFP_LOG", "WARNING"), format="%(name)s: %(message)s")
    job_path, rows_path = argv
    rank = int(os.environ.get("RANK", "0"))
    job = json.loads(Path(job_path).read_text())
    spec = job["spec"]
    if spec.get("pin"):
        core = pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
        log.info("rank %d computes on core %s", rank, core)
    done = 0

    def progress(label: str) -> None:
        nonlocal done
        done += 1
        if rank == 0:
            print(PROGRESS + json.dumps({"done": done, "label": label}), flush=True)

    try:
        cases = run_loop(run_job(BenchSpec.from_dict(spec), job.get("cost", {}), progress))
        if rank == 0:
            write_json(rows_path, {"cases": cases})
    except Exception as e:
        traceback.print_exc()  # the job's log keeps it; the parent shows the line below
        print(f"rrfp: error: {one_line(e, rank)}", file=sys.stderr, flush=True)
        exit_now(1)
    exit_now(0)  # as in `rrfp train`: every group is down; leave before torch's C++ teardown


if __name__ == "__main__":
    main(sys.argv[1:])
