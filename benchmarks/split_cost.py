"""What the split backward costs: B + W over the unsplit backward, per workload, one thread.

Zero-bubble schedules pay off only when B and W together cost what the unsplit backward costs.
Each workload runs its pipeline's stages in one process, one after the other (F of every stage,
then the backward from the last stage down), once with the backward split as the runtime splits it
(B, then W) and once unsplit, the two alternating per repetition (A B, then B A). Every task is
timed in the compute thread's CPU time (``time.thread_time``: the machine is shared, and a thread
queued for a core spends no CPU) and in wall time. glibc's malloc keeps freed memory for reuse, as
the runtime's CPU lane sets it (rrfp/loop/host_memory.py): with its defaults B would fault in
afresh the pages W just freed, a cost the runtime does not pay. The ratio per repetition is B + W
over the unsplit backward, summed over the stages; the report gives its median, its quartiles and
its range, the same for wall time, and the load average. F is timed too: a split stage's forward
builds what B and W need (the split-aware functions' nodes, the graph's analysis), so the split's
cost per microbatch is F + B + W against the unsplit F + B, reported beside the backward's. A first
stage's split is its plain backward run in W, so the sum understates what a split costs where it
splits: the last stage's B + W ratio is reported apart.

Workloads: gpt-tiny 8 layers of 192 at pp 2, the VLM at pp 2 (configs/vlm-tiny.toml, 8 layers),
the mixture of experts at pp 2 (configs/moe-tiny.toml: grouped SwiGLU experts, router, shared
expert), and a 2-layer middle stage of HF transformers' LlamaModel with and without activation
checkpointing (``gradient_checkpointing_enable``, use_reentrant=False).

    .venv/bin/python benchmarks/split_cost.py [--reps 11] [--cases gpt,vlm,moe,llama,llama-ckpt]
        [--out docs/results/DATE-split-cost.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from rrfp import StageWorker, TrainConfig
from rrfp.loop import keep_freed_memory

# the split modes measured (StageWorker's weight_split): the generic split alone, and the
# split-aware functions with the generic split as the fallback
MODES = ("autograd", "functions")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Case:
    """One workload: its stage modules, its loss, and one microbatch (inputs, targets)."""

    name: str
    modules: list[nn.Module]
    loss_fn: object
    batch: tuple


def config_case(name: str, config: str, overrides: list[str]) -> Case:
    cfg = TrainConfig.load(os.path.join(ROOT, config), overrides, world_size=2)
    wl, S = cfg.workload, cfg.num_stages
    modules = [wl.build_stages(cfg.model, [s], S, cfg.run.seed)[0].train() for s in range(S)]
    return Case(name, modules, wl.loss_fn, wl.batches(cfg.data, 0, 1)[0])


class LlamaStage(nn.Module):
    """Hidden states through LlamaModel's decoder layers (no embedding lookup: a middle stage)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, h):
        return self.model(inputs_embeds=h, use_cache=False).last_hidden_state


def llama_case(name: str, checkpointing: bool, hidden: int = 256, seq: int = 128) -> Case:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    model = LlamaModel(cfg).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # a middle stage: stage 1 of 3, hidden states in and a gradient for them out
    return Case(name, [LlamaStage(model)], None, (torch.randn(4, seq, hidden), None))


# the config workloads of the split benchmarks (split_order.py runs their stages too): name,
# config, overrides
CONFIGS = {
    "gpt": (
        "gpt-tiny, 8 layers of 192, pp 2",
        "configs/gpt-tiny.toml",
        ["model.n_layer=8", "model.n_embd=192", "parallel.pp=2"],
    ),
    "vlm": (
        "vlm-tiny, 8 layers, pp 2",
        "configs/vlm-tiny.toml",
        ["model.n_layer=8", "parallel.pp=2"],
    ),
    "moe": (
        "moe-tiny, 4 blocks (3 of 8 routed experts top-2), pp 2",
        "configs/moe-tiny.toml",
        ["parallel.dp=1"],
    ),
}

CASES = {
    **{key: (lambda c=c: config_case(*c)) for key, c in CONFIGS.items()},
    "llama": lambda: llama_case("HF Llama stage, hidden 256, 2 layers", False),
    "llama-ckpt": lambda: llama_case(
        "HF Llama stage, hidden 256, 2 layers, activation checkpointing", True
    ),
}


class Pipeline:
    """A case's stages as StageWorkers of one mode (a ``weight_split``, or None: unsplit), run in
    one process."""

    def __init__(self, case: Case, mode: str | None) -> None:
        self.case, self.split = case, mode is not None
        self.middle = case.loss_fn is None  # one middle stage: hidden states in, gradient in
        S = len(case.modules)
        position = (1, 3) if self.middle else None
        self.workers = [
            StageWorker(
                m,
                *(position or (s, S)),
                1,
                case.loss_fn,
                split=self.split,
                measure_activations=False,
                weight_split=mode or "autograd",
            )
            for s, m in enumerate(case.modules)
        ]

    def run(self, profiles: dict | None = None) -> dict[str, float]:
        """One microbatch through every stage: CPU and wall seconds of backward tasks (B and W, or
        the unsplit B), summed over the stages, the last stage's apart (``cpu_last``: the stage
        with the loss, whose split a first stage's plain backward does not dilute), and of the
        forwards (``f_cpu``, ``f_wall``).
        ``profiles``: also profile each kind of task per op (torch.profiler), into
        ``profiles[kind]``."""
        x, y = self.case.batch
        spent = {"cpu": 0.0, "wall": 0.0}
        forwards = {"cpu": 0.0, "wall": 0.0}
        self.profiles = profiles
        last = len(self.workers) - 1
        for s, w in enumerate(self.workers):
            c0, t0 = time.thread_time(), time.perf_counter()
            x = w.forward(0, x, None if self.middle or s < last else y)
            forwards["cpu"] += time.thread_time() - c0
            forwards["wall"] += time.perf_counter() - t0
        grad = torch.randn_like(x) if self.middle else None
        for w in reversed(self.workers):
            grad = self._timed(spent, w.backward, 0, grad, kind="B" if self.split else "unsplit")
            if w is self.workers[-1]:
                spent["cpu_last"] = spent["cpu"]
        if self.split:
            for w in self.workers:
                before = spent["cpu"]
                self._timed(spent, w.weight, 0, kind="W")
                if w is self.workers[-1]:
                    spent["cpu_last"] += spent["cpu"] - before
        for w in self.workers:
            w.reset()
            w.module.zero_grad(set_to_none=True)
        return spent | {"f_" + clock: t for clock, t in forwards.items()}

    def _timed(self, spent: dict, fn, *args, kind: str):
        if self.profiles is not None:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                out = fn(*args)
            self.profiles.setdefault(kind, []).append(p)
            return out
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args)
        spent["cpu"] += time.thread_time() - c0
        spent["wall"] += time.perf_counter() - t0
        return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def ratio_cell(values: list[float]) -> str:
    """A ratio's median and quartiles, as the split benchmarks print them."""
    q1, median, q3 = quartiles(values)
    return f"{median:.3f}x ({q1:.3f}..{q3:.3f})"


def alternated(run, sides: list, reps: int, warmup: int) -> dict:
    """``run(side)`` for every side in turn, ``warmup`` rounds unrecorded then ``reps`` recorded,
    the sides' order reversed every other round, so that none always runs first or after the
    same other one: ``{side: [its result per recorded round]}``."""
    out: dict = {side: [] for side in sides}
    for r in range(warmup + reps):
        for side in sides if r % 2 else sides[::-1]:
            got = run(side)
            if r >= warmup:
                out[side].append(got)
    return out


def measure(case: Case, reps: int) -> dict:
    """``reps`` repetitions of every mode, unsplit included, their order reversed every other
    repetition (after two warm-ups: the first split microbatch also counts its FLOPs,
    split_summary's measurement). Per split mode and clock: medians and the ratio's spread."""
    modes = [None, *MODES]
    pipes = {m: Pipeline(case, m) for m in modes}
    runs = alternated(lambda m: pipes[m].run(), modes, reps, warmup=2)
    rows = [{m: runs[m][i] for m in modes} for i in range(reps)]
    out = {}
    for m in MODES:
        for clock in ("cpu", "wall"):
            ratios = [r[m][clock] / r[None][clock] for r in rows]
            out[m, clock] = {
                "split_ms": statistics.median(r[m][clock] for r in rows) * 1e3,
                "unsplit_ms": statistics.median(r[None][clock] for r in rows) * 1e3,
                "ratio": quartiles(ratios),
                "range": (min(ratios), max(ratios)),
            }
        last = [r[m]["cpu_last"] / r[None]["cpu_last"] for r in rows]
        out[m, "last"] = {"ratio": quartiles(last)}
        f_ratios = [r[m]["f_cpu"] / r[None]["f_cpu"] for r in rows]
        all_ratios = [
            (r[m]["f_cpu"] + r[m]["cpu"]) / (r[None]["f_cpu"] + r[None]["cpu"]) for r in rows
        ]
        out[m, "forward"] = {
            "split_ms": statistics.median(r[m]["f_cpu"] for r in rows) * 1e3,
            "unsplit_ms": statistics.median(r[None]["f_cpu"] for r in rows) * 1e3,
            "ratio": quartiles(f_ratios),
            "all": quartiles(all_ratios),
        }
    return out


def profile_ops(case: Case, mode: str, top: int, reps: int) -> list[str]:
    """Self CPU time and calls per op of B, W and the unsplit backward per microbatch (mean of
    ``reps`` alternated profiled microbatches after a warm-up), the ``top`` ops whose B + W differs
    most from the unsplit backward's."""
    per: dict[str, dict[str, list[float]]] = {}
    pipes = [Pipeline(case, mode), Pipeline(case, None)]
    for pipe in pipes * 2:  # warm-up
        pipe.run()
    profiles: dict = {}
    for rep in range(reps):
        for pipe in pipes if rep % 2 else pipes[::-1]:
            pipe.run(profiles)
    for kind, runs in profiles.items():
        for prof in runs:
            for e in prof.key_averages():
                got = per.setdefault(e.key, {}).setdefault(kind, [0.0, 0])
                got[0] += e.self_cpu_time_total / 1e3 / reps
                got[1] += e.count / reps
    kinds = ("unsplit", "B", "W")

    def cell(name: str, kind: str) -> str:
        ms, calls = per[name].get(kind, (0.0, 0))
        return f"{ms:.2f} ({calls:g})"

    def excess(name: str) -> float:
        got = per[name]
        return got.get("B", [0])[0] + got.get("W", [0])[0] - got.get("unsplit", [0])[0]

    total = {k: sum(v.get(k, [0])[0] for v in per.values()) for k in kinds}
    lines = [
        f"{case.name}, {mode}: self CPU ms (calls) per op and microbatch, summed over the "
        "stages; total unsplit "
        f"{total['unsplit']:.1f}, B {total['B']:.1f}, W {total['W']:.1f}",
        "",
        "| op | unsplit | B | W | B + W - unsplit |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in sorted(per, key=lambda n: -abs(excess(n)))[:top]:
        lines.append(
            f"| {name[:60]} | {' | '.join(cell(name, k) for k in kinds)} | {excess(name):+.2f} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--out", help="also write the table to this Markdown file")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N ops per workload "
        "whose B + W differs most from the unsplit backward (torch.profiler)",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    kept = keep_freed_memory()  # as the runtime's CPU lane does
    names = a.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    lines = [
        f"B + W over the unsplit backward, summed over each workload's stages; torch "
        f"{torch.__version__}, CPU, 1 thread; median of {a.reps} alternated repetitions; glibc "
        f"malloc {'keeping freed memory, as the CPU lane' if kept else 'as it is (not glibc)'}",
        "",
        "| workload | split | B + W CPU ms | unsplit CPU ms | ratio CPU (median) | IQR | min..max "
        "| ratio wall (median) | wall IQR | F CPU ms, split / unsplit | F ratio (IQR) "
        "| F + B + W over F + B, CPU (IQR) | last stage's B + W ratio, CPU (IQR) | load (1 min) |",
        "|---|---|---:|---:|---:|---|---|---:|---|---|---|---|---|---:|",
    ]
    print("\n".join(lines), flush=True)
    profiles: list[str] = []
    for name in names:
        case = CASES[name]()
        r = measure(case, a.reps)
        for m in MODES:
            c, w, f, ls = r[m, "cpu"], r[m, "wall"], r[m, "forward"], r[m, "last"]["ratio"]
            row = (
                f"| {case.name} | {m} | {c['split_ms']:.1f} | {c['unsplit_ms']:.1f} | "
                f"{c['ratio'][1]:.3f}x | {c['ratio'][0]:.3f}..{c['ratio'][2]:.3f} | "
                f"{c['range'][0]:.3f}..{c['range'][1]:.3f} | {w['ratio'][1]:.3f}x | "
                f"{w['ratio'][0]:.3f}..{w['ratio'][2]:.3f} | "
                f"{f['split_ms']:.1f} / {f['unsplit_ms']:.1f} | {f['ratio'][1]:.3f}x "
                f"({f['ratio'][0]:.3f}..{f['ratio'][2]:.3f}) | {f['all'][1]:.3f}x "
                f"({f['all'][0]:.3f}..{f['all'][2]:.3f}) | {ls[1]:.3f}x ({ls[0]:.3f}..{ls[2]:.3f}) "
                f"| {os.getloadavg()[0]:.1f} |"
            )
            lines.append(row)
            print(row, flush=True)
        if a.profile:
            for m in MODES:
                profiles += ["", *profile_ops(case, m, a.profile, a.reps)]
    print("\n".join(profiles))
    lines += profiles
    if a.out:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        with open(a.out, "w") as f:
            f.write(f"# Split backward cost ({stamp})\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
