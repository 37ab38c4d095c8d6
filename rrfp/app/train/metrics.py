"""What a run reports, per step, into its folder: rank 0's step reports as JSON lines
(``metrics.jsonl``) and TensorBoard scalars, with tokens/s and MFU; ``run.json`` beside them says
what the numbers are against (the config, the FLOPs count, the peak).

A line holds ``step`` (the steps done, as the printed line counts them), ``loss``, ``lr``,
``grad_norm`` (the whole model's, before any clipping: each rank's part rides in the step's
statistics all-reduce, and clipping uses that same norm), ``tokens``, ``tokens_per_s``, ``mfu``
(when the model's FLOPs and the device's peak are known), ``bubble`` (the stage lanes' idle share),
``wall_s``, ``skipped``, ``memory`` (per rank, the peak bytes measured during the step; what they
are in ``memory_measure``: rrfp/observe/peak_memory.py), ``in_flight`` (per rank, the most
microbatches it held at once), any optional field a step report carries, such as ``eval_loss`` on
the steps that evaluate, the router statistics of a mixture of experts (``aux_loss``,
``expert_load_max_over_mean``, ``dropped_tokens``; only when the model has MoE layers), and
``time`` (seconds since the epoch). TensorBoard gets each per-rank
list as its largest value.

``run.json`` holds the config, what the MFU is against, the start-up summary ``rrfp train`` gives
(``summary``: layout, schedule, parameters, data, backend, the memory estimate), and, once the run
ends, the peak memory and microbatches in flight measured on each rank over the run
(``measured``), to read beside the summary's estimate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rrfp.app.train.metrics_files import JsonLines, TensorBoardEvents, run_folder
from rrfp.app.train.metrics_mfu import ModelFlops, Peak, device_peak, model_flops

log = logging.getLogger(__name__)

# StepReport fields that are not a line's: the run's length, and the attention term (in "mfu")
NOT_WRITTEN = ("steps", "attn")
# written only when set: a model without MoE layers has no router statistics
ROUTER_KEYS = ("aux_loss", "expert_load_max_over_mean", "dropped_tokens")


class RunMetrics:
    """Rank 0's metrics files for one run (see the module doc)."""

    def __init__(
        self,
        folder: Path,
        flops: ModelFlops | None,
        peak: Peak | None,
        ranks: int,
        tensorboard: bool = True,
    ) -> None:
        self.folder, self.flops, self.peak, self.ranks = folder, flops, peak, ranks
        self.about: dict[str, Any] = {}  # what run.json holds
        self.lines = JsonLines(folder / "metrics.jsonl")
        self.events = TensorBoardEvents.open(folder) if tensorboard else None

    @classmethod
    def open(cls, cfg, device: torch.device, summary: dict | None = None) -> RunMetrics | None:
        """A new run folder from ``output.dir`` (None when it is ""), ``run.json`` written (with
        ``summary``, the caller's start-up summary, when given)."""
        if not cfg.output.dir:
            return None
        folder = run_folder(cfg.output.dir, cfg.run.model)
        flops = model_flops(cfg.workload, cfg.model, cfg.num_stages)
        peak = device_peak(
            device, cfg.compute.autocast, cfg.compute.threads, cfg.output.peak_tflops
        )
        if peak is None:
            log.warning(
                "MFU left out: no known peak for %s; set output.peak_tflops (per rank)", device
            )
        world = cfg.layout.world_size
        about = {
            "model_flops": None
            if flops is None
            else {
                **dataclasses.asdict(flops),
                "per_token": "6 * params + 12 * layers * width * tokens in the row",
            },
            "peak_tflops_per_rank": None if peak is None else peak.tflops,
            "peak_source": None if peak is None else peak.source,
            "ranks": world,
            **({"summary": summary} if summary is not None else {}),
            "config": cfg.as_toml(),
        }
        metrics = cls(folder, flops, peak, world)
        metrics.write_about(about)
        log.info("metrics: %s; MFU against %s", folder / "metrics.jsonl", peak)
        return metrics

    def write_about(self, about: dict[str, Any]) -> None:
        """``run.json``: ``about``, whole."""
        self.about = about
        text = json.dumps(about, indent=1, default=str) + "\n"
        (self.folder / "run.json").write_text(text)

    @property
    def path(self) -> Path:
        return self.lines.path

    def mfu(self, tokens: float, attn: float, wall_s: float) -> float | None:
        """The step's model FLOPs per second over the peak of every rank."""
        if self.flops is None or self.peak is None or wall_s <= 0:
            return None
        return self.flops.step(tokens, attn) / wall_s / (self.peak.tflops * 1e12 * self.ranks)

    def step(self, report) -> None:
        """Fill in ``report.mfu`` and write the step (a StepReport, or any dataclass like it)."""
        report.mfu = self.mfu(report.tokens, report.attn, report.wall_s)
        record: dict[str, Any] = {
            k: v
            for k, v in dataclasses.asdict(report).items()
            if k not in NOT_WRITTEN and not (k in ROUTER_KEYS and v is None)
        }
        record["step"] = report.step + 1
        record["time"] = time.time()  # when rank 0 wrote it: for plots over wall-clock time
        self.lines.write(record)
        if self.events is not None:
            self.events.write(
                record["step"],
                {
                    f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}": (
                        max(v) if isinstance(v, list) and v else v
                    )
                    for k, v in record.items()
                    if k not in ("step", "time")
                },
            )

    def close(
        self, memory: list[int] | None = None, measure: str = "", in_flight: list[int] | None = None
    ) -> None:
        """Close the files; with ``memory`` (per rank, the run's measured peak bytes, ``measure``
        saying what they are) and ``in_flight``, add them to ``run.json`` as ``measured``."""
        if memory:
            measured = {
                "memory_peak": memory,
                "memory_measure": measure,
                "in_flight_peak": in_flight,
            }
            self.write_about({**self.about, "measured": measured})
        self.lines.close()
        if self.events is not None:
            self.events.close()
