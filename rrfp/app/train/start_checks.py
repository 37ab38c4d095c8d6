"""Two checks before any process group: the config's memory
fits the machine, and ``timeouts.peer_wait_s`` is well above the predicted step; and a
warning for a byte budget that holds not even one microbatch.

Memory: a rank holds its stage's parameters, gradients and AdamW's two moments
(4 x the parameter bytes), the activations of the microbatches it keeps in
flight (the budget's count on its stage, or a byte budget, at most all of a
step's microbatches), and two steps of its replica's batches (the one running
and the next one, made ahead). Parameters and activations are measured, not
guessed: each stage is built on the meta device (no memory, no compute) and
one real microbatch goes through it there, counting what autograd saves, of
which half is counted (``ACTIVATION_SHARE``: the meta device may choose other
kernels than the real one). Every term is meant as a lower bound of what the
run uses (no allocator slack, no temporaries, the smallest sampled
microbatch), so a refusal is a config that cannot fit: false refusals are
worse than no check. A
workload whose model does not run on the meta device is not checked (logged).

Step time: only where it is known without running: emulated device time
(``emulation.unit_ms``) or a calibrated cost model (``emulation.cost``); real compute
without a cost model has no prediction, and nothing is checked. The predicted
step is its busiest stage's work, a lower bound of the step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.core.budget import Budget
from rrfp.core.durations import TaskTimes
from rrfp.core.hints import HintError
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.pipeline.worker import takes_several
from rrfp.pipeline.workload import map_tensors

log = logging.getLogger("rrfp.app.train.start_checks")

TIMEOUT_FACTOR = 3  # a peer may wait a whole step and more: a straggling task is 3x ("lang" preset)
SAMPLE = 8  # microbatches measured for activations and features
# counted: half of what the meta forward saves. The meta device may pick other kernels than the real
# one (attention, dropout), so what it saves can differ a little from a real forward's
ACTIVATION_SHARE = 0.5


@dataclass(frozen=True)
class Footprint:
    """One rank's lower-bound memory, in bytes, by what holds it."""

    state: int  # parameters, gradients, AdamW moments
    activations: int  # microbatches in flight x activation bytes each
    batches: int  # two steps of this replica's input microbatches
    in_flight: int
    # one microbatch's activations (at one local stage, with virtual stages) on the rank, as counted
    one: int = 0
    stage_params: tuple[int, ...] = ()  # the parameter count of each of the rank's stages

    def holding(self, in_flight: int) -> Footprint:
        """The same rank holding ``in_flight`` microbatches' activations instead (no byte cap)."""
        return replace(self, activations=in_flight * self.one, in_flight=in_flight)

    @property
    def total(self) -> int:
        return self.state + self.activations + self.batches


def check_memory(cfg: TrainConfig, available: int | None = None) -> list[Footprint] | None:
    """ConfigError when the ranks of this node need more than it has (``available``: bytes;
    default: MemAvailable on CPU, the device's free memory on CUDA). Returns the footprints it
    checked (None: not measurable), for ``check_byte_budget``."""
    prints = footprints(cfg)
    if prints is None:
        return None
    lay = cfg.layout
    if (
        cfg.compute.device_type == "cuda"
    ):  # one device per rank: this rank's stage against its device
        rank = int(os.environ.get("RANK", "0"))
        need, mine = prints[lay.coords(rank).pp].total, [prints[lay.coords(rank).pp]]
        where = f"free on cuda:{os.environ.get('LOCAL_RANK', '0')}"
        if available is None:
            available = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0]
    else:  # every rank of this node shares its RAM
        local = int(os.environ.get("LOCAL_WORLD_SIZE", lay.world_size))
        first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
        mine = [prints[lay.coords(r).pp] for r in range(first, min(first + local, lay.world_size))]
        need = sum(f.total for f in mine)
        where = f"available on this machine for its {len(mine)} rank(s)"
        if available is None:
            available = _mem_available()
    if available is None or need <= available:
        return prints
    act = max(mine, key=lambda f: f.activations)
    unit = "microbatch(es)" if cfg.parallel.virtual == 1 else "local-stage microbatch(es)"
    raise ConfigError(
        f"the config needs at least {_gib(need)} of memory ({_gib(sum(f.state for f in mine))} "
        f"parameters, gradients and optimizer state; {_gib(sum(f.activations for f in mine))} "
        f"activations, up to {act.in_flight} {unit} in flight per rank; "
        f"{_gib(sum(f.batches for f in mine))} input batches), above the {_gib(available)} "
        f"{where}: lower schedule.n_microbatches, schedule.budget, data.microbatch_size or the "
        "[model] sizes, or use more ranks (parallel.pp)"
    )


def footprints(cfg: TrainConfig) -> list[Footprint] | None:
    """Each pipeline rank's Footprint; None when the model cannot be measured on the meta device.
    With virtual stages a rank holds its local stages' parameters and up to its rank limit of
    local-stage microbatches' activations (``Budget.rank_limit``), each at least its smallest local
    stage's."""
    run, sch, wl, layout = cfg.run, cfg.schedule, cfg.workload, cfg.virtual_layout
    M, layout_tp = sch.n_microbatches, cfg.layout.tp
    sample = wl.microbatches(cfg.data, 0, min(M, SAMPLE))
    smallest = min(sample, key=lambda b: _nbytes(b))
    batch_bytes = (
        sum(_nbytes(b) for b in sample) / len(sample) * M * 2
    )  # this replica's, this step's and the next
    try:
        measured = _measure(cfg, smallest)
    except Exception as e:  # the workload's own model: not measurable is not an error of the config
        log.info(
            "memory check skipped: %s does not run on the meta device: %s: %s",
            run.model,
            type(e).__name__,
            e,
        )
        return None
    split = cfg.schedule.split_backward
    out = []
    for r in range(layout.ranks):
        local = [measured[g][:2] for g in layout.stages_of(r)]
        held = (
            _fixed_peak(sch, layout, r, split)
            or sch.budget.rank_limit(layout, r).count
            or M * layout.virtual
        )
        held = max(
            1, min(held, M * layout.virtual)
        )  # local-stage microbatches (microbatches with one stage per rank)
        acts = int(min(a for _, a in local) * ACTIVATION_SHARE)
        activations = held * acts
        if sch.budget.bytes is not None:
            activations = min(activations, max(sch.budget.bytes, acts))
        params = sum(p for p, _ in local)
        out.append(
            Footprint(
                4 * params // layout_tp,
                activations // layout_tp,
                int(batch_bytes),
                held,
                acts // layout_tp,
                tuple(measured[g][2] for g in layout.stages_of(r)),
            )
        )
    return out


def at_1f1b(cfg: TrainConfig, prints: list[Footprint]) -> list[Footprint]:
    """``prints`` as 1F1B would hold them: each rank's 1F1B count in flight (S - r; with virtual
    stages the ``1x`` budget, ``Budget.rank_limit``), the baseline the budget is a multiple of."""
    layout, M = cfg.virtual_layout, cfg.schedule.n_microbatches
    one_x = Budget(multiple=1.0)
    return [
        fp.holding(max(1, min(one_x.rank_limit(layout, r).count or 1, M * layout.virtual)))
        for r, fp in enumerate(prints)
    ]


def check_byte_budget(cfg: TrainConfig, prints: list[Footprint] | None) -> str | None:
    """A warning line when a byte ``schedule.budget`` is below one microbatch's activations on some
    rank: such a microbatch runs alone (docs/design.md), so that rank holds one at a time and the
    pipeline barely overlaps; a run that works, but likely not what "1B" (1 byte, not a billion)
    meant. None otherwise. ``prints``: ``check_memory``'s (``one`` is a lower bound, so no false
    warning)."""
    limit = cfg.schedule.budget.bytes
    if (
        limit is None
        or prints is None
        or (cfg.schedule.dispatch is not Dispatch.READY and not cfg.schedule.hint.planned)
    ):
        return None
    rank, fp = min(enumerate(prints), key=lambda p: p[1].one)
    if limit >= fp.one:
        return None
    what = "microbatch" if cfg.parallel.virtual == 1 else "local-stage microbatch"
    return (
        f"schedule.budget = {cfg.schedule.budget} is a byte budget below one {what}'s activations "
        f"on every rank (at least {_gib(fp.one)} on pipeline rank {rank}): a {what} larger than "
        "the budget runs alone, so the microbatches go through the pipeline about one at a time; "
        "give a budget in MiB or GiB (e.g. 2GiB), a count or Nx"
    )


def _fixed_peak(sch, layout: VirtualLayout, rank: int, split: bool) -> int | None:
    """What fixed dispatch holds on ``rank``: its order's peak, in local-stage microbatches, for it
    applies no budget
    (None under ready dispatch, or for a plan, whose orders are made per step within the budget)."""
    if sch.dispatch is not Dispatch.FIXED or sch.hint.planned:
        return None
    try:
        return sch.hint.rank_peak(layout, rank, sch.n_microbatches, split)
    except HintError:  # refused with its own message by the config (config._check_hint_layout)
        return None


def _measure(cfg: TrainConfig, batch) -> list[tuple[int, int, int]]:
    """(parameter bytes, activation bytes of ``batch``, parameter count) per stage (pp x virtual),
    on meta."""
    wl, S = cfg.workload, cfg.num_stages
    x, y = _to_meta(batch[0]), _to_meta(batch[1])
    out = []
    with torch.device("meta"), _fork_rng():
        stages = [wl.build_stage(cfg.model, s, S, None) for s in range(S)]
    for s, module in enumerate(stages):
        saved = _SavedOnMeta()
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
            _SkipInit(),
        ):
            x = module(*x) if isinstance(x, (tuple, list)) and takes_several(module) else module(x)
            if s == S - 1:
                wl.loss_fn(x, y)
        for t in x if isinstance(x, (tuple, list)) else [x]:  # the output the stage keeps until B
            if isinstance(t, torch.Tensor):
                saved.pack(t)
        x = _detached(x)
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        out.append((params, saved.total, sum(p.numel() for p in module.parameters())))
    return out


class _SavedOnMeta:
    """Bytes autograd saves, once per storage (its identity: meta tensors have no data pointer)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.total = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        key = t.untyped_storage()._cdata
        if key not in self.seen:
            self.seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t


def check_timeout(cfg: TrainConfig, bounds_waits: bool | None = None) -> str | None:
    """A warning line when the peer wait (``timeouts.peer_wait_s``, from ``run.timeout_s``) is
    below TIMEOUT_FACTOR x the predicted step; None otherwise (or when no step time can be
    predicted without running). Only where it bounds every wait (``bounds_waits``; default: on
    nccl): on gloo the heartbeat tells a busy peer from a silent one, so the wait bounds silence,
    not a step (rrfp/comm/heartbeat.py)."""
    if not (cfg.compute.backend == "nccl" if bounds_waits is None else bounds_waits):
        return None
    step = predicted_step_s(cfg)
    wait = cfg.waits.peer_wait_s
    if step is None or wait >= TIMEOUT_FACTOR * step:
        return None
    key = "timeouts.peer_wait_s" if cfg.timeouts.peer_wait_s else "run.timeout_s"
    return (
        f"{key} = {wait:g} is below {TIMEOUT_FACTOR} x the predicted step of {step:.3g} s: "
        f"on nccl it bounds every wait, so a peer that waits a slow step out would be reported "
        f"as failed; raise {key} to "
        f"{math.ceil(TIMEOUT_FACTOR * step)} or more"
    )


def predicted_step_s(cfg: TrainConfig) -> float | None:
    """The busiest stage's task time in one step (a lower bound of the step), in seconds; None
    without emulated time or a cost model. An injected slow task (debug.fault) counts."""
    em, wl, lay = cfg.emulation, cfg.workload, cfg.layout
    fault = cfg.debug.fault
    slow = fault is not None and fault.kind == "slow"
    busy = np.zeros(lay.pp)
    unit_s = (
        em.unit_ms / 1000
        if em.unit_ms > 0
        else em.cost.reference_s
        if em.cost is not None
        else None
    )
    if unit_s is None and not slow:
        return None
    if unit_s is not None:
        M = cfg.schedule.n_microbatches
        m = min(M, SAMPLE)
        feats = (
            [wl.features(b) for b in wl.batches(cfg.data, 0, m)] if em.cost is not None else None
        )
        times = TaskTimes(em.variability, cfg.run.seed, cfg.schedule.split_backward, em.cost)
        busy += times.predicted(0, lay.pp, m, feats).sum(axis=(1, 2)) * (M / m) * unit_s
    if slow:
        busy[fault.stage if fault.stage is not None else lay.coords(fault.rank).pp] += fault.seconds
    return float(busy.max())


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _to_meta(value):
    return map_tensors(lambda t: t.to("meta"), value)


def _detached(value):
    """Not map_tensors: the stage's input arrives as a tuple (as messages carry it) with float
    leaves that require grad, as the worker makes them."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return tuple(_detached(v) for v in value)
    return value


@contextlib.contextmanager
def _fork_rng():
    """Building a stage draws its initial weights: the run's generator must not move."""
    with torch.random.fork_rng(devices=[]), _SkipInit():
        yield


class _SkipInit(TorchFunctionMode):
    """Random initialisation and dropout on the meta device are no-ops (it has no values), but torch
    runs them through a Python decomposition that first imports torch._dynamo: seconds at every
    start."""

    NAMES = frozenset(
        {"normal_", "uniform_", "trunc_normal_", "bernoulli_", "exponential_", "random_", "dropout"}
    )  # dropout's mask goes uncounted: a lower bound still

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = (
            args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        )  # torch.nn.init: by keyword
        if getattr(func, "__name__", "") in self.NAMES and getattr(target, "is_meta", False):
            return target
        return func(*args, **kwargs)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
