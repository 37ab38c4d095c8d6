"""``ScheduleReady``: rrfp's runtime behind torch.distributed.pipelining's schedule surface.

A training loop written for ``Schedule1F1B`` switches by one line::

    schedule = ScheduleReady(stage, n_microbatches, loss_fn=loss_fn)   # was Schedule1F1B(...)
    schedule.step(x, target=y, losses=losses)                          # unchanged

The semantics are torch 2.13's (torch/distributed/pipelining/schedules.py,
``PipelineScheduleSingle.step`` and ``Schedule1F1B._step_microbatches``): the
first stage splits the whole batch with ``split_args_kwargs_into_chunks`` and
the chunk specs, the target is split along dim 0, the last stage computes
``loss_fn(output, target)`` per microbatch and replaces the contents of
``losses`` with them, and ``step`` returns the merged output on the last stage.
Gradients end as torch leaves them: with ``scale_grads`` the whole ``.grad``
(what was there before the step included) is divided by the number of
microbatches after the step, without it the microbatch gradients are summed.

Several stages per rank (virtual stages) are given as torch's ``PipelineScheduleMulti`` takes
them, a list of the rank's PipelineStages: the stage indices say how many and where (interleaved
r, r + S, ... or v r, 2S - 1 - r), and rrfp's runtime is started with that placement. As in
torch, the rank holding stage 0 passes the inputs, and the rank holding the last stage (rank 0
under v, S - 1 interleaved) the target; it gets the losses and the merged output.

Underneath, the stage's module runs in an rrfp ``StageExecutor`` (readiness,
the hint, the budget) over rrfp's own channels, so nothing needs torch's shape
inference: microbatches may differ in shape (pass them pre-split, as torch 2.14
does, with ``arg_mbs``/``kwarg_mbs``/``target_mbs``), and a stage may send
several tensors and None. As in torch, a rank's keyword arguments reach every stage it holds, each
microbatch's its own. A stage's ``dw_builder`` runs as torch's stage runs it: B runs the whole
autograd backward and builds the microbatch's weight-gradient runner, W (or, with a whole backward,
B itself) runs it. The runtime lives on a loop in a thread of its own
(rrfp/loop/background.py) that persists across steps; ``step`` blocks.
``last_result`` is rrfp's ``IterationResult`` of the last step: busy and wall
time (the bubble), the order the stage ran its tasks in.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from rrfp.comm.loaded_class import PIPELINE_STAGE, loaded_class
from rrfp.core.budget import DEFAULT_BUDGET
from rrfp.core.errors import StartupError
from rrfp.core.hints import DEFAULT_HINT, resolve
from rrfp.core.layout import layout_for
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import DEFAULT_DISPATCH
from rrfp.loop.background import BackgroundLoop
from rrfp.loop.exit_guard import close_at_exit
from rrfp.pipeline.executor import IterationResult
from rrfp.pipeline.forward_pass import forward_only
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.schedule_settings import DEFAULT_WEIGHT_SPLIT, ScheduleSettings
from rrfp.pipeline.sharded_stages import fsdp_modules
from rrfp.pipeline.thread_state import ThreadState
from rrfp.pipeline.timeouts import DEFAULT_TIMEOUT_S, Timeouts
from rrfp.pipeline.workload import map_tensors
from rrfp.pipeline.wrapped import refuse_wrapped
from rrfp.pipelining.mesh import read_mesh
from rrfp.pipelining.torch_csv import read_torch_csv

log = logging.getLogger("rrfp.pipelining")


# The keyword arguments of the microbatch whose task runs on this thread. The StageWorker passes a
# stage its inputs as positional arguments only, and a stage past the first gets them from the
# previous stage; so a rank's kwargs reach each of its stages this way, as torch's
# forward_one_chunk gives them to every stage a rank holds.
_STAGE_KWARGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "rrfp_stage_kwargs", default=None
)


class _StageCall(torch.nn.Module):
    """The stage module as torch calls it: ``submod(*args, **kwargs)``, the kwargs those of the
    microbatch being run. Registered as ``submod``, so parameter names read as on torch's
    PipelineStage."""

    def __init__(self, submod: torch.nn.Module) -> None:
        super().__init__()
        self.submod = submod

    def forward(self, *args):
        return self.submod(*args, **(_STAGE_KWARGS.get() or {}))


class _MicrobatchKwargs:
    """The caller's thread state, with microbatch ``mb``'s keyword arguments current around each of
    its tasks: the executor runs every F, B and W as ``state.wrap(task)(mb, ...)`` on its lane."""

    def __init__(self, state: ThreadState, kwarg_mbs: list[dict]) -> None:
        self.state, self.kwarg_mbs = state, kwarg_mbs

    def wrap(self, fn):
        task = self.state.wrap(fn)

        def run(mb: int, *rest):
            with _kwargs_of(self.kwarg_mbs[mb]):
                return task(mb, *rest)

        return run


@contextlib.contextmanager
def _kwargs_of(kwargs: dict):
    """``kwargs`` current for the stage modules called on this thread meanwhile."""
    token = _STAGE_KWARGS.set(kwargs)
    try:
        yield
    finally:
        _STAGE_KWARGS.reset(token)


@dataclass(frozen=True)
class _Target:
    """A microbatch's target and index: rrfp's last stage hands the target to the loss untouched."""

    value: Any
    mb: int


class _Loss:
    """torch's ``loss_fn(output, target, **loss_kwargs)``; keeps each microbatch's output for
    ``step`` to merge when asked to."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self.kwargs: dict = {}
        self.outputs: dict[int, Any] | None = None

    def __call__(self, output, target: _Target) -> torch.Tensor:
        if self.outputs is not None:
            self.outputs[target.mb] = _detached(output)
        return self.loss_fn(output, target.value, **self.kwargs)


def _under_submod(tied):
    """``tied=`` names relative to the user's module, as ScheduleReady registers it (``submod``)."""
    if isinstance(tied, dict):
        return {k: f"submod.{v}" if isinstance(v, str) else v for k, v in tied.items()}
    if isinstance(tied, (list, tuple)):
        return [_under_submod(d) for d in tied]
    return tied


def _detached(value):
    return map_tensors(torch.Tensor.detach, value)


class ScheduleReady:
    """A drop-in for torch's single-stage schedules (``Schedule1F1B``, ``ScheduleGPipe``) that runs
    rrfp's readiness-driven executor on ``stage``'s module, rank and process group; and, given the
    list of the rank's stages, for its multi-stage ones (``ScheduleInterleaved1F1B``,
    ``ScheduleZBVZeroBubble``, ...): the stage indices say the placement, interleaved or v.

    Positional arguments are torch's. ``hint`` (a builtin name such as ``"bfw"``, ``"1f1b"``,
    ``"zbh1"``, an rrfp ``.csv`` hint, or a callable), ``budget`` (``"2x"``, a count, ``"512MiB"``)
    and ``dispatch`` (``"ready"`` or ``"fixed"``) are rrfp's; ``timeout_s`` is how long a stage
    waits on a silent peer before it names it (``heartbeat``, on by default: a peer that beats is
    alive however long its task takes, rrfp/comm/heartbeat.py; ``heartbeat=False`` bounds every
    wait by ``timeout_s`` instead), and every other wait's default; ``timeouts`` (a
    ``rrfp.pipeline.timeouts.Timeouts``, e.g. ``Timeouts.derive(60, process_group_s=300)``) sets
    each wait apart instead, as ``PipelineRuntime.start`` takes them (a slow store on a big
    cluster need not lengthen the wait on a silent peer); the start, where every rank checks the
    others' stages, waits ``process_group_s``; ``tied`` declares parameters shared with other
    stages, ``{tie name: parameter name in the stage's module}`` (PipelineRuntime.stage_executor);
    ``on_nonfinite`` (``"stop"``, ``"skip"`` or None) is
    ``PipelineRuntime.stage_executor``'s: a NaN or Inf stops every rank, or skips the step on every
    rank with every ``.grad`` set to None (``optimizer.step()`` then moves nothing). ``dp_sync``:
    when the stage's group is one pipeline of a pp x dp layout, each ``step`` also averages the
    gradients over the dp replicas (the runtime's GradSync, its all-reduces starting as gradients
    are final), so they equal one process's over the whole batch of every replica; a no-op when
    dp = 1. ``mesh`` (a torch DeviceMesh) places the schedule in a pp x dp layout with one argument
    (rrfp/pipelining/mesh.py): dimensions ``("pp", "dp")`` or ``("pp", "dp_shard")``, optionally
    a trailing ``"tp"`` of size 1, over the world in rrfp's rank order (``init_device_mesh``'s);
    the stage's group must be the mesh's ``"pp"`` slice of this rank. Under ``"dp"`` each ``step``
    averages the gradients over the replicas (as ``dp_sync``); under ``"dp_shard"`` the stage
    modules must be ``fully_shard``'ed over ``mesh["dp_shard"]``, and FSDP reduce-scatters them
    after each step (rrfp/pipeline/sharded_stages.py). A trailing ``"ep"`` adds expert
    parallelism over the replicas (``rrfp.shard_experts(module, mesh["ep"].get_group())``; under
    ``"dp_shard"`` the experts stay out of ``fully_shard``). ``split`` (B and W apart; None: the
    hint's default), ``weight_split`` (how W gets the weight gradients: ``auto``, ``autograd``,
    ``functions``) and ``cost`` (a CostModel, e.g. from ``rrfp calibrate``) are
    ``stage_executor``'s. ``settings`` (a ScheduleSettings) gives hint, budget, dispatch, split and
    cost as one object instead; with ``cost`` every ``step`` needs ``cost_features=``, one dict per
    microbatch (``rrfp.token_features``), the same list on every rank. Every rank must construct
    it, in the same order relative to other collectives (it creates rrfp's process groups), and
    should ``close()`` it (or use ``with``) before destroying the process group.
    """

    # Emulated device time, for `rrfp bench`'s drop-in rows (rrfp/app/bench/dropin.py): ms of lane
    # time per unit of task duration, and the executor's durations. Users run real time: 0 and none.
    _unit_ms: float = 0.0

    def _emulation(self) -> dict:
        """The executor's emulated-duration settings (variability, seed, cost: ScheduleSettings
        fields) and its instrument."""
        return {}

    def _features(self) -> list[dict] | None:
        """This step's microbatch features (``step(cost_features=)``), for the cost model."""
        return self._step_features

    def __init__(
        self,
        stage,
        n_microbatches: int,
        loss_fn=None,
        args_chunk_spec=None,
        kwargs_chunk_spec=None,
        output_merge_spec=None,
        scale_grads: bool = True,
        *,
        hint=DEFAULT_HINT,
        budget=DEFAULT_BUDGET,
        dispatch: str = DEFAULT_DISPATCH,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        timeouts: Timeouts | None = None,
        tied=None,
        on_nonfinite: str | None = "stop",
        dp_sync: bool = False,
        split: bool | None = None,
        weight_split: str = DEFAULT_WEIGHT_SPLIT,
        cost=None,
        heartbeat: bool = True,
        settings: ScheduleSettings | None = None,
        mesh=None,
    ) -> None:
        waits = Timeouts.given(timeouts, timeout_s)
        stages, layout, virtual, placement, device, dp_dim = _layout_of(
            stage,
            n_microbatches,
            waits.process_group_s,
            waits.key("process_group_s"),
            mesh,
            dp_sync,
        )
        dp_sync = dp_sync or dp_dim == "dp"  # mesh's "dp": rrfp averages the gradients
        self._stages, self._n_microbatches, self._loss_fn = stages, n_microbatches, loss_fn
        self._holds_first = any(s.is_first for s in stages)
        self._holds_last = any(s.is_last for s in stages)
        self._args_chunk_spec, self._kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self._output_merge_spec, self.scale_grads = output_merge_spec, scale_grads
        self._has_backward = loss_fn is not None
        self._settings = dict(on_nonfinite=on_nonfinite, tied=_under_submod(tied))
        if settings is not None and settings.n_microbatches != n_microbatches:
            raise ValueError(
                f"settings.n_microbatches = {settings.n_microbatches} but n_microbatches = "
                f"{n_microbatches}"
            )
        self._schedule = settings or ScheduleSettings.of(
            n_microbatches,
            hint=hint,
            budget=budget,
            dispatch=dispatch,
            split=split,
            weight_split=weight_split,
            cost=cost,
        )
        self._step_features: list[dict] | None = None
        self._modules = [_StageCall(s.submod) for s in stages]
        self._dp_sync, self._sync = dp_sync, None
        self._loss = _Loss(loss_fn)
        self._iteration = 0
        self.last_result: IterationResult | None = None
        backend = "nccl" if device.type == "cuda" else "gloo"
        indices = tuple(s.stage_index for s in stages)
        self._loop = BackgroundLoop(f"rrfp-stage{'-'.join(map(str, indices))}")
        try:
            self._runtime = self._loop.call(
                _start(layout, backend, waits, self._unit_ms, virtual, placement, heartbeat)
            )
        except BaseException:
            self._loop.close()
            raise
        if tuple(self._runtime.stages) != indices:
            self.close(wait_for_peers=False)
            raise ValueError(
                f"rank {self._runtime.rank} holds torch stages {list(indices)}, but rrfp places "
                f"stages {list(self._runtime.stages)} there: ScheduleReady needs stage i on rank i "
                "% S of the group (interleaved) or on rank min(i, 2S - 1 - i) (v)"
            )
        self._executor = self._new_executor() if loss_fn is not None else None
        self._closed = False
        close_at_exit(self._close_at_exit)

    def _close_at_exit(self) -> None:
        """At interpreter exit, what the script left open closes without waiting for the peers
        (rrfp/loop/exit_guard.py): they may be gone, and a barrier would hold the exit."""
        self.close(wait_for_peers=False)

    # -- torch's surface -----------------------------------------------------

    def step(
        self,
        *args,
        target=None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict | None = None,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        cost_features: list | None = None,
        **kwargs,
    ):
        """One iteration over the whole batch ``args``/``kwargs`` (split here), or over pre-split
        microbatches (``arg_mbs``: one tuple of positional arguments per microbatch, ``kwarg_mbs``
        one dict each, ``target_mbs`` one target each). Returns the merged output on the last stage.
        ``cost_features``: with ``cost=``, one feature dict per microbatch, the same on every
        rank."""
        if self._has_backward and self._schedule.cost is not None and cost_features is None:
            raise ValueError(
                f"ScheduleReady has a cost model (cost=) but step got no cost_features: pass "
                f"cost_features=[rrfp.token_features(b) for b in microbatches], one dict per "
                f"microbatch ({self._n_microbatches}), the same list on every rank"
            )
        self._step_features = cost_features
        if self._closed:
            raise RuntimeError("ScheduleReady.step after close()")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should not "
                "be used under torch.no_grad() context. Please call eval() instead."
            )
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        # the caller's autocast, read on its thread: the stages run on rrfp's loop and lane threads
        state = ThreadState.capture(
            "ScheduleReady.step" if self._has_backward else "ScheduleReady.eval",
            trains=self._has_backward,
        )
        presplit = arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None
        arg_mbs, kwarg_mbs, target_mbs = self._microbatches(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
        )
        keep = return_outputs and self._holds_last
        if self._has_backward:
            outputs, mb_losses = self._train(
                arg_mbs, kwarg_mbs, target_mbs, loss_kwargs or {}, keep, state
            )
        else:
            outputs, mb_losses = self._loop.call(
                self._runtime.watch(
                    self._forward_only(
                        self._iteration,
                        arg_mbs,
                        kwarg_mbs,
                        target_mbs,
                        loss_kwargs or {},
                        torch.is_grad_enabled(),
                        state,
                    )
                )
            )
        self._iteration += 1
        if self._holds_last and losses is not None and self._loss_fn is not None:
            losses.clear()
            losses.extend(mb_losses)
        if keep:
            return self._merge(outputs, presplit)
        return None

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Forward only, as torch's ``eval``: the last stage still computes the losses when it has a
        loss_fn. Gradients are left alone (torch 2.13's eval divides ``.grad`` by M once more, in
        ``perform_reduce_grad``; that is not copied)."""
        has_backward = self._has_backward
        try:
            self._has_backward = False
            return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = has_backward

    # -- what torch's multi-stage schedules have and this one has not (yet) ----

    def register_custom_function(self, *args, **kwargs):
        raise NotImplementedError(
            "ScheduleReady does not take custom functions (torch's register_custom_function "
            "on _PipelineScheduleRuntime): rrfp's executor decides what runs when; use "
            "hint= to change its priorities"
        )

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """torch's schedule CSV as this schedule's hint: this rank's row becomes its order over the
        stages it holds (rrfp/pipelining/torch_csv.py, which says what it refuses). Only
        ``compute_only`` schedules are read."""
        if format != "compute_only":
            raise NotImplementedError(
                f"ScheduleReady reads torch schedule CSVs in format 'compute_only', not "
                f"{format!r}: rrfp does its own communication"
            )
        hint, split = read_torch_csv(filename)
        self._schedule = dataclasses.replace(self._schedule, hint=resolve(hint), split=split)
        if self._executor is not None:
            self._executor = self._new_executor()

    load_csv = _load_csv

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the whole model's gradients (every stage of every rank) to ``max_norm`` by their
        total norm, and return it, the same on every rank (``PipelineRuntime.clip_grad_norm_``).
        Collective: every rank calls it, after ``step`` (and after any DP gradient sync); a
        non-finite norm is not applied."""
        if self._closed:
            raise RuntimeError("ScheduleReady.clip_grad_norm_ after close()")
        return self._loop.call(
            self._runtime.watch(self._runtime.clip_grad_norm_(max_norm, norm_type))
        )

    # -- lifetime ------------------------------------------------------------

    def close(self, wait_for_peers: bool = True) -> None:
        """Wait for every rank, close rrfp's channels and lane, stop the loop. Collective: every
        rank calls it (``wait_for_peers=False`` after an error skips the barrier)."""
        if getattr(self, "_loop", None) is None:
            return
        try:
            if wait_for_peers:
                self._loop.call(self._runtime.watch(self._runtime.finish()))
            else:
                self._loop.call(self._runtime.aclose())
        finally:
            if self._runtime.heartbeat is not None:
                self._runtime.heartbeat.close()
            self._loop.close()
            self._loop, self._closed = None, True

    def __enter__(self) -> ScheduleReady:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait_for_peers=exc_type is None)

    # -- internals -----------------------------------------------------------

    def _new_executor(self):
        emulation = dict(self._emulation())
        instrument = emulation.pop("instrument", None)
        ex = self._runtime.stage_executor(
            self._modules,
            self._loss,
            dataclasses.replace(self._schedule, **emulation),
            instrument=instrument,
            dw_builder=[s.dw_builder for s in self._stages],
            **self._settings,
        )
        if self._dp_sync:
            held = (
                self._modules[0] if len(self._modules) == 1 else torch.nn.ModuleList(self._modules)
            )
            self._sync = self._runtime.grad_sync(held, ex)
        return ex

    async def _iterate(self, batches, state: ThreadState | _MicrobatchKwargs):
        """One iteration in the caller's thread state, then (dp_sync) the replicas' mean grads."""
        result = await self._executor.run_iteration(
            self._iteration, batches, self._features(), thread_state=state
        )
        if self._sync is not None:
            await self._sync.sync()
        return result

    def _merge(self, outputs: list, presplit: bool):
        """torch's merge_chunks; pre-split microbatches whose outputs differ in shape cannot be
        concatenated, and come back as the list of outputs, one per microbatch."""
        if presplit:
            shapes = {
                tuple(t.shape[1:])
                for t in pytree.tree_leaves(outputs)
                if isinstance(t, torch.Tensor)
            }
            if len(shapes) > 1 and self._output_merge_spec is None:
                return outputs
        from torch.distributed.pipelining.microbatch import merge_chunks

        return merge_chunks(outputs, self._output_merge_spec)

    def _microbatches(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs):
        M = self._n_microbatches
        if arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None:
            if args or kwargs or target is not None:
                raise ValueError(
                    "pass either the whole batch (args, kwargs, target=) or pre-split microbatches "
                    "(arg_mbs=, kwarg_mbs=, target_mbs=), not both"
                )
            for name, mbs in (
                ("arg_mbs", arg_mbs),
                ("kwarg_mbs", kwarg_mbs),
                ("target_mbs", target_mbs),
            ):
                if mbs is not None and not isinstance(mbs, list):
                    raise TypeError(f"{name} must be a list but got a {type(mbs)}")
                if mbs is not None and len(mbs) != M:
                    raise ValueError(f"Expecting {M} {name} but got {len(mbs)}")
            arg_mbs = (
                [a if isinstance(a, tuple) else (a,) for a in arg_mbs]
                if arg_mbs is not None
                else [()] * M
            )
            kwarg_mbs = kwarg_mbs if kwarg_mbs is not None else [{}] * M
            bad = [i for i, k in enumerate(kwarg_mbs) if not isinstance(k, dict)]
            if bad:
                raise TypeError(
                    f"kwarg_mbs entries must be dicts; entry {bad[0]} is a "
                    f"{type(kwarg_mbs[bad[0]])}"
                )
        else:
            from torch.distributed.pipelining.microbatch import (
                TensorChunkSpec,
                split_args_kwargs_into_chunks,
            )

            if args or kwargs:
                arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
                    args, kwargs, M, self._args_chunk_spec, self._kwargs_chunk_spec
                )
            else:
                arg_mbs, kwarg_mbs = [()] * M, [{}] * M
            if target is not None:  # torch splits the target along the batch dimension
                spec = (TensorChunkSpec(0),)
                target_mbs = [
                    t[0] for t in split_args_kwargs_into_chunks((target,), None, M, spec)[0]
                ]
        return arg_mbs, kwarg_mbs, target_mbs

    def _train(
        self, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs: dict, keep: bool, state: ThreadState
    ):
        M = self._n_microbatches
        batches = []
        for mb in range(M):
            x = tuple(arg_mbs[mb]) if self._holds_first else None
            y = (
                _Target(None if target_mbs is None else target_mbs[mb], mb)
                if self._holds_last
                else None
            )
            batches.append((x, y))
        self._loss.kwargs, self._loss.outputs = loss_kwargs, ({} if keep else None)
        if any(kwarg_mbs):
            state = _MicrobatchKwargs(state, kwarg_mbs)
        held = _take_grads(self._modules)
        try:
            self.last_result = self._loop.call(self._runtime.watch(self._iterate(batches, state)))
        finally:
            _scale_grads(self._modules, held, M, self.scale_grads)
        if (
            self.last_result.skipped
        ):  # on_nonfinite = "skip": no gradient at all, the held ones included
            for p in _parameters(self._modules):
                p.grad = None
        last = [w for w in self._executor.workers if w.is_last]
        losses = [last[0].losses[mb] for mb in range(M)] if last else []
        outputs = [self._loss.outputs[mb] for mb in range(M)] if keep else []
        self._loss.outputs = None
        return outputs, losses

    async def _forward_only(
        self,
        it: int,
        arg_mbs,
        kwarg_mbs,
        target_mbs,
        loss_kwargs: dict,
        grad: bool,
        state: ThreadState,
    ):
        """Forward only (eval, or no loss_fn), in rrfp/pipeline/forward_pass.py's one global order,
        under the caller's thread state."""
        rt = self._runtime
        held = {s.stage_index: m for s, m in zip(self._stages, self._modules)}

        def forward(s: int, x, mb: int):
            with torch.set_grad_enabled(grad), _kwargs_of(kwarg_mbs[mb]):
                out = held[s](*x) if isinstance(x, tuple) else held[s](x)
                loss = None
                if s == rt.num_stages - 1 and self._loss_fn is not None:
                    loss = self._loss_fn(
                        out, None if target_mbs is None else target_mbs[mb], **loss_kwargs
                    )
            return out, loss

        return await forward_only(
            rt.lane,
            rt.channels.of,
            list(held),
            rt.num_stages,
            rt.rank,
            it,
            self._n_microbatches,
            lambda mb: tuple(arg_mbs[mb]),
            state.wrap(forward),
            keep_graph=grad,
        )


def _parameters(modules: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The rank's stages' parameters, each once (a tied weight held by two stages is one .grad)."""
    return list(torch.nn.ModuleList(modules).parameters())


def _take_grads(modules: list[torch.nn.Module]) -> dict:
    """Take the gradients already there off the parameters, so the step's own are seen alone."""
    held = {}
    for p in _parameters(modules):
        if p.grad is not None:
            held[p], p.grad = p.grad, None
    return held


def _scale_grads(modules: list[torch.nn.Module], held: dict, M: int, scale: bool) -> None:
    """rrfp's worker backpropagates loss / M, so a step leaves the mean of the microbatch gradients.
    torch leaves ``(held + sum) / M`` with scale_grads (``PipelineStage.scale_grads`` divides the
    whole ``.grad`` after the last backward), ``held + sum`` without."""
    for p in _parameters(modules):
        g, old = p.grad, held.get(p)
        if g is not None and not scale:
            g.mul_(M)
        if old is not None:
            if scale:
                old.div_(M)
            p.grad = old if g is None else old.add_(g)


def _stages_of(stage) -> list:
    """The rank's PipelineStages (one, or a list as PipelineScheduleMulti takes), in model order."""
    stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    if not stages:
        raise ValueError("ScheduleReady needs at least one PipelineStage, got an empty list")
    for s in stages:  # a PipelineStage's module is imported by whoever made one
        if not isinstance(s, loaded_class(PIPELINE_STAGE)):
            raise TypeError(
                f"ScheduleReady takes a torch.distributed.pipelining PipelineStage (or a list of "
                f"them), got {type(s).__name__}"
            )
    return sorted(stages, key=lambda s: s.stage_index)


def _device_of(stages: list) -> torch.device:
    devices = {torch.device(s.device) for s in stages}
    if len(devices) != 1:
        raise ValueError(
            f"this rank's stages {[s.stage_index for s in stages]} are on different devices "
            f"{sorted(map(str, devices))}: ScheduleReady runs a rank's stages on one device"
        )
    return devices.pop()


def _check_module(module: torch.nn.Module) -> None:
    """Data parallelism wrapped around (or inside) the stage module is refused
    (rrfp/pipeline/wrapped.py)."""
    refuse_wrapped(module, "ScheduleReady")


def _layout_of(
    stage, n_microbatches, timeout_s: float, key: str, mesh=None, dp_sync: bool = False
) -> tuple:
    """The rank's stages in model order; rrfp's layout for the stages' group (the whole world as one
    pipeline, or one pipeline of a pp x dp layout whose stage s of replica d is rank ``s * dp +
    d``); the virtual stages per rank and their placement (read off the stage indices each rank
    holds); the rank's device; and the mesh's data-parallel dimension (``mesh=``: "dp" or
    "dp_shard"; None without a mesh).

    Every rank's own checks end in one gather of their outcomes, before rrfp's groups exist: a rank
    that refuses its arguments would otherwise leave the others waiting in group creation until the
    timeout. So a refusal fails every rank at once: a rank raises its own error, or, when its own
    arguments are fine, the first refusing rank's, naming that rank (an error of a type other than
    ValueError, TypeError and NotImplementedError arrives as a RuntimeError naming the type); a rank
    that does not come within ``timeout_s`` is a StartupError naming the argument that set it
    (``key``). With several stages per rank the ranks' stage sets must also be one placement."""
    if not dist.is_initialized():
        _stages_of(stage)  # what is not a stage is named before the missing process group
        raise RuntimeError(
            "ScheduleReady needs an initialized process group (dist.init_process_group), as the "
            "PipelineStage does"
        )
    try:
        stages = _stages_of(stage)
        device = _device_of(stages)
        mine, error = _checked(stages, n_microbatches, mesh, dp_sync), None
    except Exception as e:  # whatever it is, the other ranks must hear of it rather than wait
        mine, error = None, e
    everyone = _gather(
        mine if error is None else (type(error).__name__, str(error)),
        error is None,
        timeout_s,
        key.removeprefix("run."),
    )
    if error is not None:
        raise error
    refused = [(q, outcome) for q, (ok, outcome) in enumerate(everyone) if not ok]
    if refused:
        q, (name, text) = refused[0]
        if name in _REFUSALS:
            raise _REFUSALS[name](f"rank {q}: {text}")
        raise RuntimeError(f"rank {q}: {name}: {text}")
    placed = [placed for _, placed in everyone]
    if len({(len(indices), p) for indices, _, p, *_ in placed}) > 1:
        raise ValueError(
            "the ranks' stages are not one placement: "
            + ", ".join(
                f"rank {q} holds {indices} ({p})" for q, (indices, _, p, *_) in enumerate(placed)
            )
        )
    _, virtual, placement, layout, dp_dim = mine
    return stages, layout, virtual, placement, device, dp_dim


_REFUSALS = {
    e.__name__: e for e in (ValueError, TypeError, NotImplementedError)
}  # another rank's, by name


def _gather(outcome, ok: bool, timeout_s: float, key: str) -> list[tuple[bool, Any]]:
    """Every rank's (ok, outcome), on a gloo group of the world made for it (on CPU under NCCL too)
    with ``timeout_s``: a rank that never constructs the schedule is then an error after
    ``timeout_s``, not a wait as long as the default group's timeout (30 minutes for gloo by
    default)."""
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (ok, outcome), group=group)
    except (
        Exception
    ) as e:  # torch's DistStoreError / DistNetworkError / RuntimeError: a rank did not come
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise StartupError(
            f"rank {dist.get_rank()}: not every rank reached ScheduleReady's start within "
            f"{key} = {timeout_s:g} s (every rank constructs it, in the same order): "
            f"{type(e).__name__}: {first_line}"
        ) from None
    dist.destroy_process_group(group)
    return everyone


def _checked(stages: list, n_microbatches, mesh=None, dp_sync: bool = False) -> tuple:
    """This rank's own checks past its stages and device: (its stage indices, V, placement, rrfp's
    layout, the mesh's data-parallel dimension or None), or the error that names what is wrong."""
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or n_microbatches <= 0
    ):
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    for s in stages:
        _check_module(s.submod)
    stage, world = stages[0], dist.get_world_size()
    pp = stage.group_size
    mixed = [
        s.stage_index
        for s in stages
        if (s.num_stages, s.group_size, s.group_rank) != (stage.num_stages, pp, stage.group_rank)
    ]
    if mixed:
        raise ValueError(
            f"this rank's stages {[s.stage_index for s in stages]} disagree on the pipeline "
            f"(stages {mixed} have another num_stages, group size or group rank than stage "
            f"{stage.stage_index})"
        )
    if world % pp:
        raise ValueError(
            f"the stage's group has {pp} ranks, which does not divide the world size {world}"
        )
    ranks = (
        dist.get_process_group_ranks(stage.group) if stage.group is not None else list(range(world))
    )
    dp_dim, ep = _mesh_checked(mesh, stages, ranks, dp_sync) if mesh is not None else (None, 1)
    layout = layout_for(world, pp, 1, world // pp, ep)
    if ranks not in layout.pp_groups():
        raise NotImplementedError(
            f"the stage's group has ranks {ranks}; ScheduleReady supports the whole world "
            f"or the pipelines of {layout.short()} ({layout.pp_groups()})"
        )
    indices = [s.stage_index for s in stages]
    return (
        indices,
        *_placement_of(indices, stage.num_stages, pp, stage.group_rank),
        layout,
        dp_dim,
    )


def _mesh_checked(mesh, stages: list, ranks: list[int], dp_sync: bool) -> tuple[str, int]:
    """The mesh's data-parallel dimension and its expert-parallel size, once the mesh, the stage's
    group and the stage modules agree with it (rrfp/pipelining/mesh.py)."""
    read = read_mesh(mesh, dist.get_world_size())
    if ranks != read.pipeline:
        raise ValueError(
            f"ScheduleReady(mesh=): the stage's group has ranks {ranks}, but this rank's pipeline "
            f"in the mesh is {read.pipeline}: build the PipelineStage with "
            'group=mesh["pp"].get_group()'
        )
    sharded = bool(fsdp_modules([s.submod for s in stages]))
    if read.dp_dim == "dp_shard" and read.dp > 1 and not sharded:
        over = "mesh['dp_shard', 'ep']._flatten()" if read.ep > 1 else "mesh['dp_shard']"
        raise ValueError(
            "ScheduleReady(mesh=): the mesh's 'dp_shard' dimension needs stage modules sharded "
            f"with fully_shard(module, mesh={over}); name it 'dp' for rrfp's gradient "
            "averaging of unsharded modules"
        )
    if sharded and (read.dp_dim == "dp" and read.dp > 1 or dp_sync):
        raise ValueError(
            "ScheduleReady: the stage modules are FSDP-sharded, so FSDP reduce-scatters their "
            "gradients: name the mesh's dimension 'dp_shard' and leave dp_sync off"
        )
    return read.dp_dim, read.ep


def _placement_of(indices: list[int], num_stages: int, pp: int, rank: int) -> tuple[int, str]:
    """(stages per rank, placement) that put exactly ``indices`` on group rank ``rank``: interleaved
    (r, r + pp, ...: ScheduleInterleaved1F1B's) or v (r, 2pp - 1 - r: ZB-V's, DualPipeV's)."""
    virtual = len(indices)
    if num_stages != pp * virtual:
        raise ValueError(
            f"group rank {rank} holds stages {indices} of {num_stages} on {pp} ranks: "
            "ScheduleReady "
            f"needs the same number of stages on every rank ({num_stages} / {pp} each)"
        )
    for placement in (
        ("interleaved", "v") if virtual == 2 else ("interleaved",)
    ):  # v is for V = 2 only
        if tuple(indices) == VirtualLayout(pp, virtual, placement).stages_of(rank):
            return virtual, placement
    if virtual == 1:
        raise ValueError(
            f"group rank {rank} holds stage {indices[0]} of {num_stages}: ScheduleReady needs "
            "stage i on rank i of the group"
        )
    raise ValueError(
        f"group rank {rank} holds stages {indices} of {num_stages}: ScheduleReady places a rank's "
        f"stages interleaved {list(VirtualLayout(pp, virtual).stages_of(rank))}"
        + (f" or v {list(VirtualLayout(pp, 2, 'v').stages_of(rank))}" if virtual == 2 else "")
        + ", not otherwise"
    )


async def _start(
    layout,
    backend: str,
    timeouts: Timeouts,
    unit_ms: float,
    virtual: int = 1,
    placement: str = "interleaved",
    heartbeat: bool = True,
) -> PipelineRuntime:
    return PipelineRuntime.start(
        layout=layout,
        backend=backend,
        timeouts=timeouts,
        unit_ms=unit_ms,
        virtual=virtual,
        placement=placement,
        heartbeat=heartbeat,
    )
