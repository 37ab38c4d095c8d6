"""`rrfp calibrate`: measure every stage's real F, B and W on sample microbatches
in one process, fit the cost model, print the fit, and save it for `emulation.cost`.

It measures where the run will compute: on the GPU when the config's run is on
CUDA (``backend = nccl``), with each stage built by the same workload call the
run makes (so in the run's dtype), every task timed to the end of its device
work. The fit is judged on microbatches it was not fitted on (every other
sample), so the printed errors are what a run will see.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np
import torch

from rrfp.app.cli.calibration_quality import (
    held_out_errors,
    load_average,
    load_warning,
    negative_terms,
    split_held_out,
)
from rrfp.app.config.sections import ComputeSection
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.job.run_outputs import check_output
from rrfp.app.train.metrics_files import model_slug
from rrfp.core.cost import CostModel, ranking_agreement
from rrfp.observe.trace import write_atomic
from rrfp.pipeline.calibration import measure_stages
from rrfp.pipeline.schedule_settings import AUTO_UNSPLIT, resolve_weight_split

KINDS = "FBW"


def calibration_device(compute: ComputeSection) -> torch.device:
    """Where the run computes, so where to measure: the GPU when it runs on CUDA, else this CPU."""
    return torch.device(compute.device_type)


def measure(
    cfg: TrainConfig, samples: int, progress=None, whole: bool = False
) -> list[tuple[int, int, dict, float]]:
    """(stage, kind, features, seconds) for every task of ``samples`` microbatches of the workload,
    split backward (``weight_split`` resolved as the run resolves it, ``unsplit_stages`` whole; with
    "auto", every stage split), on the run's device (``calibration_device``), each stage built as
    the run builds it. ``whole``: every stage unsplit instead (``CostModel.with_whole``)."""
    wl, S = cfg.workload, cfg.num_stages  # pp x virtual pieces
    device = calibration_device(cfg.compute)
    torch.set_num_threads(cfg.compute.threads)
    torch.manual_seed(cfg.run.seed)
    stages = [wl.build_stage(cfg.model, s, S, None).to(device) for s in range(S)]
    mode = resolve_weight_split(cfg.schedule.weight_split, cfg.beyond_split_functions())[0]
    batches = [
        wl.batches(cfg.data, 10_000 + i, 1)[0] for i in range(samples + 2)
    ]  # the first two warm up
    return measure_stages(
        stages,
        wl.loss_fn,
        batches,
        wl.features,
        device,
        warmup=2,
        progress=progress,
        unsplit_stages=range(S) if whole else as_run_unsplit(cfg),
        weight_split=mode,
    )


def report(
    model: CostModel, held_out: list[tuple[int, int, dict, float]], S: int, file=sys.stdout
) -> dict:
    """Median |error| and rank agreement per stage and kind, on samples the fit never saw."""
    summary = {}
    print(
        f"{'stage':>5} {'task':>4} {'median |error|':>15} {'rank agreement':>15}  seconds = a + "
        "b*tokens + c*attn + d*patches",
        file=file,
    )
    errors_all = []
    for s in range(S):
        for k in range(3):
            rows = [(f, t) for ss, kk, f, t in held_out if ss == s and kk == k]
            pred = [model.seconds(s, k, f) for f, _ in rows]
            meas = [t for _, t in rows]
            errs = [abs(p - m) / m for p, m in zip(pred, meas) if m > 0]
            errors_all += errs
            med, rank = statistics.median(errs), ranking_agreement(pred, meas)
            summary[f"{s}{KINDS[k]}"] = {"median_error": med, "rank_agreement": rank}
            c = model.coef[s][k]
            print(
                f"{s:>5} {KINDS[k]:>4} {med:>14.1%} {rank:>15.2f}  {c[0] * 1e3:.3f} ms + "
                f"{c[1] * 1e6:.3g} us*tok + {c[2] * 1e9:.3g} ns*attn + {c[3] * 1e6:.3g} us*patch",
                file=file,
            )
    summary["median_error"] = statistics.median(errors_all)
    return summary


def split_over_whole(model: CostModel) -> str:
    """Per stage, on the typical microbatch: what F and B + W cost split over their cost unsplit
    (F, and B the whole backward), the price a stage pays for a W that can fill a bubble."""
    feats = model.typical_features() or {}
    assert model.whole is not None
    parts = []
    for s in range(model.num_stages):
        whole = model.run_whole([s])
        f = model.seconds(s, 0, feats) / max(whole.seconds(s, 0, feats), 1e-12)
        bw = (model.seconds(s, 1, feats) + model.seconds(s, 2, feats)) / max(
            whole.seconds(s, 1, feats), 1e-12
        )
        parts.append(f"stage {s} F {f:.2f}x, B + W {bw:.2f}x")
    return (
        'split over unsplit, the typical microbatch (unsplit_stages = "auto" weighs it): '
        + "; ".join(parts)
    )


def as_run_unsplit(cfg: TrainConfig) -> tuple[int, ...]:
    """The stages a calibration of ``cfg`` measures unsplit: the ones it names; none for "auto",
    which chooses from the split costs beside the whole ones."""
    return () if cfg.schedule.unsplit_stages == AUTO_UNSPLIT else cfg.unsplit_stages


def calibrate_command(args) -> int:
    os.environ.setdefault(
        "LOCAL_WORLD_SIZE", "1"
    )  # one process measures every stage, on one GPU at most
    cfg = TrainConfig.load(args.config, [*args.set, f"parallel.pp={args.pp}"], world_size=args.pp)
    S = cfg.num_stages
    out = args.out or f"runs/cost-{model_slug(cfg.run.model)}-pp{S}.json"
    check_output("--out", out)  # before minutes of measuring
    device = calibration_device(cfg.compute)
    where = (
        f"on {device} ({torch.cuda.get_device_name(device)}), where the run computes"
        if device.type == "cuda"
        else f"on this CPU ({torch.get_num_threads()} thread(s))"
    )
    samples = measure(cfg, 2 * args.samples)
    # a split schedule: every stage measured unsplit too, so a run can choose which to split
    whole = measure(cfg, args.samples, whole=True) if cfg.schedule.split_backward else None
    load = load_average()  # over the last minute: the measuring just done
    per_micro = 3 * S
    fit_rows, check_rows = split_held_out(samples, per_micro)
    model = CostModel.fit(fit_rows)
    print(
        f"rrfp calibrate: {cfg.run.model}, {S} stages, {args.samples} microbatches to fit and "
        f"{args.samples} held out; real compute {where}"
    )
    report(model, check_rows, S)
    if whole is not None:
        model = model.with_whole(CostModel.fit(whole))
        print(split_over_whole(model))
    f_meas = [t for _, k, _, t in check_rows if k == 0]
    f_pred = [model.seconds(s, 0, f) for s, k, f, _ in check_rows if k == 0]
    per_mb = [
        sum(t for s, k, f, t in check_rows[i : i + per_micro])
        for i in range(0, len(check_rows), per_micro)
    ]
    per_mb_pred = [
        sum(model.seconds(s, k, f) for s, k, f, _ in check_rows[i : i + per_micro])
        for i in range(0, len(check_rows), per_micro)
    ]
    error = statistics.median(held_out_errors(model, check_rows))
    cores = os.cpu_count() or 1
    load_text = "unknown" if load is None else f"{load:.2f}"
    print(
        f"held-out error (microbatches the fit never saw): median |error| {error:.1%} over all "
        f"tasks; microbatch totals: rank agreement {ranking_agreement(per_mb_pred, per_mb):.2f}; "
        f"load average {load_text} on {cores} cores"
    )
    print(
        f"one emulated unit = {model.reference_s * 1e3:.3f} ms (mean F); F spread over "
        f"microbatches {np.std(f_meas) / np.mean(f_meas):.0%} measured, "
        f"{np.std(f_pred) / np.mean(f_pred):.0%} predicted"
    )
    busy = load_warning(load, cores, torch.get_num_threads() if device.type == "cpu" else 1)
    negative = negative_terms(model, fit_rows)
    if busy:
        print(f"rrfp: warning: {busy}", file=sys.stderr)
    if negative:
        print(
            f"rrfp: warning: {len(negative)} fitted term(s) below zero, the largest {negative[0]}: "
            f"the fit bends to timings its features cannot explain (a busy machine, or features "
            f"that move together); it is written: judge it by the held-out error",
            file=sys.stderr,
        )
    quality = {
        "held_out_median_error": error,
        "load_average": load,
        "cores": cores,
        "busy": busy,
        "negative_terms": negative,
    }
    text = json.dumps({**json.loads(model.to_json()), "quality": quality}, indent=1)
    write_atomic(out, text)
    print(f"wrote {out}: train with --set cost={out} --set unit_ms=...")
    return 0
