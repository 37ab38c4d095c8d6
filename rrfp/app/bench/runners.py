"""One interface over every contender of `rrfp bench`, on one rank: run an
iteration on given microbatches, say how long it took, keep its task spans.

rrfp's executors and torch's schedules differ in everything else; the bench
only sees ``Runner.run(iteration, batches, features) -> Measured`` and
``Runner.spans``, and every runner spends the same emulated time per task
(``rrfp.core.durations.TaskTimes``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rrfp.app.bench.suite import BenchSpec, Contender
from rrfp.core.budget import Budget, peak_held
from rrfp.core.cost import CostModel
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import resolve
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.variability import Variability
from rrfp.nn.expert_time import ExpertTimes
from rrfp.observe.instrument import TraceRecorder
from rrfp.observe.trace import Span
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.schedule_settings import AUTO_UNSPLIT, ScheduleSettings
from rrfp.pipeline.workload import Workload
from rrfp.sim.unsplit_choice import RunSchedule, UnsplitChoice, choose_unsplit_stages


@dataclass(frozen=True)
class Measured:
    """One iteration on this rank; what a runner cannot know stays None."""

    wall_s: float
    peak_inflight: float | None = (
        None  # microbatches of this rank's stage held at once (torch's ZB-V: halves)
    )
    decision_us: float | None = None  # mean time per dispatch decision
    plan_s: float | None = (
        None  # hint = plan: time spent planning this iteration (in a thread, ahead)
    )
    plan_waited_s: float | None = None  # ... and how long the iteration waited for its plan
    plan_order: tuple[int, ...] | None = None  # ... and the microbatches' planned entry order
    overhead_s: float | None = (
        None  # drop-in: the step's time outside the executor's iteration and plan
    )

    def reduced(self) -> list[float]:
        """The figures every rank all-reduces (MAX), with -1 for unknown."""
        return [
            -1.0 if v is None else float(v)
            for v in (
                self.wall_s,
                self.peak_inflight,
                self.decision_us,
                self.plan_s,
                self.plan_waited_s,
                self.overhead_s,
            )
        ]


def schedule_settings(
    spec: BenchSpec,
    contender: Contender,
    variability: Variability,
    cost: CostModel | None,
    seed: int | None = None,
    experts: ExpertTimes | None = None,
) -> ScheduleSettings:
    """What an rrfp executor of the suite runs: built here once for every runner that has one.
    ``seed``: the replica's own (None: the spec's). A row that leaves its stages unsplit "auto"
    chooses them from ``cost`` as a run's config does, and its plan prices them whole."""
    unsplit = contender.unsplit_stages
    if unsplit == AUTO_UNSPLIT:
        assert cost is not None
        unsplit = auto_unsplit(spec, contender, variability, cost).stages
        cost = cost.run_whole(unsplit)
    return ScheduleSettings.of(
        spec.n_microbatches,
        dispatch=contender.dispatch,
        hint=contender.hint,
        budget=spec.budget,
        variability=variability,
        seed=spec.seed if seed is None else seed,
        cost=cost,
        experts=experts,
        overlap=contender.overlap,
        unsplit_stages=unsplit,
    )


def planned_with(
    spec: BenchSpec, contender: Contender, variability: Variability, cost: CostModel | None
) -> CostModel | None:
    """The cost model ``contender``'s plan prices its tasks with: an "auto unsplit" row's stages
    priced whole where it leaves them unsplit (what the parent must plan with to plan as the
    ranks did)."""
    if contender.unsplit_stages != AUTO_UNSPLIT or cost is None:
        return cost
    return cost.run_whole(auto_unsplit(spec, contender, variability, cost).stages)


def auto_unsplit(
    spec: BenchSpec, contender: Contender, variability: Variability, cost: CostModel
) -> UnsplitChoice:
    """The stages an "auto unsplit" row leaves unsplit, as ``unsplit_stages = "auto"`` chooses
    them for a run of its settings (rrfp/sim/unsplit_choice.py)."""
    run = RunSchedule(
        VirtualLayout(spec.pp, contender.virtual, contender.placement),
        spec.n_microbatches,
        resolve(contender.hint),
        Dispatch.parse(contender.dispatch),
        Budget.parse(spec.budget),
        variability,
    )
    return choose_unsplit_stages(cost, run)


class Runner(Protocol):
    name: str

    @property
    def spans(self) -> list[Span]: ...

    def prepare(self, iteration: int, features: Sequence[dict]) -> None:
        """Get ready for ``iteration`` (e.g. plan it) while the current one runs."""

    async def run(self, iteration: int, batches: Sequence, features: Sequence[dict]) -> Measured:
        """One iteration; it leaves no gradients behind (the bench measures, it does not train)."""

    def close(self) -> None:
        """Release what the runner holds beyond the rank's runtime (collective)."""


class RrfpRunner:
    """A StageExecutor (fixed or ready dispatch, any hint), traced. With virtual stages ``module``
    is the list of the rank's stage modules and ``rt`` the runtime of that layout."""

    def __init__(
        self,
        rt: PipelineRuntime,
        contender: Contender,
        module,
        workload: Workload,
        spec: BenchSpec,
        variability: Variability,
        cost: CostModel | None,
        experts: ExpertTimes | None = None,
    ) -> None:
        self.name = contender.name
        self._virtual = contender.virtual
        self._recorder = TraceRecorder(contender.name, rt.rank if contender.virtual > 1 else None)
        self._executor = rt.stage_executor(
            module,
            workload.loss_fn,
            # each replica draws its durations from its own seed
            schedule_settings(spec, contender, variability, cost, spec.seed + rt.dp_rank, experts),
            instrument=self._recorder,
            on_nonfinite=None,
        )  # timed: no per-iteration agreement

    @property
    def spans(self) -> list[Span]:
        return self._recorder.spans

    def prepare(self, iteration: int, features: Sequence[dict]) -> None:
        self._executor.prepare(
            iteration, features
        )  # hint = plan: planned in a thread, as rrfp train does

    async def run(self, iteration: int, batches: Sequence, features: Sequence[dict]) -> Measured:
        res = await self._executor.run_iteration(iteration, batches, features)
        for w in self._executor.workers:
            w.module.zero_grad(set_to_none=True)
        st, plan = res.stats, res.plan
        peak = (
            st.peak_inflight / self._virtual
        )  # local-stage microbatches -> microbatches of the rank's layers
        return Measured(
            st.wall,
            peak,
            st.decision_us,
            plan and plan.plan.seconds,
            plan and plan.waited_s,
            plan and tuple(plan.plan.order),
        )

    def close(self) -> None:
        pass  # the executor belongs to the rank's runtime


class TorchRunner:
    """torch.distributed.pipelining's schedule (rrfp.app.bench.torch_schedules), the anchor. Its
    task spans are laid on this rank's row (a rank holds one or two torch stages), on the rrfp
    spans' clock."""

    def __init__(
        self,
        rt: PipelineRuntime,
        contender: Contender,
        workload: Workload,
        model_cfg,
        spec: BenchSpec,
        variability: Variability,
        cost: CostModel | None,
        group=None,
        experts: ExpertTimes | None = None,
    ) -> None:
        from rrfp.app.bench.torch_schedules import TorchScheduleRunner, workload_stage_builder

        self.name = contender.name
        self._spec, self._var, self._cost, self._row = spec, variability, cost, rt.stage
        self._seed = spec.seed + rt.dp_rank  # the replica's, as its rrfp executors draw
        # with replicas, ``group`` is this one's pipeline, and the rank is its stage there
        pipeline = rt.layout.coords(rt.rank).pp if group is not None else rt.rank
        split = contender.split
        means = (variability.f, variability.b, variability.w)
        self._runner = TorchScheduleRunner(
            contender.hint,
            workload_stage_builder(workload, model_cfg, spec.seed),
            workload.loss_fn,
            pipeline,
            spec.pp if group is not None else rt.layout.world_size,
            spec.n_microbatches,
            rt.unit_s,
            group=group,
            prepare=rt.shard_experts,
            experts=experts,
            means=means if split else (means[0], means[1] + means[2], 0.0),
        )
        # two stages per rank, with the preset: each torch stage takes its own draw, as each local
        # stage of rrfp's executor at V = 2 of the same placement does (a cost model is fitted per
        # rrfp stage: halves)
        self._by_stage = self._runner.per_rank > 1 and cost is None
        self._spans: list[Span] = []

    @property
    def spans(self) -> list[Span]:
        return self._spans

    def prepare(self, iteration: int, features: Sequence[dict]) -> None:
        pass  # torch's schedules are fixed

    async def run(self, iteration: int, batches: Sequence, features: Sequence[dict]) -> Measured:
        times = TaskTimes(
            self._var,
            self._seed,
            self._runner.split,
            self._cost,
            layout=self._runner.layout if self._by_stage else None,
        )

        def units(
            stage: int, mb: int, kind
        ) -> float:  # the rrfp executors' durations, task for task
            return times.units(iteration, stage, mb, kind, features)

        def latency(stage: int, mb: int, kind) -> float:  # and their link latencies
            return times.latency(iteration, stage, mb, kind)

        native = (
            self._spec.torch_sends == "native"
        )  # torch issues and waits its own sends, with no latency

        # torch's schedule blocks; nothing else of this rank runs meanwhile
        res = self._runner.run_iteration(
            iteration, batches, units, None if native else latency, by_stage=self._by_stage
        )
        for p in self._runner.parameters():
            p.grad = None
        to_wall = time.time() - time.perf_counter() + res.start  # its span times are from res.start
        self._spans += [
            Span(
                self.name,
                self._row,
                sp.name,
                sp.start + to_wall,
                sp.end + to_wall,
                {"iteration": iteration, "torch_stage": sp.stage},
            )
            for sp in res.spans
        ]
        return Measured(res.wall_s, held_peak(res.spans, self._runner.clock.share))

    def close(self) -> None:
        pass  # its sender threads end with each iteration


class DropInRunner:
    """The same stage module behind torch's PipelineStage, run by ``rrfp.ScheduleReady``
    (rrfp.app.bench.dropin) with the rrfp executors' durations. Its time is the whole ``step()``, as
    a training loop sees it; ``overhead_s`` is what the step spent outside the executor's iteration
    and its plan. Planning happens inside the step: the public surface has no ``prepare``."""

    def __init__(
        self,
        rt: PipelineRuntime,
        contender: Contender,
        module,
        workload: Workload,
        spec: BenchSpec,
        variability: Variability,
        cost: CostModel | None,
    ) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage

        from rrfp.app.bench.dropin import EmulatedScheduleReady, TorchCall

        self.name = contender.name
        self._recorder = TraceRecorder(contender.name)
        self._first, self._last = rt.stage == 0, rt.stage == rt.num_stages - 1
        stage = PipelineStage(TorchCall(module), rt.stage, rt.num_stages, torch.device("cpu"))
        self._module = module
        self._schedule = EmulatedScheduleReady(
            stage,
            spec.n_microbatches,
            workload.loss_fn,
            unit_ms=spec.unit_ms,
            instrument=self._recorder,
            settings=schedule_settings(spec, contender, variability, cost),
            timeout_s=spec.timeout_s,
        )

    @property
    def spans(self) -> list[Span]:
        return self._recorder.spans

    def prepare(self, iteration: int, features: Sequence[dict]) -> None:
        pass  # ScheduleReady plans when its step starts

    async def run(self, iteration: int, batches: Sequence, features: Sequence[dict]) -> Measured:
        sched = self._schedule
        if sched.steps != iteration:  # its executor numbers iterations by step: the durations' key
            raise RuntimeError(
                f"{self.name}: step {sched.steps} would run as iteration {iteration}"
            )
        sched.features = features
        t0 = time.perf_counter()
        # torch's blocking step; nothing else of this rank runs meanwhile
        sched.step(
            arg_mbs=[(x,) for x, _ in batches] if self._first else None,
            target_mbs=[y for _, y in batches] if self._last else None,
            return_outputs=False,
            cost_features=None if features is None else list(features),  # a plan's prices
        )
        wall = time.perf_counter() - t0
        self._module.zero_grad(set_to_none=True)
        res = sched.last_result
        st, plan = res.stats, res.plan
        waited = plan.waited_s if plan else 0.0
        return Measured(
            wall,
            st.peak_inflight,
            st.decision_us,
            plan and plan.plan.seconds,
            plan and plan.waited_s,
            plan and tuple(plan.plan.order),
            overhead_s=wall - st.wall - waited,
        )

    def close(self) -> None:
        self._schedule.close()


def held_peak(spans: Sequence[Span], share: float) -> float:
    """The most microbatches a rank held at once, from its task spans: each (torch stage,
    microbatch) from its F's start to its last backward's end, weighing ``share`` of the rank's
    layers (torch's ZB-V puts two half stages on a rank), so the count is in rrfp's unit, one
    stage's microbatch."""
    start: dict[tuple[int, str], float] = {}
    end: dict[tuple[int, str], float] = {}
    for sp in spans:
        key = (sp.stage, sp.name[1:])
        if sp.name[0] == "F":
            start[key] = sp.start
        else:
            end[key] = max(end.get(key, sp.end), sp.end)
    return round(
        peak_held((t, end.get(key, math.inf), share) for key, t in start.items()), 6
    )  # no B: still held
