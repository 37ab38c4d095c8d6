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
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.faults import FaultInjector
from rrfp.app.job.failure import SECONDARY, Failure
from rrfp.app.job.failure_board import post_before_teardown
from rrfp.app.train.checkpoint_state import rng_state
from rrfp.app.train.checkpoints import Resume, RunCheckpoints, choose_resume
from rrfp.app.train.evaluation import due as eval_due
from rrfp.app.train.evaluation import evaluate
from rrfp.app.train.lr_schedule import learning_rate as scheduled_lr
from rrfp.app.train.lr_schedule import optim_learning_rate
from rrfp.app.train.metrics import RunMetrics
from rrfp.app.train.optimizers import agree_on_ties, build_optimizer, no_decay_names
from rrfp.app.train.router_statistics import RouterStatistics
from rrfp.app.train.routing_record import RoutingRecord, write_routing
from rrfp.app.train.step_statistics import StepStatistics
from rrfp.comm.grad_norm import local
from rrfp.core.errors import NonFiniteError
from rrfp.core.placement import VirtualLayout, stages_label
from rrfp.core.stats import StageStats
from rrfp.nn.activation_checkpointing import checkpoint_blocks
from rrfp.nn.expert_parallel import expert_parameters
from rrfp.observe.instrument import TraceRecorder
from rrfp.observe.peak_memory import PeakMemory
from rrfp.observe.trace import chrome_trace, write_json
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.sharded_stages import shard_stage
from rrfp.pipeline.thread_state import Autocast, ThreadState

log = logging.getLogger("rrfp.app.train.training")
T = TypeVar("T")


@dataclass
class StepReport:
    step: int
    steps: int
    loss: float
    tokens_per_s: float
    bubble: float
    wall_s: float
    skipped: bool = False  # a NaN/Inf somewhere: no rank stepped (optim.on_nonfinite = "skip")
    grad_norm: float | None = None  # the whole model's gradient norm (before any clipping)
    lr: float | None = None  # the learning rate the step's update used
    tokens: float = 0.0  # the step's tokens, every replica's
    attn: float = 0.0  # ... and their rows' attention term (token_features' "attn"), for MFU
    mfu: float | None = None  # model FLOPs utilisation, when the metrics know the FLOPs and peak
    eval_loss: float | None = None  # with [eval]: the held-out loss after this step, when due
    memory: list[int] | None = None  # per rank: the peak bytes measured in this step
    memory_measure: str | None = None  # ... what they are (rrfp/observe/peak_memory.py)
    in_flight: list[int] | None = None  # per rank: the most microbatches it held at once
    # with MoE layers (rrfp/app/train/router_statistics.py): the weighted auxiliary loss, summed
    # over layers (the loss trained is loss + aux_loss), the worst layer's most loaded expert over
    # the mean load, and the token copies routed but not computed (0: the layers are dropless)
    aux_loss: float | None = None
    expert_load_max_over_mean: float | None = None
    dropped_tokens: float | None = None


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    statistics: StageStats = field(default_factory=StageStats)
    features: list[list[dict]] = field(
        default_factory=list
    )  # with output.sizes: per step, per microbatch
    slowest_s: list[float] = field(
        default_factory=list
    )  # with output.sizes: per step, the slowest rank's iteration
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
    grad_norms: list[float] = field(default_factory=list)  # each step's, before any clipping
    metrics: str | None = None  # rank 0: the metrics.jsonl this run wrote (output.dir)
    memory_peak: list[int] = field(default_factory=list)  # per rank: the run's measured peak
    in_flight_peak: list[int] = field(default_factory=list)  # ... and most microbatches held
    eval_losses: dict[int, float] = field(
        default_factory=dict
    )  # with [eval]: steps done (1-based) -> the held-out loss after them
    aux_losses: list[float] = field(default_factory=list)  # with MoE layers: each step's


async def stage_main(
    cfg: TrainConfig,
    on_step: Callable[[StepReport], None] | None = None,
    stop: Callable[[], bool] | None = None,
    resume: Resume | None = None,
    about: dict | None = None,
) -> TrainSummary:
    """Run optimizer steps up to ``cfg.run.steps`` on this rank's stage, from the
    checkpoint ``checkpoint.resume`` picks (or step 0). Every rank returns the per-step
    mean losses (all-reduced from the last stage) of the steps it ran.

    ``stop()`` (``rrfp train``: a SIGTERM on any rank) ends the run without
    waiting for the current step: polled every ``STOP_POLL_S`` while the step
    computes, it cancels this rank's iteration and gradient sync (the lane's
    emulated time ends too; a real kernel runs on, unwaited for), and the rank
    goes on to the step's all-reduce saying so. There every rank learns that
    the step was abandoned somewhere: none steps its optimizer, and the state
    of the last completed step is saved (when ``checkpoint.dir`` is set)
    with the generators of the abandoned step's start, so a resumed run repeats
    it exactly. Every rank must see ``stop()`` turn true (``rrfp train`` relays
    it through the rendezvous store): a rank it did not reach would wait for its
    peers' messages until ``timeouts.peer_wait_s``. A stop seen only once the step's
    computation is done keeps that step. ``resume``: where to start,
    when the caller has already decided (``choose_resume``). ``about``: what rank 0 adds to the
    run folder's ``run.json`` (``rrfp train``: its start-up summary)."""
    if resume is None:  # before any process group: a mismatch fails every rank the same way
        resume = choose_resume(cfg)
    torch.set_num_threads(cfg.compute.threads)
    _startup_fault(cfg)  # testing aid (debug.fault during=startup), normally nothing
    # a heartbeat (gloo): timeouts.heartbeat_s bounds a peer's silence, not how long a step takes
    async with PipelineRuntime.start(
        layout=cfg.layout,
        backend=cfg.compute.backend,
        timeout_s=cfg.run.timeout_s,
        timeouts=cfg.waits,
        unit_ms=cfg.emulation.unit_ms,
        heartbeat=True,
        virtual=cfg.parallel.virtual,
        placement=cfg.parallel.placement,
    ) as rt:  # nccl: this rank's GPU is rt.device
        try:
            training = _RankTraining(cfg, rt, stop, about)
            try:
                await training.begin(resume)
                await training.run_steps(on_step)
                await training.write_outputs()
            finally:  # rank 0: the folder is free for the next job, however this one ended
                if training.ckpts is not None:
                    training.ckpts.release()
        except Exception as e:
            failure = Failure.of(e)
            if failure.kind != SECONDARY:  # this rank's own: before its groups' closing tells
                post_before_teardown(rt.rank, failure.note)
            raise
        if training.injector is not None and not rt.abandoned:
            training.injector.phase("barrier")  # leaving the block waits for every rank
    return training.summary


def _startup_fault(cfg: TrainConfig) -> None:
    """debug.fault during=startup fires here, before this rank joins the rendezvous."""
    fault = cfg.debug.fault
    if fault is None or fault.during != "startup":
        return
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    par, lay = cfg.parallel, cfg.layout
    stages = VirtualLayout(lay.pp, par.virtual, par.placement).stages_of(lay.coords(rank).pp)
    stage = fault.stage if fault.stage in stages else stages[0]
    injector = FaultInjector.for_rank(fault, rank, stage)
    if injector is not None:
        injector.phase("startup")


class _RankTraining:
    """One rank's training, step by step: its stages' modules and optimizers, its executor and
    gradient sync, its checkpoints; the steps of ``stage_main``, each a method."""

    def __init__(
        self,
        cfg: TrainConfig,
        rt: PipelineRuntime,
        stop: Callable[[], bool] | None,
        about: dict | None = None,
    ):
        self.cfg, self.rt, self.stop, self.wl = cfg, rt, stop, cfg.workload
        self.modules = [
            m.to(rt.device)
            for m in self.wl.build_stages(
                cfg.model, rt.stages, rt.num_stages, cfg.run.seed, rt.tp_group
            )
        ]
        if cfg.compute.activation_checkpointing == "layers":
            for m in self.modules:
                checkpoint_blocks(self.wl.blocks(m))
        if cfg.parallel.ep > 1:  # the MoE layers' experts sharded over the EP group
            for m in self.modules:
                try:
                    rt.shard_experts(m)
                except ValueError as e:  # the experts do not split over the group
                    raise ConfigError(f"parallel.ep = {cfg.parallel.ep}: {e}") from None
            if not any(expert_parameters(m) for m in self.modules):
                raise ConfigError(
                    f"parallel.ep = {cfg.parallel.ep}, but model {cfg.run.model!r} has no "
                    "mixture-of-experts layer rrfp can shard (rrfp's MoELayer: a llama with "
                    "model.moe_experts > 0; an HF family's experts stay local)"
                )
        if cfg.parallel.dp_shard > 1:  # each stage FSDP-sharded over its replicas
            self.modules = [shard_stage(m, rt.dp_group, rt.device.type) for m in self.modules]
        self.routing = RouterStatistics(self.modules)  # their MoE layers, if any
        # output.routing: one TP rank of each group keeps rows (its peers route the same tokens)
        keep = cfg.output.routing != "" and rt.tp_rank == 0
        self.routing_record = RoutingRecord(
            self.modules, rt.stages, rt.dp_rank, cfg.parallel.ep, keep
        )
        # the rank's parameters, as one module
        self.module = (
            self.modules[0] if len(self.modules) == 1 else torch.nn.ModuleList(self.modules)
        )
        self.recorder = (
            TraceRecorder(f"rank {rt.rank}", rt.rank if len(self.modules) > 1 else None)
            if cfg.output.trace
            else None
        )
        self.ex = self._executor()
        # FSDP-sharded stages reduce-scatter their gradients in the executor's iteration
        self.sync = None if cfg.parallel.dp_shard > 1 else rt.grad_sync(self.module, self.ex)
        self.injector = self._fault_injector()  # testing aid, normally None
        self.opts: list[torch.optim.Optimizer] = []  # built in begin(): ties are agreed on first
        self.summary = TrainSummary()
        self.ckpts: RunCheckpoints | None = None
        self.saved_at: int | None = None  # the step of the checkpoint last saved or resumed from
        self.metrics = RunMetrics.open(cfg, rt.device, about) if rt.rank == 0 else None
        self.peak = PeakMemory(rt.device)
        if self.metrics is not None:
            self.summary.metrics = str(self.metrics.path)
        # compute.autocast: every task under it, on this rank's device type (None: the caller's)
        autocast = cfg.compute.autocast
        self.amp = (
            ThreadState((Autocast(rt.device.type, getattr(torch, autocast), True),))
            if autocast != "off"
            else None
        )

    def _executor(self):
        cfg, rt = self.cfg, self.rt
        return rt.stage_executor(
            self.modules if len(self.modules) > 1 else self.module,
            self.wl.loss_fn,
            cfg.schedule_settings(),
            instrument=self.recorder,
            tied=(
                [self.wl.tied(cfg.model, s, rt.num_stages) for s in rt.stages]
                if self.wl.tied
                else None
            ),
            on_nonfinite=None,
        )  # the step statistics' all-reduce agrees (_nonfinite)

    def _fault_injector(self) -> FaultInjector | None:
        fault, rt = self.cfg.debug.fault, self.rt
        stage = fault.stage if fault is not None and fault.stage in rt.stages else rt.stage
        injector = FaultInjector.for_rank(fault, rt.rank, stage)
        if injector is not None:
            self.ex.on_task_done.append(injector.task_done)
            self.ex.task_hold_s.append(injector.hold_s)
            self.ex.task_begins.append(injector.task_begins)
        return injector

    async def _build_optimizers(self) -> None:
        """One optimizer per stage: the same update as one over all (AdamW and SGD are per
        parameter), and each stage's state goes to its own checkpoint key. Its weight-decay groups
        agree across the stages that hold a tie (rrfp/app/train/optimizers.py)."""
        cfg, rt = self.cfg, self.rt
        no_decay = [no_decay_names(m) for m in self.modules]
        await agree_on_ties(rt, self.wl, cfg.model, rt.stages, no_decay)
        self.opts = [
            build_optimizer(cfg.optim, m, skip)
            for m, skip in zip(self.modules, no_decay, strict=True)
        ]
        if cfg.checkpoint.dir:
            self.ckpts = RunCheckpoints(cfg, rt, self.modules, self.opts)

    async def begin(self, resume: Resume) -> None:
        """Build the optimizers, agree on the checkpoint to start from, and load it."""
        await self._build_optimizers()
        if self.ckpts is not None:
            await self.ckpts.begin(resume)
            if self.injector is not None:
                self.ckpts.on_write.append(self.injector.checkpoint_write)
        start = resume.start
        if start is not None:
            await self.ckpts.load(start)
            self.summary.first_step = start.step
            self.summary.checkpoint, self.saved_at = str(start.path), start.step

    def batches(self, step: int):
        """This replica's microbatches of ``step`` and their features."""
        m = self.cfg.schedule.n_microbatches
        # DP replica d trains on its own M microbatches of a global batch of dp * M
        data = self.wl.microbatches(self.cfg.data, step, m * self.cfg.layout.dp)
        mine = data[self.rt.dp_rank * m : (self.rt.dp_rank + 1) * m]
        return mine, [self.wl.features(b) for b in mine]

    async def run_steps(self, on_step: Callable[[StepReport], None] | None) -> None:
        steps, first = self.cfg.run.steps, self.summary.first_step
        upcoming = self.batches(first)
        self.peak.take()  # each step's window starts at the previous step's statistics
        self.ex.prepare(first, upcoming[1])  # hint = plan: planned in a thread, one step ahead
        for step in range(first, steps):
            mine, feats = upcoming
            if step + 1 < steps:
                upcoming = self.batches(step + 1)
                self.ex.prepare(step + 1, upcoming[1])  # planned while this step runs
            if not await self.run_step(step, mine, feats, on_step):
                break
        self.summary.statistics = self.ex.statistics()

    async def run_step(self, step: int, mine, feats, on_step) -> bool:
        """One step: compute, agree, then step, skip or stop. False when the run ends here."""
        rt = self.rt
        if rt.device.type != "cpu":
            mine = [
                (x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                for x, y in mine
            ]
        if self.injector is not None:
            self.injector.begin_step(step)
        # what a stop that abandons this step saves (only a run that can stop and save needs it)
        at_start = (
            rng_state(rt.device) if self.ckpts is not None and self.stop is not None else None
        )
        res = await _unless_stopped(self.stop, self._compute(step, mine, feats))
        if res is None:
            self.ex.lane.abandon()
            log.info("rank %d: step %d abandoned midway: a stop was requested", rt.rank, step + 1)
        bad = res is not None and not _finite(self.module, res.loss)
        stats = await self._agree(step, res, bad, feats)
        if stats.abandoned:
            await self._abandon(step, stats, at_start)
            return False
        grad_norm = await self._update(step, stats, bad)
        report = self._record(step, stats, res, grad_norm)
        if eval_due(self.cfg.eval.every, step, self.cfg.run.steps):
            report.eval_loss = await self._evaluate(step)
        if self.metrics is not None:
            self.metrics.step(report)
        if self.cfg.output.sizes:
            await self._record_sizes(step, res, feats)
        if self.routing:
            self.routing_record.add(step, res.ran, self.routing.own_steps())
        if on_step is not None and rt.rank == 0 and self._logs(step):
            on_step(report)
        return await self._after_step(step, stats)

    async def _compute(self, step: int, mine, feats):
        res = await self.ex.run_iteration(step, mine, feats, thread_state=self.amp)
        if self.injector is not None:
            self.injector.iteration_done(self.module)
            self.injector.phase("sync", step + 1)
        if self.sync is not None:
            await self.sync.sync()
        return res

    async def _agree(self, step: int, res, bad: bool, feats) -> StepStatistics:
        """The statistics all-reduce, which also counts the ranks that saw a NaN/Inf or abandoned
        the step, so every rank steps, skips or stops alike. It is on the control-plane group,
        which the abandoned iteration never used: its pending P2P transfers and DP all-reduces
        are on their own groups (docs/design.md, "A stop that does not wait for the step")."""
        rt = self.rt
        mine = StepStatistics.of_rank(
            rt.rank,
            rt.layout.world_size,
            memory=float(self.peak.take()),
            in_flight=float(res.stats.peak_inflight if res is not None else 0),
            nonfinite=float(bad),
            stops=float(self.stop is not None and self.stop()),
            abandoned=float(res is None),
        )
        if self.routing:
            routing = self.routing.take()
            mine.moe_layers, mine.aux_loss = len(self.routing.layers), routing.aux_loss
            mine.dropped, mine.expert_load[rt.rank] = routing.dropped, routing.load_max_over_mean
        if res is not None:
            mine.loss, mine.busy, mine.wall = res.loss or 0.0, res.stats.busy, res.stats.wall
            # the gradients are final (synced over DP in the iteration): the norm rides along
            mine.grad_sq = rt.grad_norm_share()
            first = 0 in self.rt.stages
            mine.tokens = float(res.tokens if first else 0)
            mine.attn = sum(f.get("attn", 0.0) for f in feats) if first else 0.0
        vec = mine.to_tensor()
        await rt.all_reduce(vec, what=f"step {step + 1}: world all-reduce of the step statistics")
        return StepStatistics.from_tensor(vec, rt.layout.world_size)

    async def _abandon(self, step: int, stats: StepStatistics, at_start) -> None:
        """No rank steps: the state is still that of ``step`` completed steps."""
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        s = self.summary
        s.stopped_at, s.stop_requests, s.abandoned = step, int(stats.stops), True
        # before any completed step there is nothing to keep: a fresh run is exact, while a save
        # would hold the optimizer state that DCP's state dict makes up for a fresh AdamW (step 1)
        if self.ckpts is not None and self.saved_at != step and step > 0:
            s.checkpoint = str((await self.ckpts.save(step, rng=at_start)).path)
        self.rt.abandoned = True

    async def _update(self, step: int, stats: StepStatistics, bad: bool) -> float:
        """Step every optimizer, or skip the step on a NaN/Inf; the whole model's gradient norm,
        summed in the step statistics, clipped by when ``optim.clip_grad_norm`` is set."""
        optim = self.cfg.optim
        grad_norm = math.sqrt(stats.grad_sq)
        if stats.nonfinite:
            await _nonfinite(self.rt, optim.on_nonfinite, step, bad)
            self.summary.skipped.append(step)
            grad_norm = math.nan  # a NaN somewhere: no norm to speak of
        else:
            if optim.clip_grad_norm and math.isfinite(grad_norm):
                self.rt.clip_grads_with_norm_(optim.clip_grad_norm, grad_norm)
            lr = self.lr(step)
            for opt in self.opts:
                for group in opt.param_groups:
                    group["lr"] = lr
                opt.step()
            if self.routing:
                await self.routing.update_biases(
                    self.rt.poller,
                    self.rt.dp_group,
                    f"step {step + 1}: DP all-reduce of the experts' load",
                )
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        return grad_norm

    def lr(self, step: int) -> float:
        """The learning rate of (0-based) ``step``'s update: the [optim] schedule's."""
        return optim_learning_rate(self.cfg.optim, self.cfg.run.steps, step)

    async def _evaluate(self, step: int) -> float:
        """The held-out loss after ``step``, on every rank (rank 0 logs it)."""
        cfg = self.cfg
        loss = await evaluate(
            self.rt,
            self.ex,
            self.modules,
            self.wl,
            cfg.data,
            cfg.eval,
            cfg.schedule.n_microbatches,
            step,
            thread_state=self.amp,
        )
        self.summary.eval_losses[step + 1] = loss
        if self.rt.rank == 0:
            log.info("step %d: eval loss %.4f", step + 1, loss)
        return loss

    def _record(self, step: int, stats: StepStatistics, res, grad_norm) -> StepReport:
        lay, world = self.cfg.layout, self.cfg.layout.world_size
        loss = stats.loss / (lay.tp * lay.dp)  # every TP rank of every replica's last stage adds
        tokens = stats.tokens / lay.tp
        report = StepReport(
            step,
            self.cfg.run.steps,
            loss,
            tokens / (stats.wall / world),
            StageStats(stats.busy, stats.wall).bubble,
            stats.wall / world,
            skipped=bool(stats.nonfinite),
            grad_norm=grad_norm,
            lr=self.lr(step),
            tokens=tokens,
            attn=stats.attn / lay.tp,
            memory=[int(m) for m in stats.memory],
            memory_measure=self.peak.label,
            in_flight=[int(n) for n in stats.in_flight],
        )
        if stats.moe_layers:
            report.aux_loss = stats.aux_loss / (lay.tp * lay.dp)
            report.expert_load_max_over_mean = max(stats.expert_load)
            report.dropped_tokens = stats.dropped / lay.tp
            self.summary.aux_losses.append(report.aux_loss)
        s = self.summary
        s.losses.append(loss)
        s.wall_s.append(report.wall_s)
        s.grad_norms.append(grad_norm)
        s.memory_peak = [max(a, b) for a, b in zip(s.memory_peak or report.memory, report.memory)]
        s.in_flight_peak = [
            max(a, b) for a, b in zip(s.in_flight_peak or report.in_flight, report.in_flight)
        ]
        if res.plan is not None:
            s.plan_s.append(res.plan.plan.seconds)
            s.plan_waited_s.append(res.plan.waited_s)
        return report

    async def _record_sizes(self, step: int, res, feats) -> None:
        """The iteration ends when its slowest stage does: that is what a replay simulates."""
        longest = torch.tensor([res.stats.wall], dtype=torch.float64)
        await self.rt.all_reduce(
            longest, dist.ReduceOp.MAX, what=f"step {step + 1}: world max of iteration time"
        )
        self.summary.features.append(feats)
        self.summary.slowest_s.append(longest.item())

    def _logs(self, step: int) -> bool:
        return step % self.cfg.output.log_every == 0 or step == self.cfg.run.steps - 1

    async def _after_step(self, step: int, stats: StepStatistics) -> bool:
        """Save when due; stop when asked. False when the run ends here."""
        # a stop during the last step: the run is complete
        stopping = stats.stops > 0 and step + 1 < self.cfg.run.steps
        if self.ckpts is not None and self.ckpts.due(step + 1, stopping):
            self.summary.checkpoint = str((await self.ckpts.save(step + 1)).path)
            self.saved_at = step + 1
        if not stopping:
            return True
        self.summary.stopped_at, self.summary.stop_requests = step + 1, int(stats.stops)
        log.info(
            "rank %d: stopping after step %d: a stop was requested on %d rank(s)",
            self.rt.rank,
            step + 1,
            int(stats.stops),
        )
        return False

    async def write_outputs(self) -> None:
        """Rank 0 writes output.sizes and output.trace (the trace gathered from every rank)."""
        cfg, rt, out = self.cfg, self.rt, self.cfg.output
        if self.metrics is not None:
            self.metrics.close(
                self.summary.memory_peak, self.peak.label, self.summary.in_flight_peak
            )
        if out.sizes and rt.rank == 0:
            par, sch = cfg.parallel, cfg.schedule
            virtual = (
                {"virtual": par.virtual, "placement": par.placement} if par.virtual > 1 else {}
            )
            write_json(
                out.sizes,
                {
                    "pp": rt.layout.pp,
                    **virtual,
                    "n_microbatches": sch.n_microbatches,
                    "seed": cfg.run.seed,
                    "preset": cfg.emulation.preset,
                    "hint": sch.hint.name,
                    "dispatch": str(sch.dispatch),
                    "budget": str(sch.budget),
                    "split": self.ex.settings.split,
                    "unit_ms": cfg.emulation.unit_ms,
                    "features": self.summary.features,
                    "step_wall_s": self.summary.slowest_s,
                },
            )
            log.info("wrote microbatch sizes %s", out.sizes)
        if out.routing:
            rows = await rt.gather_object(self.routing_record.rows)
            if rt.rank == 0:
                n = write_routing(out.routing, rows)
                log.info("wrote routing %s (%d rows)", out.routing, n)
                if n == 0:
                    log.warning(
                        "output.routing: no MoE layer routed a token; %s is empty", out.routing
                    )
        if self.recorder is not None:
            gathered = await rt.gather_object(self.recorder.spans)
            if rt.rank == 0:
                write_json(out.trace, chrome_trace([sp for spans in gathered for sp in spans]))
                log.info("wrote trace %s", out.trace)


def learning_rate(lr: float, warmup_steps: int, step: int) -> float:
    """The learning rate of (0-based) ``step``: rising linearly from 0 over ``warmup_steps`` steps,
    then ``lr`` (optim.schedule = constant; rrfp/app/train/lr_schedule.py has the others)."""
    return scheduled_lr(step, lr, warmup_steps)


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
    """No NaN or Inf in this rank's loss (last stage) or in its gradients (an FSDP shard's own
    part: no collective, and FSDP shards beside plain tensors, as with expert parallelism)."""
    if loss is not None and not math.isfinite(loss):
        return False
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
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
            f'(optim.on_nonfinite = stop; "skip" skips such steps)'
        )
    log.warning("rank %d: %s: skipped the optimizer step on every rank", rt.rank, what)
