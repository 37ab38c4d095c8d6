"""What a run is, said once at its start: the layout and each pipeline rank's stages, the schedule
and its budget, the microbatches, the parameters per stage, the data the workload found, the
backend, and the memory estimate per rank beside 1F1B's. ``rrfp train`` prints it on rank 0 (so a
user sees their data was picked up before the first step) and writes it into ``run.json``. The
estimate is ``start_checks``' (the one ``--dry-run`` shows and the memory check uses)."""

from __future__ import annotations

from typing import Any

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.train.start_checks import Footprint, _gib, at_1f1b
from rrfp.pipeline.schedule_settings import unsplit_stages_of
from rrfp.pipeline.user_code import calling, function_name


def run_summary(cfg: TrainConfig, prints: list[Footprint] | None) -> dict[str, Any]:
    """The summary as plain values (what ``run.json`` holds under ``summary``). ``prints``: the
    memory check's footprints, None when the model did not build on the meta device."""
    lay, sch, layout = cfg.layout, cfg.schedule, cfg.virtual_layout
    baseline = at_1f1b(cfg, prints) if prints is not None else None
    ranks = []
    for r in range(lay.pp):
        limit = sch.budget.rank_limit(layout, r)
        rank: dict[str, Any] = {
            "pipeline_rank": r,
            "stages": list(layout.stages_of(r)),
            "in_flight_limit": limit.count,  # None: a byte budget
        }
        if prints is not None and baseline is not None:
            fp, one = prints[r], baseline[r]
            rank |= {
                "params": list(fp.stage_params),
                "memory_estimate": fp.total,
                "in_flight_estimate": fp.in_flight,
                "memory_estimate_1f1b": one.total,
                "in_flight_1f1b": one.in_flight,
            }
        ranks.append(rank)
    return {
        "model": cfg.run.model,
        "layout": {
            "pp": lay.pp,
            "virtual": cfg.parallel.virtual,
            "placement": cfg.parallel.placement,
            "tp": lay.tp,
            "dp": lay.dp,
            "dp_shard": cfg.parallel.dp_shard,
            "ep": lay.ep,
            "world_size": lay.world_size,
        },
        "schedule": {
            "hint": sch.hint.name,
            "dispatch": str(sch.dispatch),
            "budget": str(sch.budget),
            "n_microbatches": sch.n_microbatches,  # per replica per step
            "microbatches_per_step": sch.n_microbatches * lay.dp,
            **(
                {"unsplit_stages": sorted(unsplit_stages_of(cfg.unsplit_stages, cfg.num_stages))}
                if cfg.unsplit_stages
                else {}
            ),
            **(
                {"unsplit_choice": cfg.unsplit_choice.describe()}
                if cfg.unsplit_choice is not None
                else {}
            ),
        },
        "data": data_found(cfg),
        "backend": cfg.compute.backend,
        "backend_choice": getattr(
            cfg, "backend_choice", f"compute.backend = {cfg.compute.backend}"
        ),
        "device": cfg.compute.device_type,
        "ranks": ranks,
        "memory_estimate": None
        if prints is None
        else "a lower bound (rrfp/app/train/start_checks.py)",
    }


def data_found(cfg: TrainConfig) -> str:
    """The workload's account of its data (``Workload.describe_data``), or, without one, the size
    of its first step's batches."""
    wl = cfg.workload
    if wl.describe_data is not None:
        with calling(f"describe_data ({function_name(wl.describe_data)})"):  # the user's code
            return wl.describe_data(cfg.data)
    first = wl.microbatches(cfg.data, 0, 1)[0]
    return f"the workload's own batches ({wl.name}.batches; a microbatch: {_shapes(first)})"


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the short block ``rrfp train`` prints before its first step."""
    lay, sch = summary["layout"], summary["schedule"]
    virtual = f", virtual={lay['virtual']} ({lay['placement']})" if lay["virtual"] > 1 else ""
    shard = f", dp_shard={lay['dp_shard']}" if lay["dp_shard"] > 1 else ""
    shard += f" (ep={lay['ep']})" if lay.get("ep", 1) > 1 else ""
    lines = [
        f"run: {summary['model']} on {lay['world_size']} rank(s): pp={lay['pp']}{virtual} x "
        f"tp={lay['tp']} x dp={lay['dp']}{shard}; backend {summary['backend']} "
        f"({summary['backend_choice']}) on {summary['device']}",
        f"schedule: hint {sch['hint']}, dispatch {sch['dispatch']}, budget {sch['budget']}; "
        f"{sch['n_microbatches']} microbatches per replica per step "
        f"({sch['microbatches_per_step']} in all)"
        + (
            f"; stage {', '.join(map(str, sch['unsplit_stages']))} unsplit (B the whole backward)"
            if sch.get("unsplit_stages")
            else ""
        )
        + (
            f'; unsplit_stages "auto": {sch["unsplit_choice"]}' if sch.get("unsplit_choice") else ""
        ),
        f"data: {summary['data']}",
    ]
    for rank in summary["ranks"]:
        stages = ", ".join(map(str, rank["stages"]))
        limit = rank["in_flight_limit"]
        line = f"pipeline rank {rank['pipeline_rank']}: stage {stages}"
        if "params" in rank:
            params = " + ".join(_count(n) for n in rank["params"])
            ours, theirs = _gib(rank["memory_estimate"]), _gib(rank["memory_estimate_1f1b"])
            line += (
                f" ({params} parameters); memory at least {ours} with "
                f"{rank['in_flight_estimate']} in flight (1F1B: {theirs} with "
                f"{rank['in_flight_1f1b']})"
            )
        else:
            line += " (memory not estimated: the model does not build on the meta device)"
        if limit is not None:
            line += f"; budget {limit} in flight"
        lines.append(line)
    return lines


def _shapes(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return "x".join(map(str, shape)) or "scalar"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return type(value).__name__


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
