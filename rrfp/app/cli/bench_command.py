"""`rrfp bench`: the benchmark suite, every contender side by side on real gloo
ranks in one torchrun job, into one results folder.

The parent checks every flag and config (bad input exits 2 before any rank
starts), calibrates the cost model of the workloads whose task times come
from their data, runs the job with a progress bar, then writes the folder
(rrfp.app.bench.report) and prints the tables and where they are.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from rrfp.app.bench.analysis import annotate, compute_summary, host_summary, summarize
from rrfp.app.bench.critical_path import critical_path
from rrfp.app.bench.launch import JobFailed, run_job
from rrfp.app.bench.report import CaseResult, write_results
from rrfp.app.bench.runners import auto_unsplit
from rrfp.app.bench.suite import (
    DEFAULT_CONTENDERS,
    FLAG,
    MOE,
    MOE_CONTENDERS,
    MOE_SHAPE,
    BenchSpec,
    Case,
    Contender,
    cost_key,
    parse_case,
    unavailable,
)
from rrfp.app.cli.progress import progress
from rrfp.app.errors import UsageError
from rrfp.app.job.run_outputs import check_output
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import resolve
from rrfp.observe.trace import Span, write_atomic

QUICK = {
    "workloads": ["gpt"],
    "pp": 2,
    "n_microbatches": 4,
    "reps": 1,
    "unit_ms": 2.0,
}  # --quick: a smoke run of seconds
FULL = {
    "workloads": ["gpt", "vlm"],
    "pp": 4,
    "n_microbatches": 16,
    "reps": 5,
    "unit_ms": 40.0,
}  # unit_ms well above the vlm's real F, so the CPU load does not set the task times
CALIBRATION_SAMPLES = 16
# --device cuda: one GPU holds both local stages of the v shape; fixed and ready at one hint
GPU_CONTENDERS = ("fixed bfw v2", "ready bfw v2", "fixed zbv v2", "ready zbv v2")


def build_spec(args) -> tuple[BenchSpec, dict[str, dict[str, str]]]:
    """The job, and per workload the contenders of the default set that cannot run it here (with
    why). A contender asked for by name that cannot run is an error instead."""
    base = QUICK if args.quick else FULL
    moe = args.workloads is not None and MOE in args.workloads
    if moe:  # its own job: pp x ep ranks
        if len(args.workloads) > 1:
            others = ", ".join(sorted(set(args.workloads) - {MOE}))
            raise UsageError(
                f"--workloads: {MOE} runs in a job of its own (pp {MOE_SHAPE['pp']} x ep "
                f"{MOE_SHAPE['ep']} ranks): bench it apart from {others}"
            )
        base = {**base, "pp": MOE_SHAPE["pp"]}
    elif args.ep is not None:
        raise UsageError(
            f"--ep sets the {MOE} workload's expert-parallel group: add --workloads moe"
        )
    pick = {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in base}
    device = getattr(args, "device", "cpu")
    if args.real:
        if args.unit_ms not in (None, 0):
            raise UsageError(
                f"--real runs without emulated time; --unit-ms {args.unit_ms:g} contradicts it"
            )
        pick["unit_ms"] = 0.0
    if pick["unit_ms"] < 0:
        raise UsageError(
            f"--unit-ms must be >= 0 (emulated device time per unit; 0: real compute, as --real), "
            f"got {pick['unit_ms']:g}"
        )
    real = pick["unit_ms"] == 0
    # the mixture of experts: each pipeline rank's ep replicas form one EP group; with real
    # compute on too few cores for ep 2 the default is one replica (experts local, no all-to-all)
    ep = (args.ep or MOE_SHAPE["ep"]) if moe else 1
    if moe and args.ep is None and real and device == "cpu":
        ep = ep if pick["pp"] * ep <= (os.cpu_count() or 1) else 1
    replicas = ep
    if args.pin and (not real or device != "cpu"):
        raise UsageError("--pin pins CPU ranks computing for real: add --real (on --device cpu)")
    if device != "cpu":
        if not real:
            raise UsageError(f"--device {device} runs real compute only: add --real")
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.pp is None:
            pick["pp"] = 1  # one GPU: its two local stages (the default contenders' v2)
        if pick["pp"] * args.tp * replicas > gpus:
            raise UsageError(
                f"--device cuda: {pick['pp'] * args.tp * replicas} ranks need as many GPUs, and "
                f"this machine has {gpus}"
            )
    cores = os.cpu_count() or 1
    if real and device == "cpu" and args.pp is None and pick["pp"] * replicas > cores:
        pick["pp"] = max(1, min(pick["pp"], cores // replicas))  # the default fits the machine
    if real and device == "cpu" and pick["pp"] * args.tp * replicas > cores:
        raise UsageError(
            f"--real on CPU runs one thread per rank: {pick['pp'] * args.tp * replicas} ranks "
            f"need as many cores, and this machine has {os.cpu_count()} "
            f"(lower --pp{' or --ep' if replicas > 1 else ''})"
        )
    try:
        budget = str(Budget.parse(args.budget))
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
    cases = [parse_case(w, args.preset, args.set) for w in pick["workloads"]]
    names = [c.name for c in cases]
    if not cases or len(set(names)) != len(names):
        raise UsageError(
            f"--workloads: give each workload once ({', '.join(names) or 'none given'})"
        )
    explicit = args.contenders is not None
    defaults = MOE_CONTENDERS if moe else DEFAULT_CONTENDERS if device == "cpu" else GPU_CONTENDERS
    wanted = list(dict.fromkeys(Contender.parse(e) for e in (args.contenders or defaults)))
    if not wanted:
        raise UsageError(f"{FLAG}: no contender given")
    spec = BenchSpec(
        tuple(cases),
        pick["pp"],
        args.tp,
        pick["n_microbatches"],
        pick["reps"],
        pick["unit_ms"],
        budget,
        torch_sends=args.torch_sends,
        device=device,
        pin=args.pin,
        dp=replicas,
        ep=ep,
    )
    ready, skipped = [], {}
    for case in cases:
        # ConfigError (exit 2) when the workload cannot take these sizes
        experts = getattr(case.train_config(spec).model, "moe_experts", 0)
        if moe and experts % ep:
            raise UsageError(f"--ep {ep}: {case.name}'s {experts} experts do not split over it")
        runs = []
        for contender in wanted:
            why = unavailable(contender, case, spec)
            if why is None:
                runs.append(contender)
            elif explicit:
                raise UsageError(f"{FLAG}: {contender.name} cannot run {case.name}: {why}")
            else:
                skipped.setdefault(case.name, {})[contender.name] = why
        ready.append(replace(case, contenders=tuple(runs)))
    return replace(spec, cases=tuple(ready)), skipped


def to_calibrate(spec: BenchSpec) -> dict[str, tuple[Case, Contender | None]]:
    """The cost models the job needs, by key (``cost_key``): with emulated time, one per workload
    whose task times come from its data; with real compute, one per workload and layout that a
    planned hint plans on (the plan needs the tasks' prices; nothing else does)."""
    if not spec.real:
        return {case.name: (case, None) for case in spec.cases if case.calibrate}
    need = {}
    for case in spec.cases:
        for c in case.contenders:
            if not c.is_torch and resolve(c.hint).planned:
                # the contenders of one key build the same config (its layout, its unsplit stages)
                need.setdefault(cost_key(case.name, c), (case, c))
    return need


def _calibrate(spec: BenchSpec, out: Path) -> tuple[dict[str, str], dict[str, CostModel]]:
    """Fit a cost model on this machine for each one the job needs (``to_calibrate``); its file
    (what the ranks load) and the model itself, by key."""
    from rrfp.app.cli.calibrate_command import measure

    paths, models = {}, {}
    for key, (case, contender) in to_calibrate(spec).items():
        # whole stages: the vlm has no tensor parallelism
        cfg = case.train_config(spec, tp=1, contender=contender)
        with progress(total=CALIBRATION_SAMPLES + 2, desc=f"calibrating {key}") as bar:
            samples = measure(
                cfg, CALIBRATION_SAMPLES, lambda done, total: bar.update(done - bar.n)
            )
        path = out / f"cost-{key}.json"
        models[key] = CostModel.fit(samples)
        if contender.unsplit == "auto":  # every stage whole too, to choose which split
            with progress(total=CALIBRATION_SAMPLES + 2, desc=f"calibrating {key} whole") as bar:
                whole = measure(
                    cfg,
                    CALIBRATION_SAMPLES,
                    lambda done, total: bar.update(done - bar.n),
                    whole=True,
                )
            models[key] = models[key].with_whole(CostModel.fit(whole))
            choice = auto_unsplit(spec, contender, cfg.emulation.variability, models[key])
            print(f"{case.name}, the auto unsplit rows: {choice.line()}")
        write_atomic(path, models[key].to_json())
        paths[key] = str(path)
    return paths, models


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load": _load(),
    }


def _load() -> str | None:
    """The machine's load average (1, 5 and 15 minutes) where the system says it: on a shared
    machine, what the figures were measured under."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def bench_command(args) -> int:
    spec, skipped = build_spec(args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"results/bench-{stamp}")
    check_output(
        "--out", out, folder=True
    )  # a file there is refused as "... is a file, not a folder"
    cost, models = _calibrate(spec, out)
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            progress(total=spec.runs, desc="rrfp bench") as bar,
        ):
            job = run_job(spec, Path(tmp), out / "job.log", cost, args.timeout, bar)
    except JobFailed as e:
        print(f"rrfp: error: bench job failed: {e}", file=sys.stderr)
        return 1
    results = []
    for case, got in zip(spec.cases, job["cases"]):
        cfg = case.train_config(spec)
        spans = [Span(*sp) for sp in got["spans"]]
        annotate(
            spec,
            case,
            cfg.emulation.variability,
            models if spec.real else models.get(case.name, cfg.emulation.cost),
            got["rows"],
            got["iterations"],
            spans,
        )
        hosts = [
            h
            for e in case.contenders
            if spec.real
            and not e.is_torch
            and (h := host_summary(e.name, spans, got["threads"])) is not None
        ]
        computes = [
            c for e in case.contenders if spec.real and (c := compute_summary(e, spans)) is not None
        ]
        paths = [
            p
            for e in case.contenders
            if spec.real and (p := critical_path(e.name, spans)) is not None
        ]
        results.append(
            CaseResult(
                case,
                got["rows"],
                got["iterations"],
                spans,
                summarize(got["rows"], [e.name for e in case.contenders]),
                cost.get(case.name),
                skipped.get(case.name, {}),
                got["threads"],
                hosts,
                computes,
                paths,
            )
        )
    text = write_results(out, spec, results, machine())
    print(text)
    print(f"results: {out}/ (results.md, results.json, timeline-*.png, trace-*.json, job.log)")
    return 0
