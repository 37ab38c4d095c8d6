"""torch.distributed.pipelining schedules as anchors, on rrfp's model, data and emulated durations.

``rrfp bench`` compares rrfp's executors with torch's own schedules. Each rank
builds a :class:`TorchScheduleRunner` over the same stage modules (built by the
workload from the same seed) and calls ``run_iteration`` with the same
microbatches and the same emulated durations as an rrfp executor would get.

Emulated device time mirrors the CPU compute lane (``rrfp/loop/lane.py``): a
task's real compute runs first, then the rank sleeps off the rest of
``units * unit_s``; a task whose compute alone took longer does not sleep.
Torch calls a stage's ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` once per (stage, microbatch) with the microbatch
index as the chunk id, in every schedule; :class:`_TimedStage` overrides those
three to time and hold each task, so the microbatch index needs no tensor of
its own. The last stage's F ends after the loss, as in rrfp's worker.

Microbatches vary in length, but torch receives into buffers of one shape,
fixed when the schedule first runs. Every stage boundary therefore travels in
an envelope (:class:`_Envelope`): the stage's outputs flattened into one float
payload of fixed ``capacity`` elements, zero-padded, plus a small int64 header
with their shapes and dtypes. Integer and bool outputs (a mask, lengths) travel
in the payload as float values, refused unless the payload dtype holds them
exactly. The receiving stage unpacks views of the payload, so the
model computes on exactly the tensors rrfp's stage gets and gradients flow
back through the views unchanged.

Link latency, as rrfp's senders add it: a stage's sends to another rank go to
one FIFO thread per peer, which issues them ``latency * unit_s`` after the
task ends; torch then has no send of its own to wait on. ``run_iteration``
drives the schedule through ``_step_microbatches`` (what ``step()`` calls
after splitting one batch, which variable-length microbatches cannot be);
checked against torch 2.13.

Expert parallelism: ``prepare`` shards each of the rank's stage modules (not the capacity
probe's copies, which compute alone) over the rank's EP group. Every replica runs the schedule's
one fixed order, so the members' all-to-alls pair. With ``experts`` the MoE layers spend their
routed time on a clock (rrfp/nn/expert_time.py) as under rrfp's lane.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

import rrfp.loop.exit_guard  # noqa: F401 - at exit, waits for a sender to leave its wait
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind
from rrfp.nn.expert_parallel import ExpertParallel
from rrfp.nn.expert_time import ExpertClock, ExpertTimes, clocked
from rrfp.nn.moe_aux_loss import aux_loss_scale
from rrfp.observe.trace import Span

log = logging.getLogger("rrfp.app.bench.torch_schedules")

# name -> (torch schedule class name, stages per rank, the rrfp placement that numbers its stages as
# torch does: interleaved r, r + w; v r, 2w - 1 - r (rrfp.core.placement), split backward)
SCHEDULES: dict[str, tuple[str, int, str, bool]] = {
    "1f1b": ("Schedule1F1B", 1, "interleaved", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "interleaved", False),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v", True),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "interleaved", True),
    "dualpipev": ("ScheduleDualPipeV", 2, "v", True),
}
ALIASES = {"zb": "zbv"}  # torch's best zero-bubble schedule that runs here (see docs/design.md)

_MAX_TENSORS = 8  # tensors (or None) one stage boundary may carry
_MAX_DIMS = 6
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,  # index = the header's dtype code
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_HEADER = 2 + _MAX_TENSORS * (
    2 + _MAX_DIMS
)  # [is tuple, count, then per entry: ndim, dtype, dims...]


def resolve_schedule(name: str) -> str:
    """The canonical schedule name; ValueError lists the choices."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULES:
        raise ValueError(
            f"unknown torch schedule {name!r} (choose from {', '.join([*SCHEDULES, *ALIASES])})"
        )
    return key


def placement_of(schedule: str) -> str:
    """The rrfp placement (rrfp.core.placement) that numbers ``schedule``'s stages as torch does."""
    return SCHEDULES[resolve_schedule(schedule)][2]


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages per rank under ``schedule`` (the model must split into world x this)."""
    return SCHEDULES[resolve_schedule(schedule)][1]


def workload_stage_builder(
    workload, model_cfg, seed: int = 0
) -> Callable[[int, int], torch.nn.Module]:
    """``(stage, num_stages) -> module`` seeded as ``rrfp train`` seeds it: the same parameters."""

    def build(stage: int, num_stages: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return workload.build_stage(model_cfg, stage, num_stages, None)

    return build


# -- the envelope: variable shapes through torch's fixed-shape buffers -------------------------


class _Envelope(torch.nn.Module):
    """A stage module sending its boundary as (payload [capacity], int64 header [_HEADER])."""

    def __init__(
        self,
        inner: torch.nn.Module,
        is_first: bool,
        is_last: bool,
        capacity: int,
        dtype: torch.dtype,
        stage: int,
    ) -> None:
        super().__init__()
        self.inner, self.is_first, self.is_last = inner, is_first, is_last
        self.capacity, self.dtype, self.stage = capacity, dtype, stage

    def forward(self, *args):
        x = args[0] if self.is_first else unpack(*args)
        out = self.inner(x)
        return out if self.is_last else pack(out, self.capacity, self.dtype, self.stage)


def pack(
    out, capacity: int, dtype: torch.dtype, stage: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor, or a tuple/list of tensors and None, as (payload, header); differentiable in the
    floating tensors."""
    entries = list(out) if isinstance(out, (tuple, list)) else [out]
    if not entries or len(entries) > _MAX_TENSORS:
        raise RuntimeError(
            f"stage {stage}: a boundary carries 1 to {_MAX_TENSORS} tensors, got {len(entries)}"
        )
    h = [0] * _HEADER  # built in Python, one tensor at the end: this runs for every F and B sent
    h[0], h[1] = int(isinstance(out, (tuple, list))), len(entries)
    flat, total = [], 0
    for i, t in enumerate(entries):
        at = 2 + i * (2 + _MAX_DIMS)
        if t is None:
            h[at] = -1
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise RuntimeError(
                f"stage {stage}: boundary entry {i} must be None or a floating, integer or bool "
                f"tensor of at most {_MAX_DIMS} dims, got {type(t).__name__} "
                f"{getattr(t, 'dtype', '')}"
            )
        h[at], h[at + 1] = t.dim(), _DTYPES.index(t.dtype)
        h[at + 2 : at + 2 + t.dim()] = t.shape
        flat.append(t.reshape(-1).to(dtype))
        if not t.is_floating_point() and not torch.equal(flat[-1].to(t.dtype), t.reshape(-1)):
            raise RuntimeError(
                f"stage {stage}: boundary entry {i} ({t.dtype}) holds values that the {dtype} "
                f"payload cannot carry exactly"
            )
        total += t.numel()
    if total > capacity:
        raise RuntimeError(
            f"stage {stage}: its outputs have {total} elements, more than the envelope's capacity "
            f"{capacity}; pass a larger capacity to TorchScheduleRunner (or None to probe)"
        )
    payload = torch.cat(flat + [torch.zeros(capacity - total, dtype=dtype)])
    return payload, torch.tensor(h, dtype=torch.int64)


def unpack(payload: torch.Tensor, header: torch.Tensor):
    """What ``pack`` packed, as views of ``payload`` (so gradients reach it)."""
    h = header.tolist()
    entries, offset = [], 0
    for i in range(h[1]):
        at = 2 + i * (2 + _MAX_DIMS)
        if h[at] < 0:
            entries.append(None)
            continue
        shape = h[at + 2 : at + 2 + h[at]]
        n = math.prod(shape)
        entries.append(payload[offset : offset + n].view(shape).to(_DTYPES[h[at + 1]]))
        offset += n
    return tuple(entries) if h[0] else entries[0]


def boundary_numel(out) -> int:
    """Elements a stage output puts in the envelope's payload."""
    entries = list(out) if isinstance(out, (tuple, list)) else [out]
    return sum(t.numel() for t in entries if isinstance(t, torch.Tensor))


def probe_capacity(
    build_stage: Callable[[int, int], torch.nn.Module],
    num_stages: int,
    batches: Sequence[tuple[Any, Any]],
    modules: list[torch.nn.Module] | None = None,
) -> int:
    """The largest stage-boundary payload (elements) over ``batches``, from a local no-grad forward
    through every stage. ``modules``: stages built before, reused (shapes do not depend on
    weights)."""
    most = 0
    with torch.random.fork_rng(), torch.no_grad():  # the caller's random stream stays untouched
        modules = (
            modules
            if modules is not None
            else [build_stage(k, num_stages) for k in range(num_stages)]
        )
        for x, _ in batches:
            for module in modules[:-1]:
                x = module(x)
                most = max(most, boundary_numel(x))
    return max(1, most)


# -- link latency: sends held back, as rrfp's senders hold them ------------------------------


class _DelayedSends:
    """Sends that leave after their emulated link latency: one FIFO thread per peer rank, as
    rrfp has one sender per channel. Order per peer is kept, which is all gloo's matching needs."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def post(self, peer: int, due: float, ops: list) -> None:
        q = self._queues.get(peer)
        if q is None:
            q = self._queues[peer] = queue.Queue()
            thread = threading.Thread(
                target=self._run, args=(q,), name=f"rrfp-torch-send-{peer}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        q.put((due, ops))

    def _run(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                due, ops = item
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                # as torch's _batch_p2p issues a batch of sends, then wait (gloo completes in wait)
                works = [
                    op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                    for op in ops
                ]
                for w in works:
                    w.wait()
            except BaseException as e:  # surfaces in flush(), on the schedule's thread
                self._errors.append(e)
            finally:
                q.task_done()

    def flush(self) -> None:
        """Wait until every posted send has left and completed."""
        for q in list(self._queues.values()):
            q.join()
        if self._errors:
            raise RuntimeError(
                f"a delayed pipeline send failed: {self._errors[0]}"
            ) from self._errors[0]

    def close(self) -> None:
        """End the sender threads once their queues are empty."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()


# -- timing: the lane's hold, per task ------------------------------------------------------


@dataclass
class _Clock:
    """One iteration's emulation state, shared by this rank's stages and the loss."""

    rank: int
    unit_s: float
    share: float  # fraction of this rank's rrfp stage work one torch stage does
    split: bool
    t0: float = 0.0
    units: Callable[[int, int, Kind], float] | None = None
    latency: Callable[[int, int, Kind], float] | None = None
    sends: _DelayedSends = field(default_factory=_DelayedSends)
    spans: list[Span] = field(default_factory=list)
    loss_tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    # last stage: F waits for its loss (its start, and its MoE layers' clock)
    forward_started: dict[int, tuple[float, ExpertClock | None]] = field(default_factory=dict)

    by_stage: bool = (
        False  # units and latency asked with torch's stage index (a local stage's own), share 1
    )
    experts: ExpertTimes | None = None  # the MoE layers' routed time (expert-parallel stages)
    expert_layers: dict[int, int] = field(default_factory=dict)  # torch stage -> its EP layers
    means: tuple[float, float, float] = (1.0, 1.0, 1.0)  # F, B, W at their mean, in units
    # what a microbatch's loss is scaled by (1 / M): the MoE layers' auxiliary losses get it too,
    # as under rrfp's stage worker (rrfp/nn/moe_aux_loss.py)
    loss_scale: float = 1.0

    def expert_clock(self, stage: int, kinds: tuple[Kind, ...]) -> ExpertClock | None:
        """The clock of one task of ``stage`` holding ``kinds``, or None (nothing routed)."""
        layers = self.expert_layers.get(stage, 0)
        if self.experts is None or not self.unit_s or not layers:
            return None
        share = 1.0 if self.by_stage else self.share
        mean = sum(self.means[k] for k in kinds) * share
        return ExpertClock(self.experts, mean * self.unit_s, layers)

    def duration(self, stage: int, mb: int, kinds: tuple[Kind, ...]) -> float:
        if not self.unit_s or self.units is None:
            return 0.0
        if self.by_stage:
            return sum(self.units(stage, mb, k) for k in kinds)
        return sum(self.units(self.rank, mb, k) for k in kinds) * self.share

    def hold(
        self,
        stage: int,
        name: str,
        mb: int,
        start: float,
        kinds: tuple[Kind, ...],
        clock: ExpertClock | None = None,
    ) -> None:
        """Wait out the task's emulated time left (as ComputeLane._hold_lane); record its span."""
        drawn = self.duration(stage, mb, kinds) * self.unit_s
        held = drawn if clock is None else clock.held_s(drawn)
        remaining = start + held - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.spans.append(
            Span(
                f"rank {self.rank}",
                stage,
                f"{name}{mb}",
                start - self.t0,
                time.perf_counter() - self.t0,
            )
        )

    def delay(self, ops: list, stage: int, mb: int, kind: Kind) -> list:
        """Hand ``ops`` (sends of one task) to the delayed senders; torch gets none to issue."""
        if not ops or not self.unit_s or self.latency is None:
            return ops
        due = (
            time.perf_counter()
            + self.latency(stage if self.by_stage else self.rank, mb, kind) * self.unit_s
        )
        by_peer: dict[int, list] = {}
        for op in ops:
            by_peer.setdefault(op.peer, []).append(op)
        for peer, mine in by_peer.items():
            self.sends.post(peer, due, mine)
        return []


class _TimedStage(PipelineStage):
    """torch's PipelineStage, holding each F, B and W for its emulated time."""

    clock: _Clock

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        start = time.perf_counter()
        experts = self.clock.expert_clock(self.stage_index, (Kind.F,))
        with clocked(experts), aux_loss_scale(self.clock.loss_scale):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.is_last:
            self.clock.forward_started[fwd_chunk_id] = (start, experts)  # the loss ends this F
        else:
            self.clock.hold(self.stage_index, "F", fwd_chunk_id, start, (Kind.F,), experts)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        start = time.perf_counter()
        # a full backward inside a split schedule does B and W at once
        kinds = (Kind.B, Kind.W) if full_backward and self.clock.split else (Kind.B,)
        experts = self.clock.expert_clock(self.stage_index, kinds)
        with clocked(experts):
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        self.clock.hold(self.stage_index, "B", bwd_chunk_id, start, kinds, experts)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        start = time.perf_counter()
        experts = self.clock.expert_clock(self.stage_index, (Kind.W,))
        with clocked(experts):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.clock.hold(self.stage_index, "W", bwd_chunk_id, start, (Kind.W,), experts)

    # sends to a stage on another rank leave after the emulated latency (same-rank hand-offs send
    # nothing)
    def get_fwd_send_ops(self, fwd_chunk_id):
        return self.clock.delay(
            super().get_fwd_send_ops(fwd_chunk_id), self.stage_index, fwd_chunk_id, Kind.F
        )

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self.clock.delay(
            super().get_bwd_send_ops(bwd_chunk_id), self.stage_index, bwd_chunk_id, Kind.B
        )


@dataclass(frozen=True)
class _Target:
    """A microbatch's targets with its index: torch hands the target to the loss untouched."""

    targets: Any
    mb: int


class _ScaledLoss:
    """The workload's loss divided by M, as rrfp's last stage backpropagates it; ends the last F."""

    def __init__(self, loss_fn, n_microbatches: int, clock: _Clock, last_stage: int) -> None:
        self.loss_fn, self.M, self.clock, self.last_stage = (
            loss_fn,
            n_microbatches,
            clock,
            last_stage,
        )

    def __call__(self, output, target: _Target) -> torch.Tensor:
        loss = self.loss_fn(output, target.targets)
        self.clock.loss_tensors[target.mb] = loss.detach()
        scaled = loss / self.M
        start, experts = self.clock.forward_started.pop(target.mb)
        self.clock.hold(self.last_stage, "F", target.mb, start, (Kind.F,), experts)
        return scaled


# -- the runner ----------------------------------------------------------------------------


@dataclass
class TorchIterationResult:
    iteration: int
    wall_s: float  # this rank, from entering run_iteration to the end of its last task and send
    losses: dict[int, float]  # unscaled per-microbatch losses; last stage's rank only
    spans: list[Span]  # one per task; stage = torch's stage index, times relative to start
    start: float  # time.perf_counter() at the start (one clock for every process on a machine)

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) / len(self.losses) if self.losses else None


class TorchScheduleRunner:
    """One rank's torch.distributed.pipelining schedule over a Workload's stage modules.

    ``schedule``: ``"1f1b"`` (Schedule1F1B, one stage per rank), ``"zb"`` (torch's best
    zero-bubble schedule that runs here, ``"zbv"``), ``"zbv"``, ``"interleaved-1f1b"``,
    ``"interleaved-zb"`` or ``"dualpipev"`` (two stages per rank: the model splits into ``2 *
    world`` stages).

    ``units(stage, mb, kind)`` gives emulated durations in rrfp's numbering: ``stage`` is this
    rank's rrfp stage (its rank), ``kind`` B is the whole backward when ``self.split`` is False
    (as rrfp's executor asks with split=False); each of a rank's torch stages holds
    ``1 / stages_per_rank`` of it, so a rank's emulated work per microbatch equals rrfp's.

    ``capacity``: elements of the stage-boundary envelope; None probes each iteration's
    microbatches locally with every stage (cheap for small models) and rebuilds when it grows.

    ``prepare(module)``: applied to each of this rank's stage modules (the experts sharded over
    the EP group); ``group`` is then this replica's pipeline. ``experts``: the MoE layers' routed
    time, each kind's mean ``means`` (F, B, W) in units.
    """

    def __init__(
        self,
        schedule: str,
        build_stage: Callable[[int, int], torch.nn.Module],
        loss_fn,
        rank: int,
        world: int,
        n_microbatches: int,
        unit_s: float,
        group=None,
        capacity: int | None = None,
        dtype: torch.dtype | None = None,
        prepare: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        experts: ExpertTimes | None = None,
        means: tuple[float, float, float] = (1.0, 1.0, 1.0),
    ) -> None:
        self.schedule = resolve_schedule(schedule)
        cls_name, per_rank, placement, self.split = SCHEDULES[self.schedule]
        self._cls = getattr(torch_schedules, cls_name, None)
        if self._cls is None:
            raise ValueError(f"this torch ({torch.__version__}) has no {cls_name}")
        if dist.is_initialized() and (dist.get_rank(group), dist.get_world_size(group)) != (
            rank,
            world,
        ):
            raise ValueError(
                f"rank {rank} of {world} does not match the process group "
                f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
            )
        self.rank, self.world, self.M, self.unit_s, self.group = (
            rank,
            world,
            n_microbatches,
            unit_s,
            group,
        )
        self.num_stages, self.per_rank = world * per_rank, per_rank
        self.layout = VirtualLayout(
            world, per_rank, placement
        )  # torch's stage numbering, in rrfp's terms
        self.stage_indices = tuple(self.layout.stages_of(rank))
        self.build_stage, self.loss_fn = build_stage, loss_fn
        self.dtype = dtype or torch.get_default_dtype()
        self.modules = [build_stage(k, self.num_stages) for k in self.stage_indices]
        if prepare is not None:  # e.g. the experts sharded over the EP group
            self.modules = [prepare(m) for m in self.modules]
        self.clock = _Clock(rank, unit_s, 1.0 / per_rank, self.split)
        self.clock.experts, self.clock.means = experts, means
        self.clock.loss_scale = 1.0 / n_microbatches
        self.clock.expert_layers = {
            k: sum(isinstance(x, ExpertParallel) for x in m.modules())
            for k, m in zip(self.stage_indices, self.modules)
        }
        self.capacity = capacity
        self._fixed_capacity = capacity is not None
        self._probe_modules: list[torch.nn.Module] | None = None
        self._schedule_obj = None
        self._stages: list[_TimedStage] = []

    def parameters(self):
        """Every parameter of this rank's stages (for the caller's optimizer)."""
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        for m in self.modules:
            yield from m.named_parameters()

    def _build_schedule(self, capacity: int) -> None:
        stages = []
        for k, module in zip(self.stage_indices, self.modules):
            first, last = k == 0, k == self.num_stages - 1
            env = _Envelope(module, first, last, capacity, self.dtype, k)
            boundary = (
                torch.empty(capacity, dtype=self.dtype, requires_grad=True),
                torch.empty(_HEADER, dtype=torch.int64),
            )
            stage = _TimedStage(
                env,
                k,
                self.num_stages,
                torch.device("cpu"),
                input_args=torch.empty(0, dtype=torch.int64) if first else boundary,
                output_args=torch.empty(1, dtype=self.dtype, requires_grad=True)
                if last
                else boundary,
                group=self.group,
            )
            stage.clock = self.clock
            stages.append(stage)
        self._stages = stages
        loss = _ScaledLoss(self.loss_fn, self.M, self.clock, self.num_stages - 1)
        target = stages[0] if len(stages) == 1 else stages
        self._schedule_obj = self._cls(target, self.M, loss_fn=loss, scale_grads=False)
        self.capacity = capacity
        log.info(
            "rank %d: torch %s over stages %s of %d, envelope capacity %d",
            self.rank,
            self._cls.__name__,
            self.stage_indices,
            self.num_stages,
            capacity,
        )

    def _ensure_capacity(self, batches) -> None:
        if self._fixed_capacity:
            if self._schedule_obj is None:
                self._build_schedule(self.capacity)
            return
        if self._probe_modules is None:
            with torch.random.fork_rng():
                self._probe_modules = [
                    self.build_stage(k, self.num_stages) for k in range(self.num_stages)
                ]
        needed = probe_capacity(self.build_stage, self.num_stages, batches, self._probe_modules)
        if self._schedule_obj is None or needed > self.capacity:
            self._build_schedule(needed)  # every rank probes the same data: all rebuild together

    def run_iteration(
        self,
        iteration: int,
        batches: Sequence[tuple[Any, Any]],
        units: Callable[[int, int, Kind], float] | None = None,
        latency: Callable[[int, int, Kind], float] | None = None,
        by_stage: bool = False,
    ) -> TorchIterationResult:
        """Run torch's schedule over ``batches`` (M (inputs, targets) microbatches, the same on
        every rank). Gradients accumulate in the stage parameters (mean over microbatches, as rrfp's
        executor leaves them); the caller steps and zeroes them.

        ``latency(stage, mb, kind)``: units of link latency of the message that task sends (rrfp's
        ``Variability.latency`` with this rank's stage), added before each send to another rank.
        ``by_stage``: both are asked with torch's stage index instead (which numbers stages as
        rrfp's virtual layout of the same placement does) and give a local stage's own time, with no
        share: what rrfp's executor at V = 2 draws, task for task."""
        if len(batches) != self.M:
            raise ValueError(
                f"rank {self.rank}: got {len(batches)} microbatches, configured for {self.M}"
            )
        self._ensure_capacity(batches)
        clock = self.clock
        clock.units, clock.latency, clock.by_stage = units, latency, by_stage
        clock.spans, clock.loss_tensors, clock.forward_started = [], {}, {}
        sched = self._schedule_obj
        for stage in self._stages:  # what schedule.step() does before _step_microbatches
            stage.has_backward = True
            stage.clear_runtime_states()
        args = [(x,) for x, _ in batches]
        targets = [_Target(y, mb) for mb, (_, y) in enumerate(batches)]
        clock.t0 = time.perf_counter()
        with torch.enable_grad():
            sched._step_microbatches(args, None, targets, None, return_outputs=False)
        clock.sends.flush()  # torch waits for its own sends before returning; the delayed ones too
        # the sender threads live for one iteration: none outlives the process group
        clock.sends.close()
        wall = time.perf_counter() - clock.t0
        losses = {}
        if clock.loss_tensors:
            order = sorted(clock.loss_tensors)
            losses = dict(zip(order, torch.stack([clock.loss_tensors[m] for m in order]).tolist()))
        return TorchIterationResult(
            iteration, wall, losses, sorted(clock.spans, key=lambda s: s.start), clock.t0
        )
