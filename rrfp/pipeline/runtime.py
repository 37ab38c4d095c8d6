"""A rank's place in the pipeline: process group, layout and channels, created
eagerly and in the same order on every rank. Embedding drivers start here:

    async with PipelineRuntime.start(pp=4) as rt:
        pipe = rt.stage_executor(module, loss_fn, n_microbatches=8)
        result = await pipe.run_iteration(step, batches)

Leaving the block normally waits for every rank, then takes down the process
groups this runtime created; leaving it on an error, or after an abandoned
iteration (``abandoned``), only closes this rank's channels and lane (a dead
peer would hang a barrier; a pending transfer, a teardown).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import itertools
import logging
import os
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rrfp.comm import collectives
from rrfp.comm.agreement import TPAgreement
from rrfp.comm.channels import describe_failure, named_collective
from rrfp.comm.collective_wait import (
    BOUND,
    CollectiveWaits,
    Unreached,
    group_destroyed,
    stuck,
)
from rrfp.comm.device_ops import CudaOps
from rrfp.comm.ep_agreement import EPAgreement
from rrfp.comm.grad_norm import clip_grad_norm, clip_with_norm, local_share
from rrfp.comm.grad_sync import GradSync
from rrfp.comm.heartbeat import Heartbeat
from rrfp.comm.job_store import attempt, store_client
from rrfp.comm.loaded_class import DTENSOR, loaded_class
from rrfp.comm.nccl_groups import check_torch, configure_watchdog
from rrfp.comm.pipeline_channels import create_rank_channels
from rrfp.comm.stage_groups import create_stage_groups
from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.errors import PeerFailure, PeerSilent, PeerStuck, StartupError
from rrfp.core.hints import DEFAULT_HINT, Hint
from rrfp.core.layout import Layout, layout_for
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import DEFAULT_DISPATCH, Dispatch
from rrfp.core.variability import Variability
from rrfp.loop import CompletionPoller, make_lane
from rrfp.loop.blocking import in_daemon_thread, interruptible
from rrfp.nn.expert_parallel import ExpertParallel, expert_parameters, shard_experts
from rrfp.nn.tensor_parallel import sharded_parameters
from rrfp.observe.instrument import Instrument
from rrfp.pipeline.executor import StageExecutor
from rrfp.pipeline.layout_agreement import ExecutorShape, LayoutCheck
from rrfp.pipeline.nonfinite import NonFiniteGuard
from rrfp.pipeline.schedule_settings import (
    ScheduleSettings,
    resolve_weight_split,
    unsplit_stages_of,
)
from rrfp.pipeline.sharded_stages import ShardedStages, fsdp_modules
from rrfp.pipeline.task_collectives import TaskCollectives
from rrfp.pipeline.ties import Ties
from rrfp.pipeline.timeouts import BACKSTOP, DEFAULT_TIMEOUT_S, Timeouts
from rrfp.pipeline.worker import StageWorker
from rrfp.pipeline.wrapped import refuse_wrapped

_RUNTIMES = itertools.count()  # runtimes this process has built

log = logging.getLogger("rrfp.pipeline.runtime")


@contextlib.contextmanager
def _startup(owns: bool, world: int = 0, waited: str = ""):
    """A rendezvous, store or group-creation failure (a RuntimeError from torch) becomes one
    StartupError line naming this rank, not something that reads like a bug, and the ranks it
    waited for when torch's error tells them (``waited``: the bound, as the line says it)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, StartupError):
            raise
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        what = (
            "joining the process group"
            if owns and not dist.is_initialized()
            else "creating the process groups"
        )
        absent = _absent(str(e), world, waited) if owns and not dist.is_initialized() else None
        if absent is not None:
            raise StartupError(f"rank {rank}: start-up failed: {absent}") from e
        raise StartupError(f"rank {rank}: start-up failed while {what}{describe_failure(e)}") from e


_JOINED = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
_NO_STORE = re.compile(r"timed out after \d+ms while trying to connect to \(([^,]+), (\d+)\)")


def _absent(error: str, world: int, waited: str) -> str | None:
    """Who did not come to the rendezvous, from torch's error (torch 2.13's TCPStore): on the
    store's host (rank 0 under ``env://``) the count of ranks that joined, which names them when
    none did; on another rank, the store that never answered, rank 0's. None: not a missed
    rendezvous."""
    joined = _JOINED.search(error)
    if joined is not None:
        came, of = int(joined[1]), int(joined[2]) or world
        who = (
            (f"rank {of - 1}" if of == 2 else f"ranks 1-{of - 1}")
            if came <= 1
            else f"{of - came} of the {of} ranks (the store does not say which)"
        )
        return (
            f"{who} did not join the rendezvous within {waited}: stopped, hung, gone or never "
            "started"
        )
    store = _NO_STORE.search(error)
    if store is not None:
        return (
            f"rank 0's rendezvous store at {store[1]}:{store[2]} did not answer within {waited}: "
            "rank 0 is stopped, hung, gone or never started"
        )
    return None


def _attempt_store(world: int, timeout_s: float) -> dict:
    """Under torchrun's agent store, the process group's store keys of this attempt only.
    torch 2.13's torchrun keeps one store for every attempt of a job (its rendezvous shares
    one TCPStore server across rounds: torch/distributed/elastic/rendezvous/
    dynamic_rendezvous.py, next_rendezvous), and a worker joining with ``env://`` uses the
    same keys in each attempt: after ``--max-restarts`` restarted it, gloo read the dead
    attempt's addresses and failed to connect. Elsewhere: {} (init_process_group's own)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    return dict(
        store=dist.PrefixStore(f"rrfp/attempt-{attempt()}", store_client(timeout_s)),
        rank=int(os.environ["RANK"]),
        world_size=world,
    )


def _collective_bound(group_key: str, waits: Timeouts) -> datetime.timedelta:
    """How long a collective of the group ``group_key`` may wait once the heartbeat runs: the
    backstop, as the watcher bounds what waits on the loop, except TP's and EP's, which a task
    issues from the lane's thread, where no watcher sees it. Their members run the same task (TP)
    or one agreed class of task (EP) together, so a member that keeps the others waiting
    ``progress_s`` there is stuck: the waiting rank names it from its heartbeat
    (rrfp/pipeline/task_collectives.py)."""
    if group_key in ("tp", "ep"):
        return datetime.timedelta(seconds=waits.progress_s)
    return BACKSTOP


class PipelineRuntime:
    """Owns this rank's process group membership, channels and compute lane.

    ``async with PipelineRuntime.start(pp=4) as rt:`` under torchrun; then build
    this stage's module (``rt.stage`` of ``rt.num_stages``), get a StageExecutor
    with ``rt.stage_executor(...)`` and await ``run_iteration`` per step. With
    virtual stages (``start(virtual=2)``) the rank holds the stages ``rt.stages``
    of ``rt.num_stages`` (pp x V): build one module for each, in that order.
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        channels,
        timeouts: Timeouts,
        unit_s: float,
        lane,
        poller,
        groups: dict | None = None,
        owns_process_group: bool = False,
        device: torch.device = torch.device("cpu"),
        heartbeat: Heartbeat | None = None,
        virtual: VirtualLayout | None = None,
    ) -> None:
        self.layout, self.rank = layout, rank
        self.timeouts = timeouts  # each wait's bound
        coords = layout.coords(rank)
        self.virtual = virtual or VirtualLayout(
            layout.pp
        )  # which global stages each pipeline rank holds
        self.stages = self.virtual.stages_of(coords.pp)  # this rank's, in model order
        self.stage, self.num_stages = self.stages[0], self.virtual.num_stages
        self.channels = channels  # RankChannels: every stage's, ``of(stage)``
        self.tp_rank, self.dp_rank = coords.tp, coords.dp
        groups = groups or {}
        self.tp_group = groups.get("tp")  # the layers' TP collectives (on the lane)
        self.tp_control = groups.get("tp_control")  # TP agreement only
        self.dp_group = groups.get("dp")
        # expert parallelism (layout.ep > 1): the experts' all-to-alls, the EP agreement, and the
        # replicas holding the same experts
        self.ep_group = groups.get("ep")
        self.ep_control = groups.get("ep_control")
        self.expert_dp_group = groups.get("expert_dp")
        self.cpu_group = groups.get(
            "cpu"
        )  # control plane (stats, gather, barrier); None: the default group
        self._executors: list[
            StageExecutor
        ] = []  # closed with the runtime (their planning threads)
        self.poller = poller  # every collective's and NCCL message's Work is awaited through it
        self.lane = lane
        self.device = device
        self.unit_s = unit_s
        self.owns_process_group = owns_process_group  # finish() destroys only what start() created
        self.heartbeat = (
            heartbeat  # None: every wait is bounded by timeout_s, as the groups' timeout
        )
        self._watched: asyncio.Task | None = (
            None  # the task inside ``async with``, cancelled on silence
        )
        self._watcher: asyncio.Task | None = None
        # this rank's waits at collectives, bounded by progress_s while the peers beat
        self.collective_waits = CollectiveWaits(heartbeat) if heartbeat is not None else None
        self._bound: contextvars.Token | None = None
        self._ended: PeerFailure | None = None  # what the watcher cancelled the block for
        self._closed = False
        self._store = None  # a store client of its own: the executors' shapes (_layout_check)
        # this process's runtimes in order: the same on every rank, as starting one is collective
        self._serial = next(_RUNTIMES)
        # a stop abandoned an iteration: its P2P transfers may still be pending in the channels'
        # groups, so leaving the block only closes this rank's side (no barrier, no teardown); the
        # process then exits
        self.abandoned = False

    @classmethod
    def start(
        cls,
        *,
        pp: int = 0,
        tp: int = 1,
        dp: int = 1,
        ep: int = 1,
        layout: Layout | None = None,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        unit_ms: float = 0.0,
        heartbeat: bool = True,
        virtual: int = 1,
        placement: str = "interleaved",
        timeouts: Timeouts | None = None,
    ) -> PipelineRuntime:
        """Join (or reuse) the default process group and build every group and
        channel, eagerly and in one order on all ranks (docs/design.md).
        ``layout`` (already planned, e.g. by TrainConfig) replaces pp/tp/dp.
        ``virtual`` stages per pipeline rank, placed ``interleaved`` or ``v`` (VirtualLayout).

        ``backend = "nccl"``: this rank computes on ``cuda:LOCAL_RANK`` in a
        CUDA-stream lane, pipeline messages and DP sync go over NCCL (each
        communicator created and connected here, at start-up: nccl_groups.py),
        and the control plane (TP agreement, statistics, barrier) stays on gloo
        CPU groups, so that reading a decision never waits for the device.
        NCCL's watchdog gets a longer timeout than ``timeout_s``, rrfp's own
        deadline, which therefore fires first and names the peer.

        ``heartbeat`` (gloo, on by default): ``timeout_s`` bounds a peer's silence, not a wait.
        Every rank beats on the rendezvous store (rrfp/comm/heartbeat.py); a rank waits for a
        peer that beats however long its step takes, and names one silent for ``timeout_s`` (a
        PeerSilent raised in the ``async with`` block, or by ``watch``); one that beats but leaves
        a wait for its messages or at a collective unanswered for ``timeouts.progress_s`` with no
        progress of the job meanwhile is named too (a PeerStuck: rrfp/comm/collective_wait.py).
        Startup is still bounded by ``timeout_s``. ``heartbeat=False``: every wait is bounded by
        ``timeout_s`` instead.

        ``timeouts``: each of those waits apart (rrfp/pipeline/timeouts.py); by default all
        derive from ``timeout_s``."""
        waits = Timeouts.given(timeouts, timeout_s)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} is not supported (gloo or nccl)")
        device = torch.device("cpu")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("backend nccl needs CUDA, and this torch has none")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        owns = not dist.is_initialized()
        if owns:
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "no RANK/WORLD_SIZE in the environment: start the ranks with torchrun "
                    "(torchrun --nproc-per-node N -m rrfp train ...)"
                )
            world = int(os.environ["WORLD_SIZE"])
        else:
            world = dist.get_world_size()
        layout = layout or layout_for(world, pp, tp, dp, ep)  # fails before any group exists
        if layout.ep > 1 and layout.tp > 1:
            raise ValueError(
                f"{layout.short()}: expert parallelism with tensor parallelism is not supported; "
                "choose ep or tp"
            )
        if layout.world_size != world:
            raise ValueError(f"{layout.short()} does not match world size {world}")
        stages = VirtualLayout(layout.pp, virtual, placement)  # fails before any group exists
        pg_timeout_s = waits.process_group_s
        if backend == "nccl":
            check_torch()
            configure_watchdog(waits.peer_wait_s)  # before the NCCL process group exists
            pg_timeout_s = waits.nccl_watchdog_s
        # init_process_group's store waits as long as the group (env://)
        waited = waits.said("nccl_watchdog_s" if backend == "nccl" else "process_group_s")
        with _startup(owns, world, waited):
            if owns:
                # the rendezvous waits for every peer: off this thread, so that a stop signal acts
                # meanwhile
                interruptible(
                    lambda: dist.init_process_group(
                        backend,
                        timeout=datetime.timedelta(seconds=pg_timeout_s),
                        device_id=device if device.type == "cuda" else None,
                        **_attempt_store(world, waits.store_connect_s),
                    )
                )
            return cls._build(
                layout,
                device,
                backend,
                waits,
                unit_ms,
                owns,
                heartbeat=heartbeat and backend == "gloo",
                stages=stages,
            )

    @classmethod
    def _build(
        cls,
        layout: Layout,
        device: torch.device,
        backend: str,
        waits: Timeouts,
        unit_ms: float,
        owns: bool,
        *,
        ops=None,
        torch_module=None,
        heartbeat: bool = False,
        stages: VirtualLayout | None = None,
    ) -> PipelineRuntime:
        """Everything after the default group exists. ``ops`` and ``torch_module``: the CUDA calls
        of the channels and of the lane (tests pass a fake device, tests/harness/fake_cuda.py)."""
        rank = dist.get_rank()
        # NCCL's watchdog; gloo's groups detect dead peers in their process-group timeout
        pg_timeout_s = waits.nccl_watchdog_s if backend == "nccl" else waits.process_group_s
        poller = CompletionPoller()
        lane = make_lane(
            device,
            unit_ms / 1000.0,
            poller=poller,
            name=f"stage{layout.coords(rank).pp}",
            torch_module=torch_module,
        )
        if backend == "nccl":
            ops = ops or CudaOps(device)
        beat = (
            Heartbeat.connect(rank, layout.world_size, waits.heartbeat_s, waits.store_connect_s)
            if heartbeat
            else None
        )
        channels = create_rank_channels(
            layout,
            rank,
            datetime.timedelta(seconds=pg_timeout_s),
            stages=stages,
            device=device,
            poller=poller,
            compute_stream=getattr(lane, "stream", None),
            ops=ops,
            deadline_s=waits.peer_wait_s,
            wait=BACKSTOP if beat is not None else None,
        )
        groups = create_stage_groups(
            layout,
            rank,
            waits.process_group_s,
            backend,
            device,
            ops,
            nccl_timeout_s=waits.nccl_watchdog_s,
        )
        if beat is not None and not owns and "cpu" not in groups:
            # the caller's default group keeps its timeout: rrfp's control plane gets a group
            groups["cpu"] = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=waits.process_group_s)
            )
        if (
            beat is not None
        ):  # created with timeout_s (startup stays bounded); from now on silence is the beat's
            for key, group in [
                *([("world", None)] if owns else []),
                *groups.items(),
            ]:  # collectives only: p2p waits get it in Channel.wait
                dist.distributed_c10d._set_pg_timeout(_collective_bound(key, waits), group)
            beat.start()
        log.info(
            "rank %d is stage %d of %d (tp %d, dp %d)",
            rank,
            layout.coords(rank).pp,
            layout.pp,
            layout.coords(rank).tp,
            layout.coords(rank).dp,
        )
        if len(stages.stages_of(layout.coords(rank).pp)) > 1:
            log.info(
                "rank %d holds stages %s: %s",
                rank,
                stages.stages_of(layout.coords(rank).pp),
                stages.describe(),
            )
        return cls(
            layout,
            rank,
            channels,
            waits,
            unit_ms / 1000.0,
            lane,
            poller,
            groups=groups,
            owns_process_group=owns,
            device=device,
            heartbeat=beat,
            virtual=stages,
        )

    def stage_executor(
        self,
        module: torch.nn.Module | Sequence[torch.nn.Module],
        loss_fn,
        settings: ScheduleSettings | None = None,
        *,
        n_microbatches: int | None = None,
        dispatch: Dispatch | str = DEFAULT_DISPATCH,
        hint: Hint | str = DEFAULT_HINT,
        budget: Budget | str | int = DEFAULT_BUDGET,
        split: bool | None = None,
        variability: Variability | None = None,
        seed: int = 0,
        instrument: Instrument | None = None,
        cost=None,
        tied=None,
        on_nonfinite: str | None = "stop",
        dw_builder=None,
    ) -> StageExecutor:
        """This stage's executor, running ``settings`` (a ScheduleSettings: TrainConfig builds
        one). Without it, the keywords ``n_microbatches``, ``dispatch``, ``hint``, ``budget``,
        ``split``, ``variability``, ``seed`` and ``cost`` make one (``ScheduleSettings.of``:
        strings are accepted here, at the public edge); not both. With ``cost`` (a CostModel, e.g.
        from ``rrfp calibrate``), every ``run_iteration`` and ``prepare`` needs the
        microbatches' ``features``: without them it is a ValueError. With virtual stages,
        ``module`` is a list: one module for each of ``rt.stages``, in that order.

        ``tied``: parameters shared with other stages, ``{tie name: qualified parameter name}``
        (one dict looked up in each module, or a list of one per module); the copies are made
        equal here and their gradients summed after every iteration (rrfp/pipeline/ties.py).
        Collective: every rank calls it, in the same order, ties or not.


        ``on_nonfinite`` (a NaN or Inf in a loss or gradient, agreed by every rank after each
        iteration): "stop" raises NonFiniteError naming the stage and microbatch on every rank;
        "skip" sets every rank's ``.grad`` to None (``optimizer.step()`` then moves nothing) and
        marks the result ``skipped``; None checks nothing (rrfp/pipeline/nonfinite.py: its cost).

        ``dw_builder`` (torch's ``PipelineStage(dw_builder=)``; one callable, or a list of one or
        None per module): a stage whose custom autograd functions leave the weight gradients to a
        runner; ``dw_builder()`` builds the runner after each microbatch's B, which runs it as W
        (split backward) or at once (rrfp/pipeline/worker.py)."""
        guard = (
            None
            if on_nonfinite is None
            else NonFiniteGuard(
                on_nonfinite,
                self.rank,
                self.layout.world_size,
                lambda t: self.all_reduce(
                    t, dist.ReduceOp.MIN, "world all-reduce of the iteration's non-finite values"
                ),
            )
        )
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        if len(modules) != len(self.stages):
            raise ValueError(
                f"rank {self.rank} holds {len(self.stages)} stage(s) {self.stages}: pass one "
                f"module for each, got {len(modules)}"
            )
        for m in modules:
            refuse_wrapped(m, "PipelineRuntime.stage_executor")
        sharded = ShardedStages.of(
            modules, self.dp_ranks, "PipelineRuntime.stage_executor", self.expert_dp_group
        )
        if sharded is not None and any(tied if isinstance(tied, (list, tuple)) else [tied]):
            raise NotImplementedError(
                "PipelineRuntime.stage_executor: tied parameters (tied=) of FSDP-sharded stage "
                "modules are not supported"
            )
        if settings is None:
            if n_microbatches is None:
                raise TypeError("stage_executor needs settings= or n_microbatches=")
            settings = ScheduleSettings.of(
                n_microbatches,
                dispatch=dispatch,
                hint=hint,
                budget=budget,
                split=split,
                variability=variability,
                seed=seed,
                cost=cost,
            )
        elif n_microbatches is not None:
            raise TypeError("stage_executor takes settings= or its keywords, not both")
        microbatches, split = settings.n_microbatches, settings.split
        builders = (
            list(dw_builder)
            if isinstance(dw_builder, (list, tuple))
            else [dw_builder] * len(modules)
        )
        if len(builders) != len(modules):
            raise ValueError(
                f"rank {self.rank}: dw_builder is a list of {len(builders)}, one per module "
                f"({len(modules)}) expected"
            )
        weight_split = self._weight_split(settings.weight_split, split, sharded is not None)
        unsplit = unsplit_stages_of(settings.unsplit_stages, self.num_stages)
        if unsplit and self.unit_s:
            raise ValueError(
                "unsplit_stages with emulated time: the emulation draws a split W for every "
                "stage; run unsplit stages on real compute (unit_s = 0)"
            )
        workers = [
            StageWorker(
                m,
                s,
                self.num_stages,
                microbatches,
                loss_fn,
                split,
                measure_activations=settings.budget.bytes is not None,
                # a dw_builder's stage is split as torch splits it: auto leaves its module alone
                weight_split=(
                    "autograd"
                    if b is not None and settings.weight_split == "auto"
                    else weight_split
                ),
                dw_builder=b,
                whole=s in unsplit,
            )
            for m, s, b in zip(modules, self.stages, builders)
        ]
        agreement = (
            TPAgreement(
                self.tp_control,
                microbatches,
                self.poller,
                self.stages,
            )
            if self.tp_control is not None
            else None
        )
        moe_stages = [s for m, s in zip(modules, self.stages) if expert_parameters(m)]
        self._check_expert_groups(modules)
        ep_agreement = (
            EPAgreement(self.ep_control, moe_stages, self.poller, split)
            if self.ep_control is not None and moe_stages
            else None
        )
        if (
            ep_agreement is not None
            and settings.dispatch is Dispatch.FIXED
            and settings.hint.planned
        ):
            raise ValueError(
                "expert parallelism with dispatch fixed and hint plan: each replica plans its own "
                "order, so their all-to-alls would not pair; use dispatch ready"
            )
        ties = Ties.setup(self, modules, tied)
        v = self.virtual
        layout = f"{v.ranks} pipeline rank(s) x {v.virtual} stage(s) per rank ({v.placement})"
        ex = StageExecutor(
            workers,
            self.channels,
            self.lane,
            settings,
            self.rank,
            instrument,
            self.unit_s,
            agreement,
            stages=self.virtual,
            liveness=self.heartbeat,
            timeouts=self.timeouts,
            # the TP layers' collectives: a peer that never comes is named
            task_collectives=(
                TaskCollectives(self.rank, self.heartbeat, self._tp_bound())
                if self.layout.tp > 1 or ep_agreement is not None
                else None
            ),
            ties=ties if ties.ties else None,
            nonfinite=guard,
            sharded=sharded,
            layout_check=self._layout_check(ExecutorShape(microbatches, self.num_stages, layout)),
            ep_agreement=ep_agreement,
        )
        self._executors.append(ex)
        return ex

    def _weight_split(self, chosen: str, split: bool, sharded: bool) -> str:
        """The StageWorker mode of this rank's stages for ``chosen`` (ScheduleSettings'
        weight_split), logged with why when the backward is split."""
        wider = [
            name
            for name, on in (
                (f"parallel.tp = {self.layout.tp}", self.layout.tp > 1),
                ("FSDP-sharded stages (parallel.dp_shard)", sharded),
                (f"parallel.ep = {self.layout.ep}", self.layout.ep > 1),
            )
            if on
        ]
        mode, why = resolve_weight_split(chosen, wider)
        if split:
            log.info("rank %d: weight_split %s (%s)", self.rank, mode, why)
        return mode

    def _layout_check(self, shape: ExecutorShape) -> LayoutCheck | None:
        """The check that every rank's n-th executor has ``shape``, on a store client of the
        runtime's own; None with one rank, or without the job's store (ranks started without
        MASTER_ADDR)."""
        if self.layout.world_size == 1:
            return None
        if self._store is None:
            try:
                self._store = store_client(self.timeouts.store_connect_s)
            except (KeyError, ValueError, RuntimeError) as e:
                log.info("rank %d: the executors' shapes go unchecked: %s", self.rank, e)
                return None
        prefix = f"rrfp/executor-shape/{attempt()}/{self._serial}/{len(self._executors)}"
        return LayoutCheck(self._store, prefix, self.rank, self.layout.world_size, shape)

    def _tp_bound(self) -> str:
        """The TP group's timeout as a line says it: ``_collective_bound``'s with a heartbeat,
        the process group's (NCCL's watchdog) without."""
        if self.heartbeat is not None:
            return self.timeouts.said("progress_s")
        return self.timeouts.said(
            "nccl_watchdog_s" if self.device.type == "cuda" else "process_group_s"
        )

    def _check_expert_groups(self, modules) -> None:
        """Experts sharded over another group than this rank's EP group would issue all-to-alls
        the EP agreement does not order: refused with the groups named."""
        want = self.layout.ep_groups()
        mine = next((g for g in want if self.rank in g), [self.rank])
        for m, s in zip(modules, self.stages):
            for name, layer in m.named_modules():
                ranks = getattr(layer, "ranks", None)
                if isinstance(layer, ExpertParallel) and ranks != mine:
                    raise ValueError(
                        f"rank {self.rank}: stage {s}'s {name} shards its experts over ranks "
                        f"{ranks}, but this rank's EP group ({self.layout.short()}) is {mine}: "
                        "shard them with rt.shard_experts(module) (ScheduleReady: over "
                        "mesh['ep'].get_group())"
                    )

    def shard_experts(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with the routed experts of its MoE layers sharded over this rank's EP group
        (rrfp/nn/expert_parallel.py), in place; unchanged without expert parallelism. Call it on
        every stage module before ``stage_executor`` and the optimizer."""
        if self.ep_group is not None:
            shard_experts(module, self.ep_group)
        return module

    @property
    def ep_rank(self) -> int | None:
        """This rank's place in its EP group (its experts), or None without expert parallelism."""
        return self.dp_rank % self.layout.ep if self.layout.ep > 1 else None

    @property
    def dp_ranks(self) -> list[int]:
        """This stage's data-parallel replicas (this rank among them), in replica order."""
        c = self.layout.coords(self.rank)
        return [self.layout.rank_of(c.pp, c.tp, d) for d in range(self.layout.dp)]

    def grad_sync(self, module: torch.nn.Module, executor: StageExecutor | None = None) -> GradSync:
        """Averages gradients over this stage's DP replicas; a no-op when dp = 1.
        With ``executor``, each bucket's all-reduce starts inside the iteration,
        as soon as its gradients are final. Not for FSDP-sharded modules: FSDP reduce-scatters
        their gradients itself (rrfp/pipeline/sharded_stages.py)."""
        if fsdp_modules([module]):
            raise ValueError(
                "grad_sync: the module is FSDP-sharded (fully_shard): its gradients are "
                "reduce-scattered over the replicas after every iteration already; averaging "
                "them again with grad_sync would be wrong"
            )
        sync = GradSync(
            module,
            self.dp_group,
            self.layout.dp,
            self.poller,
            self.lane,
            deadline_s=self.timeouts.cuda_deadline_s if self.device.type == "cuda" else None,
            experts=expert_parameters(module),
            expert_group=self.expert_dp_group,
        )
        if executor is not None:
            sync.attach(executor)
        return sync

    def _norm_parameters(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """(counted, held): the parameters whose gradients this rank adds to the whole model's norm
        (each parameter of the model counted by exactly one rank: TP and FSDP shards by their
        parts, a TP-replicated one and a tie once, DP replicas once), and every one it holds."""
        counts, scaled, seen, dtensor = [], [], set(), loaded_class(DTENSOR)
        for ex in self._executors:
            uncounted = ex.ties.uncounted if ex.ties is not None else set()
            for w in ex.workers:
                sharded = sharded_parameters(w.module)
                # an expert shard is counted by the first replica holding it (its EP group's)
                experts = expert_parameters(w.module)
                for p in w.module.parameters():
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    scaled.append(p)
                    if (
                        (
                            self.dp_rank == 0
                            or isinstance(p, dtensor)  # an FSDP shard: every one
                            or (id(p) in experts and self.dp_rank < self.layout.ep)
                        )
                        and id(p) not in uncounted
                        and (self.tp_rank == 0 or id(p) in sharded)
                    ):
                        counts.append(p)
        return counts, scaled

    def grad_norm_share(self, norm_type: float = 2.0) -> float:
        """This rank's part of the whole model's gradient norm: the sum of |g|^p over the gradients
        it counts (max |g| for ``inf``). Summed over the world (max for ``inf``) and taken to the
        1/p, it is the norm ``clip_grad_norm_`` finds; ``rrfp train`` adds it to the step's one
        statistics all-reduce, so the norm costs no collective of its own."""
        return local_share(self._norm_parameters()[0], float(norm_type)).item()

    def clip_grads_with_norm_(self, max_norm: float, total: float) -> None:
        """Clip every gradient this rank holds to ``max_norm`` by ``total``, the whole model's norm
        already summed over the world (``grad_norm_share``): no collective."""
        clip_with_norm(self._norm_parameters()[1], max_norm, total)

    async def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients of the whole model (every stage of every rank) to ``max_norm`` by
        their total ``norm_type`` norm, and return that norm, the same on every rank: each parameter
        counted once (TP and FSDP shards by their parts, a TP-replicated one and a tie once, DP
        replicas once), over the modules of every executor this runtime made. Collective: every
        rank calls it. Call it after the DP gradient sync (``rrfp train`` and ``grad_sync(module,
        executor)`` do it inside the iteration, finished by ``sync()``), or the replicas' norms
        differ. A non-finite norm is returned and not applied: the gradients stay as they are."""
        counts, scaled = self._norm_parameters()
        return await clip_grad_norm(
            self.poller,
            counts,
            scaled,
            max_norm,
            norm_type,
            self.cpu_group,
            what=f"gradient norm (ranks 0-{self.layout.world_size - 1})",
        )

    async def all_reduce(
        self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "world all-reduce"
    ) -> torch.Tensor:
        """A world all-reduce, awaited through the poller; a failure names ``what``."""
        return await collectives.all_reduce(
            self.poller,
            tensor,
            f"{what} (ranks 0-{self.layout.world_size - 1})",
            op,
            self.cpu_group,
        )

    async def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        gathered = await collectives.all_gather_object(
            self.poller, obj, "world gather of objects", self.cpu_group
        )
        return gathered if self.rank == 0 else None

    async def finish(self) -> None:
        """Clean end of a run: wait for every rank, close, then take down the
        process groups if this runtime created them. A rank that tears down gloo
        pairs while a peer still uses them makes gloo abort that peer, so nobody
        leaves before everybody is done. Not for error paths: a dead peer would
        fail the barrier only after the process-group timeout. After the caller took the groups
        down itself (``destroy_process_group``), there is nothing to wait with: it closes."""
        if group_destroyed(self.cpu_group):
            log.warning(
                "rank %d: the process group was destroyed before the runtime finished: closing "
                "without the final barrier (destroy it after close())",
                self.rank,
            )
            await self.aclose()
            return
        if not self.owns_process_group:
            await collectives.completed(
                self.poller,
                dist.barrier(self.cpu_group, async_op=True),
                "final barrier of every rank",
                group=self.cpu_group,
            )
            await self.aclose()
            return
        await self._close_work()
        # Taking the groups down: a blocking barrier (off the loop thread), so that no rank closes
        # its gloo pairs while a peer's async barrier is still finishing its last exchange on them.
        with named_collective("final barrier of every rank", self.cpu_group):
            await in_daemon_thread(dist.barrier, self.cpu_group)
        self._stop_watching()  # before the store (rank 0's, without torchrun) goes with the group
        dist.destroy_process_group()

    async def __aenter__(self) -> PipelineRuntime:
        if self.heartbeat is not None:
            self._bound = BOUND.set(self.collective_waits)
            self._watched = asyncio.current_task()
            self._watcher = asyncio.create_task(self._watch(), name="rrfp-heartbeat-watch")
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and not self.abandoned:
                await self.finish()
            else:
                await self.aclose()
        except asyncio.CancelledError:
            if self._ended is None:
                raise
        finally:
            self._stop_watching()
            if self._bound is not None:
                BOUND.reset(self._bound)
                self._bound = None
        if self._ended is not None:  # the block was cancelled for it (as asyncio.timeout does)
            self._watched.uncancel()
            await self.aclose()
            raise self._ended from None

    async def watch(self, awaitable):
        """``await awaitable``, ended by PeerSilent once the heartbeat finds a peer silent for
        ``timeout_s``, or by PeerStuck once it waited at a collective for ``progress_s`` that
        a peer never reached: what ``async with`` does for its block, for a caller that awaits the
        runtime's work piece by piece (ScheduleReady). Without a heartbeat, just the await."""
        hb = self.heartbeat
        if hb is None:
            return await awaitable
        bound = BOUND.set(self.collective_waits)
        try:
            task = asyncio.ensure_future(awaitable)  # its collectives are bounded (a context copy)
        finally:
            BOUND.reset(bound)
        while True:
            done, _ = await asyncio.wait([task], timeout=hb.period_s)
            if done:
                return task.result()
            ended = self._verdict()
            if ended is not None:
                task.cancel()
                await asyncio.wait([task])
                self._ended = ended
                log.info("%s", ended)
                raise ended

    def _verdict(self) -> PeerFailure | None:
        """Why the watched work must end now: a peer (or the store) silent, or a collective that a
        peer has not reached for ``progress_s`` of no progress; None: it goes on."""
        found = self.heartbeat.check()
        if found is not None:
            return self._silent(found)
        late = self.collective_waits.overdue(self.timeouts.progress_s)
        return self._unreached(late) if late is not None else None

    def _unreached(self, late: Unreached) -> PeerStuck:
        """The line for a collective that the ``absent`` peers never reached."""
        bound = self.timeouts.said("progress_s")
        return stuck(self.rank, self.heartbeat, late, bound, " with no progress of the job")

    def _silent(self, found) -> PeerSilent:
        """The PeerSilent that names what the heartbeat found silent (a peer, or the store)."""
        hb = self.heartbeat
        if found.rank is None and found.closed:  # the store in torchrun's agent
            return PeerSilent(
                f"rank {self.rank}: {hb.where} closed its connection ({found.closed}): the agent "
                "is gone, so this job cannot go on: stopping now",
                None,
            )
        if found.rank is None:
            return PeerSilent(
                f"rank {self.rank}: {hb.where} stopped answering: no heartbeat read for "
                f"{found.seconds:.1f} s ({self._silence_key()}): "
                f"{'it is' if hb.host is None else f'rank {hb.host} is'} stopped, hung or gone",
                hb.host,
            )
        return PeerSilent(
            f"rank {self.rank}: rank {found.rank} went silent: no heartbeat for "
            f"{found.seconds:.1f} s ({self._silence_key()}): it is stopped, hung or "
            "cut off",
            found.rank,
        )

    def _silence_key(self) -> str:
        """How a silent peer's line names the heartbeat timeout: the key that set it, its value."""
        return f"{self.timeouts.key('heartbeat_s')} = {self.timeouts.heartbeat_s:g}"

    async def _watch(self) -> None:
        """Ask the heartbeat every beat; on a silent peer, or a collective a peer never reached,
        cancel the block with that PeerSilent or PeerStuck as the cause. On the loop: while this
        rank computes, nothing of it waits for a peer."""
        hb = self.heartbeat
        while True:
            await asyncio.sleep(hb.period_s)
            ended = self._verdict()
            if ended is None:
                continue
            self._ended = ended
            log.info("%s", ended)
            self._watched.cancel()
            return

    def _stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.heartbeat is not None:
            self.heartbeat.close()

    async def aclose(self) -> None:
        """Close the executors, the poller, the lane and the channels, and stop the heartbeat: its
        thread and beating process end here, so a process that builds runtime after runtime (a
        notebook, a driver) keeps nothing of a closed one but what the process group holds."""
        await self._close_work()
        self._stop_watching()

    async def _close_work(self) -> None:
        """What ``aclose`` ends but the heartbeat, which watches ``finish``'s final barrier."""
        if self._closed:
            return
        self._closed = True
        for ex in self._executors:
            ex.close()
        await self.poller.aclose()
        self.lane.close()
        await self.channels.aclose()
