"""One rank's pipeline iteration over its stages (one, or V with virtual stages): receivers,
senders and the arbiter, all owned by one TaskGroup.

The arbiter drives a ``RankTracker`` (rrfp/core/rank_tracker.py) over the rank's
``StageTracker``s, which hold every readiness rule; this module only moves tensors and spends
time. Ready and fixed dispatch differ inside the tracker's policy call, nowhere here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rrfp.comm.collective_wait import waiting_at
from rrfp.comm.ep_agreement import EPClass
from rrfp.comm.message import Message, MessageError, header_words
from rrfp.comm.pipeline_channels import RankChannels
from rrfp.core.cost import FEATURES
from rrfp.core.durations import TaskTimes
from rrfp.core.errors import (
    PeerFailure,
    PeerStuck,
    PeerTimeout,
    PipelineError,
    ProtocolError,
    TaskOverrun,
    leaves,
)
from rrfp.core.hints import Hint
from rrfp.core.placement import VirtualLayout, stages_label
from rrfp.core.policy import Dispatch
from rrfp.core.rank_tracker import RankSpec, RankTracker, StageTask
from rrfp.core.stats import StageStats
from rrfp.core.tasks import Kind, Task
from rrfp.core.tracker import TrackerError
from rrfp.nn.collective_marks import marking
from rrfp.nn.expert_parallel import ExpertParallel
from rrfp.nn.expert_time import ExpertClock, clocked
from rrfp.observe.instrument import Instrument
from rrfp.pipeline.forward_pass import forward_only
from rrfp.pipeline.plan_ahead import IterationPlanner, PlanReport
from rrfp.pipeline.schedule_settings import ScheduleSettings
from rrfp.pipeline.task_bound import TaskBound
from rrfp.pipeline.task_collectives import TaskCollectives
from rrfp.pipeline.thread_state import ThreadState
from rrfp.pipeline.timeouts import Timeouts
from rrfp.pipeline.user_code import user_code
from rrfp.pipeline.worker import StageWorker

log = logging.getLogger("rrfp.pipeline.executor")


@dataclass
class IterationResult:
    iteration: int
    losses: dict[int, float]  # last stage only
    stats: StageStats  # busy and wall in seconds
    order: list[Task]  # tasks in the order this rank ran them
    tokens: int
    plan: PlanReport | None = None  # hint = plan: the plan this iteration followed
    ran: list[tuple[int, Task]] = field(
        default_factory=list
    )  # (stage, task) in that order: which stage ran it
    skipped: bool = False  # on_nonfinite = "skip" met a NaN/Inf: every rank's gradients are None

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) / len(self.losses) if self.losses else None


def numel(inputs) -> int:
    """Elements of a microbatch's inputs: a tensor, or a tuple or list of them (None counts 0).
    The first stage's inputs never travel, so a workload may pass several (e.g. images and text)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.numel()
    if isinstance(inputs, (tuple, list)):
        return sum(numel(x) for x in inputs)
    return 0


def the_cause(group: BaseExceptionGroup) -> BaseException:
    """The one error an iteration raises for its TaskGroup's: this rank's own failure (the model's
    error, a bug, a protocol or message check) before a peer's that it caused, first come first.
    The others are noted on it. A caller then catches what the model raised (``except TypeError``),
    not an ExceptionGroup; rrfp/app/job/failure.py ranks the same way."""

    def rank(e: BaseException) -> int:
        return (
            2
            if isinstance(e, PeerFailure)
            else 1
            if isinstance(e, (PipelineError, MessageError))
            else 0
        )

    errors = leaves(group)
    cause = min(errors, key=rank)
    for other in errors:
        if other is not cause:
            cause.add_note(
                f"rrfp: meanwhile, in the same iteration: {type(other).__name__}: {other}"
            )
    return cause


class StageExecutor:
    """Runs this rank's stages of the pipeline under one arbiter, one iteration per
    ``run_iteration`` call.

    ``worker`` is one ``StageWorker`` or a list, one per stage of ``stages.stages_of(rank)``
    (``stages`` a ``VirtualLayout``; None: one stage per rank). ``channels`` is a
    ``RankChannels``, or for one stage that stage's ``PipelineChannels`` (``fwd_in``,
    ``fwd_out``, ``bwd_in``, ``bwd_out``, None at the ends). ``lane`` has
    ``async run(fn, *args, units=)``; the stages share it.
    """

    def __init__(
        self,
        worker: StageWorker | Sequence[StageWorker],
        channels,
        lane,
        settings: ScheduleSettings,
        rank: int = 0,
        instrument: Instrument | None = None,
        unit_s: float = 0.0,
        agreement=None,
        stages: VirtualLayout | None = None,
        liveness=None,
        *,
        timeouts: Timeouts | None = None,
        task_collectives: TaskCollectives | None = None,
        ties=None,
        nonfinite=None,
        sharded=None,
        layout_check=None,
        ep_agreement=None,
    ) -> None:
        self.workers = list(worker) if isinstance(worker, (list, tuple)) else [worker]
        first = self.workers[0]  # the rank's first stage
        if not isinstance(channels, RankChannels):  # one stage's channels
            channels = RankChannels(rank, {first.stage: channels})
        self.channels, self.lane, self.settings = channels, lane, settings
        # how long a wait for peers may last: peer_wait_s without a heartbeat; with one,
        # progress_s without progress (nothing arrives, no rank runs a task)
        self.timeouts = Timeouts.given(timeouts)
        # TP agreement (tp > 1, ready dispatch only): a fixed order needs none.
        self.agreement = agreement if settings.dispatch is Dispatch.READY else None
        # EP agreement (an EPAgreement: the stages with MoE layers in an EP group), ready dispatch
        # only: a fixed order is the hint's, the same on every member of the group
        self.ep_agreement = ep_agreement if settings.dispatch is Dispatch.READY else None
        self.rank, self.instrument, self.unit_s = rank, instrument, unit_s  # None: observe nothing
        S, s, M = first.num_stages, first.stage, settings.n_microbatches
        self.S, self.s, self.M = S, s, M
        mine = tuple(w.stage for w in self.workers)
        if stages is None and len(mine) != 1:
            raise ValueError(
                f"rank {rank}: {len(mine)} stage workers need a VirtualLayout (stages=)"
            )
        self.layout = stages if stages is not None else VirtualLayout(S)
        self._pp_rank = self.layout.rank_of(s)  # the pipeline rank that holds these stages
        if mine != self.layout.stages_of(self.layout.rank_of(s)) or S != self.layout.num_stages:
            raise ValueError(
                f"rank {rank}: workers for stages {mine} of {S}, but {self.layout.describe()}"
            )
        self.where = stages_label(mine)
        self.what = "stage" if len(mine) == 1 else "rank"
        # virtual stages: a local stage's task takes 1/V of a stage's time under the preset
        self.times = TaskTimes(
            settings.variability, settings.seed, settings.split, settings.cost, layout=self.layout
        )
        # the expert-parallel MoE layers of each stage: under emulated time with
        # ``settings.experts`` their tasks take the experts' and all-to-alls' time from the routing
        self.expert_layers = {
            w.stage: sum(isinstance(m, ExpertParallel) for m in w.module.modules())
            for w in self.workers
        }
        self.planner: IterationPlanner | None = None  # hint = plan: a new spec every iteration
        if settings.hint.planned:
            self.planner = IterationPlanner(
                self.times, self.layout.ranks, M, settings.budget, settings.dispatch
            )
            if (
                settings.cost is None and unit_s == 0
            ):  # rrfp train refuses this (emulation.cost); a library caller is told
                log.warning(
                    "%s: hint plan in real time without a cost model plans on the preset's made-up "
                    "lengths, not the compute; pass cost= (rrfp calibrate)",
                    self.where,
                )
        self.spec = self._spec(settings.hint)
        self._bytes_per_token = 0.0
        self.totals = StageStats()
        self.on_task_done: list[
            Callable[[Task], None]
        ] = []  # e.g. DP sync launching finished buckets
        # the runtime's Heartbeat (rrfp/comm/heartbeat.py), or None: with one, a wait for a peer has
        # no deadline (a silent peer is the heartbeat's to name); it is told which task runs, and
        # says how the peers this stage waits for are doing
        self.liveness = liveness
        self.task_hold_s: list[
            Callable[[Task], float]
        ] = []  # testing aid: extra lane seconds (faults.py slow)
        # testing aid: called on the lane's thread as a task begins (faults.py hang inside a task)
        self.task_begins: list[Callable[[Task], None]] = []
        # the markers of the collectives that the tasks' layers issue (a TP all-reduce), so that a
        # peer that never comes is named (rrfp/pipeline/task_collectives.py); None: unmarked
        self.task_collectives = task_collectives
        # parameters shared with other stages (rrfp/pipeline/ties.py): summed after the iteration
        self.ties = ties
        # a NonFiniteGuard (rrfp/pipeline/nonfinite.py): every rank stops or skips alike
        self.nonfinite = nonfinite
        # FSDP2 stage modules (rrfp/pipeline/sharded_stages.py): unsharded before the iteration's
        # first task, their gradients reduce-scattered after its last, the same on every replica
        self.sharded = sharded
        # every rank's executor agrees on M and the stages beside the first iterations
        # (rrfp/pipeline/layout_agreement.py); None: nothing to agree with
        self.layout_check = layout_check
        # real compute: a task's message goes to its channel's thread as the task returns, before
        # the lane gets the next task (``_post``); False: through the stage's sender coroutine, as
        # under emulated time, where a link's latency delays it (benchmarks/send_at_once.py)
        self.sends_at_once = True
        self._running: int | None = None  # the iteration under way
        self._cancelled: int | None = None  # an iteration cancelled midway: no more
        self.task_bound = (  # with the runtime's timeouts; a bare executor's tasks are unbounded
            TaskBound(timeouts.task_s, timeouts.said("task_s")) if timeouts is not None else None
        )

    def _spec(self, hint: Hint) -> RankSpec:
        """The rank's RankSpec: its stages' rules, and the budget over the rank."""
        st = self.settings
        return hint.rank_spec(self.layout, self._pp_rank, self.M, st.split, st.dispatch, st.budget)

    def tracker(self, spec: RankSpec, size_of: Callable[[int], int]) -> RankTracker:
        """The arbiter's state for one iteration under ``spec``."""
        return RankTracker(spec, size_of)

    def channels_of(self, stage: int):
        return self.channels.of(stage)

    @property
    def order(self) -> Sequence[tuple[int, Task]]:
        """The hint's order for the rank, over (stage, task) pairs (what fixed dispatch runs;
        ready's nominal order)."""
        return self.spec.order or self.settings.hint.rank_order(
            self.layout, self._pp_rank, self.M, self.settings.split
        )

    @property
    def limit(self):
        return self.spec.limit

    def statistics(self) -> StageStats:
        """Totals across iterations so far."""
        return self.totals

    async def run_iteration(
        self,
        iteration: int,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        features: Sequence[dict] | None = None,
        *,
        thread_state: ThreadState | None = None,
    ) -> IterationResult:
        """Run every task of this stage for one iteration. Gradients accumulate
        in the stage's parameters (mean over microbatches); the caller steps.
        ``features`` (one dict per microbatch) lets a cost model set emulated durations.
        Every task runs under the caller's autocast (``thread_state``: read on the thread that
        called; None: read here, when called, on the caller's loop thread).

        One iteration at a time: a second call while one runs is refused, as is any call after
        an iteration was cancelled (its messages may still be in flight between the ranks, and
        would be read as the next iteration's)."""
        self._one_at_a_time(f"run_iteration({iteration})")
        self._running = iteration
        try:
            return await self._run_iteration(iteration, batches, features, thread_state)
        except asyncio.CancelledError:
            self._cancelled = iteration
            raise
        finally:
            self._running = None

    def _one_at_a_time(self, call: str) -> None:
        if self._cancelled is not None:
            raise RuntimeError(
                f"rank {self.rank} {self.where}: {call} after iteration {self._cancelled} was "
                "cancelled: its messages may still be in flight between the ranks; start a new "
                "PipelineRuntime to go on"
            )
        if self._running is not None:
            raise RuntimeError(
                f"rank {self.rank} {self.where}: {call} while iteration {self._running} runs: "
                "await each iteration before starting the next"
            )

    async def _run_iteration(
        self,
        iteration: int,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        features: Sequence[dict] | None,
        thread_state: ThreadState | None,
    ) -> IterationResult:
        if len(batches) != self.M:
            raise ValueError(
                f"{self.where}: got {len(batches)} microbatches, configured for {self.M}"
            )
        self._check_features(features)
        state = (
            thread_state
            if thread_state is not None
            else ThreadState.capture(f"{self.where}: run_iteration")
        )
        spec, report = self.spec, None
        if self.planner is not None:
            hint, report = await self.planner.hint(iteration, features)
            spec = self._spec(hint)
        failed = None
        if self.sharded is not None:
            self.lane.follow_caller()  # on GPU: the all-gather reads what the optimizer wrote
            # a collective on the lane's thread: the runtime's watcher bounds the wait for a
            # replica that never comes (rrfp/comm/collective_wait.py)
            with waiting_at("FSDP's all-gather of the stage's parameters", self.sharded.group):
                await self.lane.run(self.sharded.begin)
        try:
            work = _Iteration(self, spec, iteration, batches, features, state).execute()
            check = self.layout_check
            result = await (work if check is None or check.agreed else check.alongside(work))
        except BaseExceptionGroup as group:  # the TaskGroup's; the caller gets the error itself
            failed = the_cause(group)
        if (
            failed is not None
        ):  # raised outside the handler, so that it does not chain the group it was in
            raise failed
        if self.sharded is not None:
            with waiting_at("FSDP's reduce-scatter of the stage's gradients", self.sharded.group):
                await self.lane.run(self.sharded.finish)
            self.lane.caller_waits()
        if (
            self.ties is not None and not self.ties.deferred
        ):  # with DP, GradSync.sync sums them after averaging
            await self.ties.sum_grads()
        result.plan = report
        if self.nonfinite is not None:
            result.skipped = await self.nonfinite.check(iteration, self.workers, result.losses)
        return result

    async def run_eval(
        self,
        iteration: int,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        thread_state: ThreadState | None = None,
    ) -> IterationResult:
        """Forward only (evaluation): the last stage's losses, no backward task, no graph kept,
        gradients untouched. Every rank calls it for the same ``iteration`` (its messages carry it),
        as with ``run_iteration``; the microbatches run in order (rrfp/pipeline/forward_pass.py).
        ``thread_state``: as ``run_iteration``'s (None: the caller's autocast, read here)."""
        self._one_at_a_time(f"run_eval({iteration})")
        if len(batches) != self.M:
            raise ValueError(
                f"{self.where}: got {len(batches)} microbatches, configured for {self.M}"
            )
        workers = {w.stage: w for w in self.workers}
        state = (
            thread_state
            if thread_state is not None
            else ThreadState.capture(f"{self.where}: run_eval", trains=False)
        )

        @state.wrap
        def forward(s: int, x, mb: int):
            evaluate = self.in_task(workers[s].evaluate, s, Task(Kind.F, mb), hooks=False)
            return evaluate(x, batches[mb][1] if s == self.S - 1 else None)

        self.lane.follow_caller()
        t0, busy = time.perf_counter(), self.lane.busy_s
        _, losses = await forward_only(
            self.lane,
            self.channels_of,
            list(workers),
            self.S,
            self.rank,
            iteration,
            self.M,
            lambda mb: batches[mb][0],
            forward,
        )
        await self.lane.drain()
        self.lane.caller_waits()
        values = torch.stack(losses).tolist() if losses else []  # one device-to-host read
        ran = [(s, Task(Kind.F, mb)) for mb in range(self.M) for s in sorted(workers)]
        stats = StageStats(self.lane.busy_s - busy, time.perf_counter() - t0, iterations=1)
        return IterationResult(
            iteration,
            dict(enumerate(values)),
            stats,
            [t for _, t in ran],
            sum(numel(b[1]) for b in batches),
            ran=ran,
        )

    def prepare(self, iteration: int, features: Sequence[dict] | None = None) -> None:
        """With hint = plan: start planning ``iteration`` now, while the current one runs.
        ``features`` must be those ``run_iteration`` will get. A no-op for other hints."""
        self._check_features(features)
        if self.planner is not None:
            self.planner.prepare(iteration, features)

    def _check_features(self, features: Sequence[dict] | None) -> None:
        """A cost model prices microbatches by their features: without them it would be ignored."""
        if self.settings.cost is None:
            return
        if features is None:
            raise ValueError(
                f"{self.where}: the executor has a cost model (cost=) but got no features: pass "
                f"features=[workload.features(b) for b in batches], one dict per microbatch "
                f"({', '.join(FEATURES)})"
            )
        if len(features) != self.M:
            raise ValueError(
                f"{self.where}: got features for {len(features)} microbatches, configured for "
                f"{self.M}"
            )
        for mb, feats in enumerate(features):
            missing = [k for k in FEATURES if k not in feats]
            if missing:
                raise ValueError(
                    f"{self.where}: the features of microbatch {mb} lack {', '.join(missing)} "
                    f"(the cost model needs {', '.join(FEATURES)})"
                )

    def in_task(self, fn: Callable, stage: int, task: Task, hooks: bool = True) -> Callable:
        """``fn`` as the lane runs it for ``task`` of ``stage``: the collectives of its layers
        marked (``task_collectives``), after the ``task_begins`` hooks (``hooks``: an iteration's
        task; an evaluation's forward runs none)."""
        marks, begins = self.task_collectives, self.task_begins if hooks else []
        if marks is None and not begins:
            return fn
        module = next(w.module for w in self.workers if w.stage == stage)
        marker = marks.marker(task, stage, module) if marks is not None else None

        def run(*args):
            for hook in begins:
                hook(task)
            if marker is None:
                return fn(*args)
            with marking(marker):
                return fn(*args)

        return run

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()


class _StageIO:
    """One of this rank's stages during an iteration: its worker and channels, and the tensors
    that arrived for it (from a peer rank, or handed over by the rank's own previous stage)."""

    def __init__(self, worker: StageWorker, channels) -> None:
        self.worker, self.channels, self.s = worker, channels, worker.stage
        self.inputs: dict[
            int, tuple
        ] = {}  # F inputs that arrived: (tensors, their requires-grad bits)
        self.grads: dict[int, torch.Tensor] = {}  # output gradients that arrived
        self.out_queues: dict[Kind, asyncio.Queue] = {}
        self.arrived: dict[tuple[Kind, int], dict] = {}  # traced: an input message's stamps


class _Iteration:
    """One iteration on one rank: the tracker, the tensors in transit, the timings."""

    def __init__(
        self,
        ex: StageExecutor,
        spec,
        iteration: int,
        batches,
        features=None,
        state: ThreadState = ThreadState(),
    ) -> None:
        self.ex, self.spec, self.it, self.batches, self.features = (
            ex,
            spec,
            iteration,
            batches,
            features,
        )
        self.state = state  # the caller's autocast: every F, B and W runs under it
        # the tracker gets a size function that holds neither this iteration nor its batches: a
        # bound method would make a cycle (iteration -> tracker -> iteration) that keeps every
        # microbatch, and the whole batch its views share, alive until the cyclic GC runs
        self.tracker = ex.tracker(spec, _activation_sizes(ex, batches))
        self.io = {w.stage: _StageIO(w, ex.channels_of(w.stage)) for w in ex.workers}
        self.changed = asyncio.Event()
        self.ran: list[tuple[int, Task]] = []
        self.handed: dict[
            tuple[int, Kind, int], object
        ] = {}  # the V turn: produced, not yet delivered
        # several stages per rank: how their forwards interleave depends on timing, so each draws
        # its randomness (dropout) from its own seed, not from where the rank's generator happens to
        # be
        self.rng_base = int(torch.randint(0, 2**62, ())) if len(ex.workers) > 1 else None
        self.rng_device = (
            _device_of(ex.workers[0].module) if self.rng_base is not None else None
        )  # the rank's one device
        self.losses: dict = {}  # microbatch -> loss tensor; floats once the iteration ends
        self.decisions = 0
        self.decision_s = 0.0
        self.decided_s = 0.0  # the decisions that picked the task now running (a trace's "decide")
        # when the decision that picked it began, and ended with the task started (wall clock)
        self.decided_at = (0.0, 0.0)

    async def execute(self) -> IterationResult:
        ex = self.ex
        for w in ex.workers:
            w.reset()
        ex.lane.follow_caller()  # on GPU: after the caller's optimizer step and input copies
        t0, lane_busy = time.perf_counter(), ex.lane.busy_s
        async with asyncio.TaskGroup() as tg:
            for io in self.io.values():
                ch = io.channels
                for kind, channel in ((Kind.F, ch.fwd_in), (Kind.B, ch.bwd_in)):
                    if channel is not None:
                        tg.create_task(
                            self._receive(io, channel, kind), name=f"rrfp-recv-{channel.name}"
                        )
                for kind, channel in ((Kind.F, ch.fwd_out), (Kind.B, ch.bwd_out)):
                    if channel is not None:
                        io.out_queues[kind] = asyncio.Queue()
                        tg.create_task(
                            self._send(io.s, channel, io.out_queues[kind]),
                            name=f"rrfp-send-{channel.name}",
                        )
            await self._arbitrate(tg)
        await ex.lane.drain()  # on GPU: tasks may still be enqueued behind each other
        ex.lane.caller_waits()  # on GPU: the caller's optimizer step sees every gradient
        if self.losses:  # one device-to-host read per iteration, after the last task
            values = torch.stack([self.losses[mb] for mb in sorted(self.losses)]).tolist()
            self.losses = dict(zip(sorted(self.losses), values))
        # busy: the lane's own account (device time on GPU, where run() returns before the work
        # ends)
        stats = StageStats(
            ex.lane.busy_s - lane_busy,
            time.perf_counter() - t0,
            self.decisions,
            self.decision_s,
            self.tracker.held.peak,
            iterations=1,
        )
        ex.totals = ex.totals + stats
        tokens = sum(numel(b[1]) for b in self.batches)
        return IterationResult(
            self.it, self.losses, stats, [t for _, t in self.ran], tokens, ran=self.ran
        )

    # -- the arbiter ---------------------------------------------------------

    async def _arbitrate(self, tg: asyncio.TaskGroup) -> None:
        ex, tr = self.ex, self.tracker
        if ex.ep_agreement is not None:
            return await self._arbitrate_ep(tg)
        agreed: asyncio.Task | None = (
            None  # TP: the next decision's round, started while a task runs
        )
        arrivals = tr.arrivals  # what the ready set in use has seen
        decided_s = 0.0  # decision time since the last task started: the next task's share
        while not tr.done:
            c0, w0 = time.perf_counter(), time.time()
            if ex.agreement is None:
                arrivals = tr.arrivals
                picked = tr.next()
            else:
                if agreed is None:
                    arrivals = tr.arrivals
                    agreed = tg.create_task(
                        ex.agreement.agree(tr.ready_tasks()), name="rrfp-tp-agree"
                    )
                everywhere, somewhere = await agreed
                agreed = None
                picked = tr.next(among=everywhere)
            decided_s += time.perf_counter() - c0
            self.decision_s += time.perf_counter() - c0
            self.decisions += 1
            if picked is None:
                if ex.agreement is not None and (
                    tr.arrivals != arrivals
                    or (tr.ready_tasks() >= somewhere and somewhere != everywhere)
                ):
                    continue  # something arrived meanwhile, or only a peer lags: agree again now
                await self._wait_for_change(arrivals)
                continue
            stage, task = picked
            tr.start(stage, task)
            self.decided_s, decided_s, self.decided_at = decided_s, 0.0, (w0, time.time())
            if ex.agreement is not None and tr.finished + 1 < tr.spec.num_tasks:
                # Agree on the next decision while this task runs, off the critical path. Every TP
                # rank runs the same task, so every rank starts this round; arrivals during the task
                # count from the decision after (docs/design.md, the one state machine).
                arrivals = tr.arrivals
                agreed = tg.create_task(
                    ex.agreement.agree(tr.ready_tasks() | tr.unlocked_by(stage, task)),
                    name="rrfp-tp-agree",
                )
            await self._perform(stage, task)

    async def _perform(self, stage: int, task: Task, beside: bool = False) -> None:
        """Run ``task`` of ``stage`` (started in the tracker) and deliver what it made; ``beside``:
        on the lane's second thread, beside the running task (``_perform_overlapped``)."""
        ex, tr = self.ex, self.tracker
        self._doing(f"task {task}")
        try:
            if ex.task_bound is None:
                await self._run(self.io[stage], task, beside)
            else:
                where = f"rank {ex.rank} stage {stage}"
                async with ex.task_bound.running(where, stage, task, self.it):
                    await self._run(self.io[stage], task, beside)
        except TaskOverrun:  # no progress to the peers: they name this rank if it lives
            self._doing(f"stuck in task {task}")
            ex.lane.stuck = True  # the exit does not wait for it
            raise
        except BaseException as e:
            # the task raised, or the iteration abandoned it (a send failed, a peer was lost): the
            # rank is out of it, so its heartbeat must not tell the peers it is at work there, which
            # they count as progress while they wait for its messages
            self._doing("")
            if isinstance(e, Exception):  # the model's own error keeps its type; this says where
                e.add_note(
                    f"rrfp: raised in task {task} (microbatch {task.mb}) of iteration {self.it}, "
                    f"on stage {stage} of {ex.S} (rank {ex.rank})"
                )
                mark = user_code(e)
                if mark is not None:  # the user's code: its line says which task called it
                    mark.task, mark.iteration, mark.stage = str(task), self.it, stage
            raise
        to = tr.finish(stage, task)
        if to is not None and to in self.io:  # the V turn: the rank's own next stage, no message
            self._hand_over(to, task)
        self.ran.append(StageTask(stage, task))
        for hook in ex.on_task_done:
            hook(task)
        self._doing("")
        if beside:
            self.changed.set()  # the arbiter may wait for it

    async def _arbitrate_ep(self, tg: asyncio.TaskGroup) -> None:
        """The arbiter of a rank in an EP group (docs/design.md, expert parallelism under
        readiness): its tasks that issue EP all-to-alls run one agreed class at a time, in the
        group's one order; the others (W, stages without MoE layers) run by readiness alone.

        A round is started when no agreed task is pending, EP tasks remain and this rank offers a
        class: after an agreed task at once, after a failed round only once the offer grew or holds
        every class offered somewhere (then the others must catch up, and the round waits for them
        while this rank runs its free tasks). Every member joins every round, so the rounds pair."""
        ex, tr, ep = self.ex, self.tracker, self.ex.ep_agreement
        if self._overlap:  # a window at an all-to-all wakes the arbiter (_perform_overlapped)
            ex.lane.on_window = self.changed.set
        left = ex.M * len(ep.classes)  # the iteration's EP tasks: M of each class
        pending: asyncio.Task | None = None  # the round in flight
        turn: EPClass | None = None  # the class agreed, not yet run here
        offered: frozenset[EPClass] | None = None  # this rank's offer in the last failed round
        somewhere: frozenset[EPClass] = frozenset()
        decided_s = 0.0
        while not tr.done:
            c0, w0 = time.perf_counter(), time.time()
            arrivals = tr.arrivals
            if pending is not None and pending.done():
                turn, somewhere = pending.result()
                pending = None
            ready = tr.ready_tasks()
            by_class: dict[EPClass | None, set[StageTask]] = {}
            for item in ready:
                by_class.setdefault(ep.classify(item.stage, item.kind), set()).add(item)
            picked = tr.next(among=by_class.get(turn, ())) if turn is not None else None
            if picked is None and pending is None and turn is None and left:
                offer = {
                    c: best
                    for c, items in by_class.items()
                    if c is not None and (best := tr.next(among=items)) is not None
                }
                now = frozenset(offer)
                if now and (offered is None or now != offered or now >= somewhere):
                    mine = tr.next(among=offer.values())
                    preferred = ep.classify(mine.stage, mine.kind) if mine is not None else None
                    offered = now
                    pending = tg.create_task(self._ep_round(now, preferred), name="rrfp-ep-agree")
            if picked is None:
                free = by_class.get(None, set())
                if self._overlap and pending is not None:
                    # the round in flight is about to start an EP task, whose all-to-alls can
                    # take the W's beside: they wait for it
                    free = {item for item in free if item.kind is not Kind.W}
                picked = tr.next(among=free)
            decided_s += time.perf_counter() - c0
            self.decision_s += time.perf_counter() - c0
            self.decisions += 1
            if picked is None:
                if pending is None or not pending.done():
                    await self._wait_for_change(arrivals)
                continue
            stage, task = picked
            agreed = ep.classify(stage, task.kind) is not None
            if agreed:  # the agreed task: the next round is new
                turn, offered, somewhere, left = None, None, frozenset(), left - 1
            tr.start(stage, task)
            self.decided_s, decided_s, self.decided_at = decided_s, 0.0, (w0, time.time())
            if agreed and self._overlap:
                await self._perform_overlapped(tg, stage, task)
            else:
                await self._perform(stage, task)

    @property
    def _overlap(self) -> bool:
        """Whether EP tasks run with a task beside them at their all-to-alls (settings.overlap,
        on a lane with a second thread)."""
        ex = self.ex
        return (
            ex.settings.overlap and ex.ep_agreement is not None and hasattr(ex.lane, "run_beside")
        )

    async def _perform_overlapped(self, tg: asyncio.TaskGroup, stage: int, task: Task) -> None:
        """Run the agreed EP task ``task``; while it waits at an all-to-all (the lane's window),
        run beside it the best ready W that issues no EP collective, one at a time (docs/design.md,
        the all-to-all as a point where the rank may run other work). The task beside may outlast
        this one: the tracker holds it until it finishes."""
        ex, tr, ep = self.ex, self.tracker, self.ex.ep_agreement
        main = tg.create_task(self._perform(stage, task), name="rrfp-ep-task")
        while not main.done():
            self.changed.clear()
            if ex.lane.window and tr.beside is None:
                free = [
                    item
                    for item in tr.ready_tasks()
                    if item.kind is Kind.W and ep.classify(item.stage, Kind.W) is None
                ]
                picked = tr.next_beside(free) if free else None
                if picked is not None:
                    tr.start_beside(picked.stage, picked.task)
                    tg.create_task(self._perform(*picked, beside=True), name="rrfp-beside")
            changed = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait((main, changed), return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
        await main

    async def _ep_round(self, offered: frozenset, preferred):
        outcome = await self.ex.ep_agreement.agree(offered, preferred)
        self.changed.set()  # the arbiter may wait for it
        return outcome

    def _hand_over(self, to: int, task: Task) -> None:
        """What ``task`` produced arrives at once at stage ``to`` of this same rank, shaped as a
        message would deliver it: a lone tensor (or None) as itself, several as a tuple; a forward's
        with the requires-grad bits its message would carry."""
        value, bits = self.handed.pop((to, task.kind, task.mb))
        if isinstance(value, list):
            value = tuple(value)
        if task.kind is Kind.F:
            self.io[to].inputs[task.mb] = (value, bits)
        else:
            self.io[to].grads[task.mb] = value
        self.tracker.arrive(to, task.kind, task.mb)

    async def _wait_for_change(self, arrivals: int) -> None:
        self.changed.clear()
        if self.tracker.arrivals != arrivals:
            return
        start = time.time()
        timeout_s = self.ex.timeouts.peer_wait_s
        hb = self.ex.liveness
        if hb is None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.changed.wait()
            except TimeoutError:
                raise PeerTimeout(
                    f"rank {self.ex.rank} {self.ex.where}: iteration {self.it}: nothing arrived "
                    f"for {timeout_s:g} s; the {self.ex.what} {self._waiting_for()}",
                    self._owing_peer(),
                ) from None
        else:
            await self._wait_alive(hb, timeout_s, start)
        if self.ex.instrument is not None:
            end, why = time.time(), self._waiting_for()
            for s in self.io:  # one row per stage: each of them waited
                self.ex.instrument.wait(s, self.it, start, end, why)

    async def _wait_alive(self, hb, every_s: float, start: float) -> None:
        """Wait for as long as the peers beat (a silent one ends the run through the runtime) and
        the job makes progress: a peer that beats but for ``progress_s`` neither sends nor lets
        any rank run a task is named (PeerStuck). Every ``every_s`` say what this stage waits
        for and how its peers are doing."""
        peers = list(
            dict.fromkeys(c.peer for c in self._owing())
        )  # a peer owing on two channels is named once
        self._doing(f"waiting for rank {' and '.join(map(str, peers))}" if peers else "waiting")
        bound = self.ex.timeouts.progress_s
        began, said = time.monotonic(), time.monotonic()
        while True:
            now = time.monotonic()
            stalled = now - max(began, hb.progress_at) if bound is not None else 0.0
            if bound is not None and stalled >= bound:
                self._doing("")
                raise PeerStuck(self._no_progress(hb, peers, stalled), peers[0] if peers else None)
            tick = every_s - (now - said)
            if bound is not None:
                tick = min(tick, bound - stalled, hb.period_s)
            try:
                async with asyncio.timeout(max(tick, 0.0)):
                    await self.changed.wait()
                break
            except TimeoutError:
                if time.monotonic() - said < every_s:
                    continue
                said = time.monotonic()
                how = "; ".join(f"rank {p}: {hb.describe(p)}" for p in peers)
                log.warning(
                    "rank %d %s: iteration %d: waiting for %.0f s (%s); the %s %s",
                    self.ex.rank,
                    self.ex.where,
                    self.it,
                    time.time() - start,
                    how or "no peer owes an arrival",
                    self.ex.what,
                    self._waiting_for(),
                )
        self._doing("")

    def _no_progress(self, hb, peers: list[int], stalled: float) -> str:
        """The line for peers that beat but sent nothing while no rank of the job ran a task."""
        who = " and ".join(f"rank {p} ({hb.describe(p)})" for p in peers) or "no peer"
        return (
            f"rank {self.ex.rank} {self.ex.where}: iteration {self.it}: {who} sent nothing for "
            f"{stalled:.1f} s while no rank ran a task ({self.ex.timeouts.said('progress_s')}): a "
            f"deadlock, or a rank stuck outside the pipeline; the {self.ex.what} "
            f"{self._waiting_for()}"
        )

    def _doing(self, what: str) -> None:
        if self.ex.liveness is not None:
            self.ex.liveness.doing(what)

    def _owing(self) -> list:
        """The incoming channels whose peers still owe this rank an arrival."""
        tr = self.tracker
        return [
            c
            for s, io in self.io.items()
            for kind, c in ((Kind.F, io.channels.fwd_in), (Kind.B, io.channels.bwd_in))
            if c is not None and tr.trackers[s].outstanding(kind)
        ]

    def _owing_peer(self) -> int | None:
        return next((c.peer for c in self._owing()), None)

    def _waiting_for(self) -> str:
        """The tracker's reason, with the channels and peers that owe an arrival."""
        owed = [f"channel {c.name} (peer rank {c.peer})" for c in self._owing()]
        return self.tracker.blocked() + (f"; owed by {' and '.join(owed)}" if owed else "")

    async def _run(self, io: _StageIO, task: Task, beside: bool = False) -> None:
        """Compute ``task`` of ``io``'s stage on the lane (``beside``: on its second thread) and
        post what it sends."""
        ex, w, mb, s = self.ex, io.worker, task.mb, io.s
        units = self._units(s, task) if ex.unit_s else 0.0
        hold = sum(h(task) for h in ex.task_hold_s)
        lane: dict[str, Any] = {"units": units, **({"hold_s": hold} if hold else {})}
        clock = None if beside else self._expert_clock(s, task)
        if clock is not None:  # the routed part of the task in place of its share of the draw
            drawn = units * ex.unit_s
            lane["more_s"] = lambda: clock.held_s(drawn) - drawn
        start = time.time()
        arrived = io.arrived.pop((task.kind, mb), None)
        posted = False  # its message is on the channel's thread already (``_post``)
        if task.kind is Kind.F:
            x, bits = (self.batches[mb][0], None) if s == 0 else io.inputs.pop(mb)
            targets = self.batches[mb][1] if s == ex.S - 1 else None
            forward = (
                w.forward
                if self.rng_base is None
                else _seeded(w.forward, self.rng_base + s * ex.M + mb, self.rng_device)
            )
            forward = _clocked(ex.in_task(self.state.wrap(forward), s, task), clock)
            last = s == ex.S - 1
            made = self._sending(
                io,
                forward,
                None if last else s + 1,
                lambda y: self._message(mb, Kind.F, y, w.output_requires_grad(mb)),
            )
            out, msg, prepared = await ex.lane.run(made, mb, x, targets, bits, **lane)
            returned = time.time()
            if self.spec.limit.bytes is not None:
                measured = w.activation_bytes(mb) / max(1, numel(self.batches[mb][0]))
                ex._bytes_per_token = max(ex._bytes_per_token, measured)
            if last:
                self.losses[mb] = out
            else:
                posted = self._post(io, s + 1, msg, out, prepared)
        elif task.kind is Kind.B:
            grad = None if s == ex.S - 1 else io.grads.pop(mb)
            backward = _clocked(ex.in_task(self.state.wrap(w.backward), s, task), clock)
            made = self._sending(
                io, backward, s - 1 if s > 0 else None, lambda g: self._message(mb, Kind.B, g)
            )
            grad_in, msg, prepared = await ex.lane.run(made, mb, grad, **lane)
            returned = time.time()
            if s > 0:
                posted = self._post(io, s - 1, msg, grad_in, prepared)
        elif beside:  # a W that issues no EP collective (_perform_overlapped)
            await ex.lane.run_beside(ex.in_task(self.state.wrap(w.weight), s, task), mb, **lane)
            returned = time.time()
        else:
            weight = _clocked(ex.in_task(self.state.wrap(w.weight), s, task), clock)
            await ex.lane.run(weight, mb, **lane)
            returned = time.time()
        if not posted:  # a send just queued is issued now, not after the next task's host work
            await asyncio.sleep(0)
        if ex.instrument is not None:
            end = time.time()
            detail = self._detail(returned, beside)
            if arrived is not None:
                detail["arrived"] = arrived
            ex.instrument.task_detail(s, self.it, task, detail)
            ex.instrument.task(s, self.it, task, start, end)

    def _detail(self, returned: float, beside: bool = False) -> dict:
        """Where a task's host time went, for a trace: the decisions that picked it (seconds),
        when the lane ran its work (``compute``, wall clock; absent where the host cannot see it,
        e.g. a CUDA stream) and when the loop had the lane's answer back (``returned``)."""
        call = getattr(self.ex.lane, "last_beside_call" if beside else "last_call", None)
        detail: dict = {
            "decide_s": self.decided_s,
            "decided": list(self.decided_at),
            "returned": returned,
        }
        if call is not None:
            detail["compute"] = list(call)
        if beside:
            detail["beside"] = True
        return detail

    def _units(self, stage: int, task: Task) -> float:
        """Emulated device time (``rrfp.core.durations``)."""
        return self.ex.times.units(self.it, stage, task.mb, task.kind, self.features)

    def _expert_clock(self, stage: int, task: Task) -> ExpertClock | None:
        """The clock on which ``task``'s expert-parallel MoE layers spend their routed time
        (rrfp/nn/expert_time.py), in units of the task's kind at its mean; None where nothing is
        emulated on the host, or the stage has no such layer."""
        ex, times = self.ex, self.ex.settings.experts
        layers = ex.expert_layers.get(stage, 0)
        emulated = times is not None and ex.unit_s and getattr(ex.lane, "emulates_on_host", False)
        if not layers or not (emulated or self._overlap):
            return None
        var, split = ex.settings.variability, ex.settings.split
        mean = {Kind.F: var.f, Kind.B: var.b if split else var.b + var.w, Kind.W: var.w}
        return ExpertClock(
            times if emulated else None,
            mean[task.kind] * ex.unit_s / ex.times.virtual,
            layers,
            # the all-to-alls leave the device to a task beside (_perform_overlapped)
            window=ex.lane.yielding if self._overlap else None,
        )

    # -- communication -------------------------------------------------------

    def _message(self, mb: int, kind: Kind, value, bits: list[bool] | None = None) -> Message:
        """What a task sends: a tuple or list as that many tensors, a lone tensor as one; ``bits``
        (F) says which carry a gradient, so that a constant arrives as one."""
        tensors = list(value) if isinstance(value, (tuple, list)) else [value]
        return Message(self.it, mb, int(kind), tensors, bits)

    def _sending(self, io: _StageIO, fn: Callable, to: int | None, message: Callable) -> Callable:
        """``fn`` as the lane runs it for a task that sends what it returns to stage ``to`` (None:
        nothing), returning (its value, the message, the message prepared to post or None).

        The lane makes the message (``Channel.prepare``) where the task computes on the CPU lane's
        thread with real time and sends at once to another rank over gloo: its header encoded and
        its payload packed while the payload is in cache, before the loop's turn. A CUDA lane
        enqueues its work and returns before it ran; its messages, and the others, are made right
        after the task, and their posts (``_post``) do the rest."""
        channel = None
        if to is not None and to not in self.io and self.ex.sends_at_once and not self.ex.unit_s:
            out = io.channels.fwd_out if to > io.s else io.channels.bwd_out
            on_cpu = getattr(out, "device", None) == torch.device("cpu")
            channel = out if on_cpu and hasattr(out, "prepare") else None

        def run(*args):
            value = fn(*args)
            if to is None:
                return value, None, None
            msg = message(value)
            return value, msg, channel.prepare(msg) if channel is not None else None

        return run

    def _post(self, io: _StageIO, to: int, msg: Message, value, prepared=None) -> bool:
        """Queue what the task just enqueued on the lane produced for stage ``to``; on GPU it
        carries that task's end event, so its send waits for the producer and not for tasks enqueued
        later. A stage of this same rank gets ``value`` itself once the tracker has the task
        finished. True: the message is on its channel's thread already (``sends_at_once``)."""
        if to in self.io:
            header_words(
                msg
            )  # what no link could carry is refused here too, not silently cut from the graph
            bits = msg.requires_grad or [False] * len(msg.tensors)
            self.handed[(to, Kind(msg.kind), msg.microbatch)] = (value, bits)
            return False
        msg.ready = getattr(self.ex.lane, "last_task_done", None)
        if self.ex.instrument is not None:
            msg.times = {"posted": time.time()}
        kind = Kind(msg.kind)
        channel = io.channels.fwd_out if kind is Kind.F else io.channels.bwd_out
        if self.ex.sends_at_once and not self.ex.unit_s and hasattr(channel, "post"):
            # real compute, no link latency to emulate: the channel's thread has the message
            # before the lane has the next task, rather than once the loop comes round to it
            try:
                posted = channel.post(msg, prepared=prepared)
            except Exception as e:  # noqa: BLE001 - raised by the sender, as a queued send's is
                posted = asyncio.get_running_loop().create_future()
                posted.set_exception(e)
                posted.exception()  # retrieved: the sender raises it, unless cancelled first
            io.out_queues[kind].put_nowait((None, posted, msg))
            return True
        latency = (  # emulated link latency; real compute draws none (a numpy draw per message)
            self.ex.times.latency(self.it, io.s, msg.microbatch, msg.kind) * self.ex.unit_s
            if self.ex.unit_s
            else 0.0
        )
        io.out_queues[kind].put_nowait((time.perf_counter() + latency, None, msg))
        return False

    async def _send(self, stage: int, channel, queue: asyncio.Queue) -> None:
        for _ in range(self.ex.M):
            due, posted, msg = await queue.get()
            if posted is not None:  # its transport already queued on the channel's thread
                await asyncio.shield(posted)
            else:
                delay = due - time.perf_counter()
                if delay > 0:  # emulated link latency
                    await asyncio.sleep(delay)
                await channel.send(msg)
            if msg.times is not None and self.ex.instrument is not None:
                task = Task(Kind(msg.kind), msg.microbatch)
                self.ex.instrument.task_sent(stage, self.it, task, msg.times)

    async def _receive(self, io: _StageIO, channel, kind: Kind) -> None:
        where = (
            f"rank {self.ex.rank} stage {io.s}: channel {channel.name} (peer rank {channel.peer})"
        )
        for _ in range(self.ex.M):
            msg = await channel.recv()
            mb = msg.microbatch
            if msg.iteration != self.it or msg.kind != int(kind) or not msg.tensors:
                raise ProtocolError(
                    f"{where}: expected a {kind.name} message of iteration {self.it}, got "
                    f"iteration {msg.iteration} kind {msg.kind} microbatch {mb} "
                    f"with {len(msg.tensors)} tensor(s)"
                )
            if msg.times is not None and self.ex.instrument is not None:
                msg.times["delivered"] = time.time()
                io.arrived[(kind, mb)] = msg.times
            try:
                self.tracker.arrive(io.s, kind, mb)
            except TrackerError as e:
                raise ProtocolError(f"{where}: iteration {self.it}: {e}") from None
            # one tensor stays a tensor (what single-tensor models expect); several arrive as a
            # tuple
            value = msg.tensors[0] if len(msg.tensors) == 1 else tuple(msg.tensors)
            if kind is Kind.F:
                io.inputs[mb] = (value, msg.requires_grad or [False] * len(msg.tensors))
            else:
                io.grads[mb] = value
            self.changed.set()


def _clocked(fn: Callable, clock: ExpertClock | None) -> Callable:
    """``fn`` with ``clock`` installed on the thread that runs it (the lane's)."""
    if clock is None:
        return fn

    def run(*args):
        with clocked(clock):
            return fn(*args)

    return run


def _activation_sizes(ex: StageExecutor, batches) -> Callable[[int], int]:
    """A microbatch's activation bytes at one of ``ex``'s stages, from its input's element count
    and the bytes per element measured so far (byte budgets)."""
    counts = [numel(b[0]) for b in batches]
    return lambda mb: int(counts[mb] * ex._bytes_per_token)


def _seeded(fn: Callable, seed: int, device: torch.device) -> Callable:
    """``fn`` under its own generator state seeded with ``seed``, leaving the rank's generators as
    they were: the same draws whatever ran before it. Only the generators ``fn`` draws from, the
    CPU's and its device's, are seeded: ``torch.manual_seed`` also queues a seed for every
    accelerator not yet initialised, with a formatted stack each (about a millisecond a task on
    a lane's deep stack)."""
    generators = _generators(device)

    def run(*args):
        states = [g.get_state() for g in generators]
        for g in generators:
            g.manual_seed(seed)
        try:
            return fn(*args)
        finally:
            for g, state in zip(generators, states, strict=True):
                g.set_state(state)

    return run


def _generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a module on ``device`` draws from: the CPU's, and its GPU's."""
    if device.type != "cuda":
        return [torch.default_generator]
    torch.cuda.init()  # a no-op where the module's parameters are on the GPU already
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.default_generator, torch.cuda.default_generators[index]]


def _device_of(module: torch.nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))
