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

from rrfp.app.bench.analysis import annotate, summarize
from rrfp.app.bench.launch import JobFailed, run_job
from rrfp.app.bench.report import CaseResult, write_results
from rrfp.app.bench.suite import (
    DEFAULT_CONTENDERS,
    FLAG,
    BenchSpec,
    Contender,
    parse_case,
    unavailable,
)
from rrfp.app.errors import UsageError
from rrfp.app.progress import progress
from rrfp.app.run_outputs import check_output
from rrfp.core.budget import Budget
from rrfp.core.cost import CostModel
from rrfp.observe.trace import Span, write_atomic

QUICK = {
    "workloads": ["gpt"],
    "pp": 2,
    "mb": 4,
    "reps": 1,
    "unit_ms": 2.0,
}  # --quick: a smoke run of seconds
FULL = {
    "workloads": ["gpt", "vlm"],
    "pp": 4,
    "mb": 16,
    "reps": 5,
    "unit_ms": 40.0,
}  # unit_ms well above the vlm's real F, so the CPU load does not set the task times
CALIBRATION_SAMPLES = 16


def build_spec(args) -> tuple[BenchSpec, dict[str, dict[str, str]]]:
    """The job, and per workload the contenders of the default set that cannot run it here (with
    why). A contender asked for by name that cannot run is an error instead."""
    base = QUICK if args.quick else FULL
    pick = {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in base}
    if pick["unit_ms"] <= 0:
        raise UsageError(
            f"--unit-ms must be > 0 (emulated device time per unit), got {pick['unit_ms']:g}"
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
    wanted = list(
        dict.fromkeys(Contender.parse(e) for e in (args.contenders or DEFAULT_CONTENDERS))
    )
    if not wanted:
        raise UsageError(f"{FLAG}: no contender given")
    spec = BenchSpec(
        tuple(cases),
        pick["pp"],
        args.tp,
        pick["mb"],
        pick["reps"],
        pick["unit_ms"],
        budget,
        torch_sends=args.torch_sends,
    )
    ready, skipped = [], {}
    for case in cases:
        case.train_config(spec)  # ConfigError (exit 2) when the workload cannot take these sizes
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


def _calibrate(spec: BenchSpec, out: Path) -> tuple[dict[str, str], dict[str, CostModel]]:
    """Fit a cost model on this machine for each workload whose task times come from its data;
    its file (what the ranks load) and the model itself, by workload."""
    from rrfp.app.calibrate_command import measure

    paths, models = {}, {}
    for case in spec.cases:
        if not case.calibrate:
            continue
        cfg = case.train_config(spec, tp=1)  # whole stages: the vlm has no tensor parallelism
        with progress(total=CALIBRATION_SAMPLES + 2, desc=f"calibrating {case.name}") as bar:
            samples = measure(
                cfg, CALIBRATION_SAMPLES, lambda done, total: bar.update(done - bar.n)
            )
        path = out / f"cost-{case.name}.json"
        models[case.name] = CostModel.fit(samples)
        write_atomic(path, models[case.name].to_json())
        paths[case.name] = str(path)
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
    }


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
        annotate(
            spec,
            case,
            cfg.emulation.variability,
            models.get(case.name, cfg.emulation.cost),
            got["rows"],
            got["iterations"],
        )
        spans = [Span(*sp) for sp in got["spans"]]
        results.append(
            CaseResult(
                case,
                got["rows"],
                got["iterations"],
                spans,
                summarize(got["rows"], [e.name for e in case.contenders]),
                cost.get(case.name),
                skipped.get(case.name, {}),
            )
        )
    text = write_results(out, spec, results, machine())
    print(text)
    print(f"results: {out}/ (results.md, results.json, timeline-*.png, trace-*.json, job.log)")
    return 0
