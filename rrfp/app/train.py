"""stage_main: train the configured workload on this rank's pipeline stage.

A library function: it logs and never prints (``rrfp train`` prints, through
``on_step``). ``asyncio.run(stage_main(cfg))`` leaves no process group behind
when it created one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rrfp.app.checkpoints import Resume, RunCheckpoints, plan_resume
from rrfp.app.config import TrainConfig
from rrfp.core.errors import NonFiniteError
from rrfp.core.placement import stages_label
from rrfp.core.stats import StageStats
from rrfp.observe.instrument import TraceRecorder
from rrfp.observe.trace import chrome_trace, write_json
from rrfp.pipeline.checkpoint import rng_state
from rrfp.pipeline.faults import FaultInjector
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.thread_state import Autocast, ThreadState

log = logging.getLogger("rrfp.app.train")
T = TypeVar("T")


@dataclass
class StepReport:
    step: int
    steps: int
    loss: float
    tokens_per_s: float
    bubble: float
    wall_s: float
    skipped: bool = False  # a NaN/Inf somewhere: no rank stepped (run.on_nonfinite = "skip")
    grad_norm: float | None = (
        None  # with run.clip_grad_norm: the whole model's gradient norm before clipping
    )


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    statistics: StageStats = field(default_factory=StageStats)
    features: list[list[dict]] = field(
        default_factory=list
    )  # with run.sizes: per step, per microbatch
    slowest_s: list[float] = field(
        default_factory=list
    )  # with run.sizes: per step, the slowest rank's iteration
    plan_s: list[float] = field(
        default_factory=list
    )  # hint = plan: planning time per step (in a thread)
    plan_waited_s: list[float] = field(
        default_factory=list
    )  # ... and how long each step waited for its plan
    first_step: int = 0  # the step this run started from: a resumed checkpoint's, or 0
    checkpoint: str | None = (
        None  # the last checkpoint this run saved (or resumed from, after a stop)
    )
    stopped_at: int | None = None  # a stop request ended the run after this many steps
    stop_requests: int = 0  # ... seen on this many ranks when they agreed to stop
    abandoned: bool = False  # ... abandoning step stopped_at + 1 midway, its gradients discarded
    skipped: list[int] = field(
        default_factory=list
    )  # steps (0-based) whose update was skipped: NaN/Inf
    grad_norms: list[float] = field(
        default_factory=list
    )  # with run.clip_grad_norm: each step's, before clipping


async def stage_main(
    cfg: TrainConfig,
    on_step: Callable[[StepReport], None] | None = None,
    stop: Callable[[], bool] | None = None,
    resume: Resume | None = None,
) -> TrainSummary:
    """Run optimizer steps up to ``cfg.run.steps`` on this rank's stage, from the
    checkpoint ``run.resume`` picks (or step 0). Every rank returns the per-step
    mean losses (all-reduced from the last stage) of the steps it ran.

    ``stop()`` (``rrfp train``: a SIGTERM on any rank) ends the run without
    waiting for the current step: polled every ``STOP_POLL_S`` while the step
    computes, it cancels this rank's iteration and gradient sync (the lane's
    emulated time ends too; a real kernel runs on, unwaited for), and the rank
    goes on to the step's all-reduce saying so. There every rank learns that
    the step was abandoned somewhere: none steps its optimizer, and the state
    of the last completed step is saved (when ``run.checkpoint_dir`` is set)
    with the generators of the abandoned step's start, so a resumed run repeats
    it exactly. Every rank must see ``stop()`` turn true (``rrfp train`` relays
    it through the rendezvous store): a rank it did not reach would wait for its
    peers' messages until ``run.timeout_s``. A stop seen only once the step's
    computation is done keeps that step, as before. ``resume``: where to start,
    when the caller has already decided (``plan_resume``)."""
    run, wl = cfg.run, cfg.workload
    if resume is None:  # before any process group: a mismatch fails every rank the same way
        resume = plan_resume(cfg)
    start = resume.start
    torch.set_num_threads(run.threads)
    # a heartbeat (gloo): timeout_s bounds a peer's silence, not how long a step may take
    async with PipelineRuntime.start(
        layout=cfg.layout,
        backend=run.backend,
        timeout_s=run.timeout_s,
        unit_ms=run.unit_ms,
        heartbeat=True,
        virtual=run.virtual,
        placement=run.placement,
    ) as rt:  # nccl: this rank's GPU is rt.device
        modules = [
            m.to(rt.device)
            for m in wl.build_stages(cfg.model, rt.stages, rt.num_stages, run.seed, rt.tp_group)
        ]
        module = (
            modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)
        )  # the rank's parameters
        recorder = (
            TraceRecorder(f"rank {rt.rank}", rt.rank if len(modules) > 1 else None)
            if run.trace
            else None
        )
        ex = rt.stage_executor(
            modules if len(modules) > 1 else module,
            wl.loss_fn,
            microbatches=run.microbatches,
            dispatch=run.dispatch,
            hint=run.hint,
            budget=run.budget,
            split=run.split,
            variability=run.variability,
            seed=run.seed,
            instrument=recorder,
            cost=run.cost,
            tied=[wl.tied(cfg.model, s, rt.num_stages) for s in rt.stages] if wl.tied else None,
            on_nonfinite=None,
        )  # the step statistics' all-reduce agrees (_nonfinite)
        sync = rt.grad_sync(module, ex)
        fault_stage = (
            run.fault.stage if run.fault is not None and run.fault.stage in rt.stages else rt.stage
        )
        injector = FaultInjector.for_rank(
            run.fault, rt.rank, fault_stage
        )  # testing aid, normally None
        if injector is not None:
            ex.on_task_done.append(injector.task_done)
            ex.task_hold_s.append(injector.hold_s)
        # one optimizer per stage: the same update as one over all (AdamW is per parameter), and each
        # stage's state goes to its own checkpoint key
        opts = [
            torch.optim.AdamW(m.parameters(), lr=run.lr, weight_decay=run.weight_decay)
            for m in modules
        ]
        summary = TrainSummary()
        world = rt.layout.world_size
        ckpts = RunCheckpoints(cfg, rt, modules, opts) if run.checkpoint_dir else None
        if ckpts is not None:
            await ckpts.begin(resume)
        if ckpts is not None and injector is not None:
            ckpts.on_write.append(injector.checkpoint_write)
        saved_at = None  # the step of the checkpoint this run last saved or resumed from
        if start is not None:
            await ckpts.load(start)
            summary.first_step = start.step
            summary.checkpoint, saved_at = str(start.path), start.step

        def my_batches(step: int):
            # DP replica d trains on its own M microbatches of a global batch of dp * M
            data = wl.batches(cfg.data, step, run.microbatches * run.dp)
            mine = data[rt.dp_rank * run.microbatches : (rt.dp_rank + 1) * run.microbatches]
            return mine, [wl.features(b) for b in mine]

        # run.autocast: every task of every iteration under it, on this rank's device type (None: the caller's own)
        amp = (
            ThreadState((Autocast(rt.device.type, getattr(torch, run.autocast), True),))
            if run.autocast != "off"
            else None
        )
        upcoming = my_batches(summary.first_step)
        ex.prepare(
            summary.first_step, upcoming[1]
        )  # hint = plan: planned in a thread, one iteration ahead
        for step in range(summary.first_step, run.steps):
            mine, feats = upcoming
            if step + 1 < run.steps:
                upcoming = my_batches(step + 1)
                ex.prepare(step + 1, upcoming[1])  # planned while this step runs
            if rt.device.type != "cpu":
                mine = [
                    (x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                    for x, y in mine
                ]
            if injector is not None:
                injector.begin_step(step)
            # what a stop that abandons this step saves (only a run that can stop and save needs it)
            at_start = rng_state(rt.device) if ckpts is not None and stop is not None else None

            async def compute(step=step, mine=mine, feats=feats):
                res = await ex.run_iteration(step, mine, feats, thread_state=amp)
                if injector is not None:
                    injector.iteration_done(module)
                await sync.sync()
                return res

            res = await _unless_stopped(stop, compute())
            if res is None:
                ex.lane.abandon()
                log.info(
                    "rank %d: step %d abandoned midway: a stop was requested", rt.rank, step + 1
                )
            # the statistics all-reduce also counts the ranks that saw a NaN/Inf or abandoned the
            # step, so every rank steps, skips or stops alike. It is on the control-plane group, which
            # the abandoned iteration never used: its pending P2P transfers and DP all-reduces are on
            # their own groups (docs/design.md, "A stop that does not wait for the step")
            bad = res is not None and not _finite(module, res.loss)
            vec = torch.tensor(
                [
                    0.0,
                    0.0,
                    0.0,
                    0.0,
                    float(bad),
                    float(stop is not None and stop()),
                    float(res is None),
                ],
                dtype=torch.float64,
            )
            if res is not None:
                vec[:4] = torch.tensor(
                    [
                        res.loss or 0.0,
                        res.stats.busy,
                        res.stats.wall,
                        float(res.tokens if 0 in rt.stages else 0),
                    ],
                    dtype=torch.float64,
                )
            await rt.all_reduce(
                vec, what=f"step {step + 1}: world all-reduce of the step statistics"
            )
            loss, busy, wall, tokens, nonfinite, stops, abandoned = vec.tolist()
            if abandoned:  # no rank steps: the state is still that of `step` completed steps
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
                summary.stopped_at, summary.stop_requests, summary.abandoned = (
                    step,
                    int(stops),
                    True,
                )
                # before any completed step there is nothing to keep: a fresh run is exact, while a save
                # would hold the optimizer state that DCP's state dict makes up for a fresh AdamW (step 1)
                if ckpts is not None and saved_at != step and step > 0:
                    summary.checkpoint = str((await ckpts.save(step, rng=at_start)).path)
                rt.abandoned = True
                break
            grad_norm = None
            if nonfinite:
                await _nonfinite(rt, run.on_nonfinite, step, bad)
                summary.skipped.append(step)
                grad_norm = math.nan if run.clip_grad_norm else None
            else:
                if (
                    run.clip_grad_norm
                ):  # every rank is here together: none abandoned the step or saw a NaN
                    grad_norm = await rt.clip_grad_norm_(run.clip_grad_norm)
                for opt in opts:
                    for group in opt.param_groups:
                        group["lr"] = learning_rate(run.lr, run.warmup_steps, step)
                    opt.step()
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            loss /= (
                run.tp * run.dp
            )  # every TP rank of the last stage of every replica adds its loss
            tokens /= run.tp
            report = StepReport(
                step,
                run.steps,
                loss,
                tokens / (wall / world),
                StageStats(busy, wall).bubble,
                wall / world,
                skipped=bool(nonfinite),
                grad_norm=grad_norm,
            )
            summary.losses.append(loss)
            summary.wall_s.append(report.wall_s)
            if grad_norm is not None:
                summary.grad_norms.append(grad_norm)
            if res.plan is not None:
                summary.plan_s.append(res.plan.plan.seconds)
                summary.plan_waited_s.append(res.plan.waited_s)
            if (
                run.sizes
            ):  # the iteration ends when its slowest stage does: that is what a replay simulates
                longest = torch.tensor([res.stats.wall], dtype=torch.float64)
                await rt.all_reduce(
                    longest, dist.ReduceOp.MAX, what=f"step {step + 1}: world max of iteration time"
                )
                summary.features.append(feats)
                summary.slowest_s.append(longest.item())
            if (
                on_step is not None
                and rt.rank == 0
                and (step % run.log_every == 0 or step == run.steps - 1)
            ):
                on_step(report)
            stopping = (
                stops > 0 and step + 1 < run.steps
            )  # a stop during the last step: the run is complete
            if ckpts is not None and ckpts.due(step + 1, stopping):
                summary.checkpoint = str((await ckpts.save(step + 1)).path)
                saved_at = step + 1
            if stopping:
                summary.stopped_at, summary.stop_requests = step + 1, int(stops)
                log.info(
                    "rank %d: stopping after step %d: a stop was requested on %d rank(s)",
                    rt.rank,
                    step + 1,
                    int(stops),
                )
                break
        summary.statistics = ex.statistics()
        if run.sizes and rt.rank == 0:
            virtual = (
                {"virtual": run.virtual, "placement": run.placement} if run.virtual > 1 else {}
            )
            write_json(
                run.sizes,
                {
                    "pp": rt.layout.pp,
                    **virtual,
                    "microbatches": run.microbatches,
                    "seed": run.seed,
                    "preset": run.preset,
                    "hint": run.hint.name,
                    "dispatch": str(run.dispatch),
                    "budget": str(run.budget),
                    "split": ex.settings.split,
                    "unit_ms": run.unit_ms,
                    "features": summary.features,
                    "step_wall_s": summary.slowest_s,
                },
            )
            log.info("wrote microbatch sizes %s", run.sizes)
        if recorder is not None:
            gathered = await rt.gather_object(recorder.spans)
            if rt.rank == 0:
                write_json(run.trace, chrome_trace([sp for spans in gathered for sp in spans]))
                log.info("wrote trace %s", run.trace)
    return summary


def learning_rate(lr: float, warmup_steps: int, step: int) -> float:
    """The learning rate of (0-based) ``step``: rising linearly from 0 over ``warmup_steps`` steps, then
    ``lr``. A function of the step alone, so a resumed run continues the schedule exactly."""
    return lr if step >= warmup_steps else lr * step / warmup_steps


STOP_POLL_S = (
    0.05  # how often a step in progress looks at stop(): a loop wake-up, microseconds of work
)


async def _unless_stopped(
    stop: Callable[[], bool] | None, work: Coroutine[Any, Any, T]
) -> T | None:
    """``work``'s result, or None once ``stop()`` turned true before it finished (it is then
    cancelled, and this returns when its cancellation has run: nothing of it is awaited after)."""
    task = asyncio.ensure_future(work)
    try:
        while stop is not None and not task.done():
            if stop():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
            await asyncio.wait([task], timeout=STOP_POLL_S)
        return await task
    finally:
        task.cancel()  # when this itself is cancelled: no orphan left running


def _finite(module: torch.nn.Module, loss: float | None) -> bool:
    """No NaN or Inf in this rank's loss (last stage) or in its gradients."""
    if loss is not None and not math.isfinite(loss):
        return False
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return not grads or bool(torch.nn.utils.get_total_norm(grads).isfinite())


async def _nonfinite(rt: PipelineRuntime, policy: str, step: int, bad: bool) -> None:
    """Every rank gets here together. Name the first rank that saw it; skip the update, or stop."""
    first = torch.tensor([float(rt.rank if bad else rt.layout.world_size)], dtype=torch.float64)
    await rt.all_reduce(
        first, dist.ReduceOp.MIN, what=f"step {step + 1}: world min of the non-finite ranks"
    )
    where = int(first.item())
    stage = stages_label(rt.virtual.stages_of(rt.layout.coords(where).pp))
    what = (
        f"step {step + 1}: NaN or Inf in the loss or the gradients (first on rank {where}, {stage})"
    )
    if policy == "stop":
        raise NonFiniteError(
            f"rank {rt.rank}: {what}; every rank ends here, no update was made "
            f'(run.on_nonfinite = stop; "skip" skips such steps)'
        )
    log.warning("rank %d: %s: skipped the optimizer step on every rank", rt.rank, what)
