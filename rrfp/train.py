"""stage_main: train a model on this rank's pipeline stage, and `rrfp train`."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from models.data import batches as make_batches
from models.gpt import GPT, loss_fn, make_stage

from .comm.channels import named_collective
from .config import ConfigError, TrainConfig
from .errors import PipelineError
from .instrument import TraceRecorder
from .runtime import PipelineRuntime, leave_process_group
from .trace import chrome_trace, write_json
from .variability import Variability

log = logging.getLogger("rrfp.train")


@dataclass
class StepReport:
    step: int
    steps: int
    loss: float
    tokens_per_s: float
    bubble: float
    wall_s: float


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    statistics: dict = field(default_factory=dict)


async def stage_main(cfg: TrainConfig, on_step: Callable[[StepReport], None] | None = None) -> TrainSummary:
    """Run ``cfg.run.steps`` optimizer steps on this rank's stage. Every rank
    returns the per-step mean losses (all-reduced from the last stage)."""
    run = cfg.run
    torch.set_num_threads(run.threads)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_model(cfg, PipelineRuntime.plan_layout(world, run.pp, run.tp, run.dp).pp)  # before any group exists
    rt = PipelineRuntime.start(pp=run.pp, tp=run.tp, dp=run.dp, backend=run.backend,
                               timeout_s=run.timeout_s, unit_ms=run.unit_ms)
    try:
        torch.manual_seed(run.seed)
        module = make_stage(GPT(cfg.model), rt.stage, rt.num_stages, tp_group=rt.tp_group)
        sync = rt.grad_sync(module)
        recorder = TraceRecorder(f"rank {rt.rank}") if run.trace else None
        ex = rt.executor(module, loss_fn, microbatches=run.microbatches, executor=run.executor, hint=run.hint,
                         budget=run.budget, split=run.split, variability=Variability.preset(run.preset),
                         seed=run.seed, instrument=recorder)
        opt = torch.optim.AdamW(module.parameters(), lr=run.lr, weight_decay=run.weight_decay)
        summary = TrainSummary()
        for step in range(run.steps):
            # DP replica d trains on its own M microbatches of a global batch of dp * M
            data = make_batches(cfg.data, step, run.microbatches * run.dp)
            res = await ex.run_iteration(step, data[rt.dp_rank * run.microbatches:(rt.dp_rank + 1) * run.microbatches])
            await sync.sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            vec = torch.tensor([res.loss or 0.0, res.busy_s, res.wall_s, float(res.tokens if rt.stage == 0 else 0)],
                               dtype=torch.float64)
            with named_collective(f"step {step + 1}: world all-reduce of the step statistics "
                                  f"(ranks 0-{rt.layout.world_size - 1})"):
                await rt.all_reduce(vec)
            world = rt.layout.world_size
            loss, busy, wall, tokens = vec.tolist()
            loss /= run.tp * run.dp  # every TP rank of the last stage of every replica adds its loss
            tokens /= run.tp
            report = StepReport(step, run.steps, loss, tokens / (wall / world), 1 - busy / wall, wall / world)
            summary.losses.append(loss)
            summary.wall_s.append(report.wall_s)
            if on_step is not None and rt.rank == 0 and (step % run.log_every == 0 or step == run.steps - 1):
                on_step(report)
        summary.statistics = ex.statistics()
        if recorder is not None:
            gathered = await rt.gather_object(recorder.spans)
            if rt.rank == 0:
                write_json(run.trace, chrome_trace([sp for spans in gathered for sp in spans]))
                log.info("wrote trace %s", run.trace)
        return summary
    finally:
        await rt.aclose()


def check_model(cfg: TrainConfig, num_stages: int) -> None:
    """Model checks that need no process group, so bad input can fail before one exists."""
    if cfg.model.n_layer < num_stages:
        raise ConfigError(f"model.n_layer={cfg.model.n_layer} is fewer than the {num_stages} pipeline stages")
    if cfg.run.tp > 1:
        from models.gpt import validate_tp

        try:
            validate_tp(cfg.model, cfg.run.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _print_step(r: StepReport) -> None:
    eta = (r.steps - r.step - 1) * r.wall_s
    print(f"step {r.step + 1:>4}/{r.steps}  loss {r.loss:.4f}  {r.tokens_per_s:,.0f} tok/s  "
          f"bubble {r.bubble:5.1%}  {r.wall_s * 1000:.0f} ms/step  eta {eta:.0f}s", flush=True)


def train_command(args) -> int:
    """`rrfp train`: run stage_main on this rank; print on rank 0; one line on error."""
    from .cli import UsageError
    from .loop import run as run_loop

    logging.basicConfig(level=os.environ.get("RRFP_LOG", "WARNING"), format="%(name)s: %(message)s")
    try:
        cfg = TrainConfig.load(args.config, args.set)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if args.dry_run or "WORLD_SIZE" in os.environ:
        # Layout and model checks need no process group: bad input exits 2 before any rank joins one
        world = int(os.environ.get("WORLD_SIZE", "1"))
        try:
            layout = PipelineRuntime.plan_layout(world, cfg.run.pp, cfg.run.tp, cfg.run.dp)
            check_model(cfg, layout.pp)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(layout.describe())
            print(cfg.as_dict())
        return 0
    rank = int(os.environ.get("RANK", "0"))
    try:
        summary = run_loop(stage_main(cfg, _print_step))
    except Exception as e:
        # TaskGroup wraps a stage's error in an ExceptionGroup: judge (and print) its first leaf
        if not isinstance(_root(e), (PipelineError, ConfigError, ConnectionError, RuntimeError, ValueError,
                                     NotImplementedError)):
            raise  # a bug, not a failure of the run: keep its traceback
        line = " ".join(_root_message(e).split())  # one line, whatever the cause's text
        if line.split(":")[0].split()[:2] != ["rank", str(rank)]:  # most causes name their rank already
            line = f"rank {rank}: {line}"
        print(f"rrfp: error: {line}", file=sys.stderr, flush=True)
        # A peer may be dead and gloo threads blocked in it: leave at once, not through teardown.
        os._exit(1)
    if rank == 0:
        print(f"done: {len(summary.losses)} steps, loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}, "
              f"decision cost {summary.statistics.get('decision_us', 0):.1f} us", flush=True)
    leave_process_group()
    return 0


def _root(e: BaseException) -> BaseException:
    """The first leaf of an exception group: TaskGroup wraps the real cause."""
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def _root_message(e: BaseException) -> str:
    e = _root(e)
    return f"{type(e).__name__}: {e}" if not isinstance(e, (PipelineError, ConfigError)) else str(e)
