"""F, B and W of one pipeline stage on its part of the model, with no communication.

The executor decides what runs when and moves tensors between stages; this
module only computes, keeps each microbatch's activations from its F until its
last backward task, and refuses tasks that come out of order, naming the stage
and the task. One StageWorker is driven by one thread at a time (the compute lane).

With split=True, B computes only the input gradient and W the weight
gradients, split with torch.autograd on the stage's own graph
(``weight_split.py``), so any module gets a real W. ``weight_split =
"layers"`` (experimental: the runtime never selects it; not with
torch.utils.checkpoint(use_reentrant=False) around split-aware layers)
instead lets split-aware layers (``SplitLinear``, the TP linears)
queue their weight-gradient closures during F and splits only the other
parameters with autograd. ``weight_split = "functions"`` (a run's
``schedule.weight_split``) also queues the W of the module's own linears, norms,
embeddings and products with a parameter (rrfp/nn/split_functions.py), which
spares W a second autograd pass and a second recomputation of checkpointed
regions. A worker defaults to the autograd split; a run's default ("auto",
rrfp/pipeline/schedule_settings.py) gives its stages mode functions except in
tensor-parallel, FSDP and expert-parallel runs, which refuse it
(benchmarks/split_cost.py compares the modes).
A stage given a ``dw_builder``
(torch's ``PipelineStage(dw_builder=)``: custom autograd functions that leave
their weight gradients to a runner) is split as torch splits it instead: B runs
the whole autograd backward and builds the microbatch's runner, W runs it.

A stage boundary may carry several tensors: a stage may return a tuple or list
of tensors and None, and the next stage gets them as separate arguments when
its forward takes several (``forward(self, h, mask)`` or ``*args``), else as
one tuple (a lone tensor stays a lone tensor, so single-tensor models see no
difference). The first stage's inputs follow the same rule.
Only floating-point tensors carry gradients; int masks and None travel along
with a None gradient. A received floating tensor requires grad when the sending
stage produced it requiring grad (``requires_grad`` of F, from the message
header; rrfp/pipeline/boundary.py): constants stay constants.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError
from torch.utils.flop_counter import FlopCounterMode

from rrfp.core.tasks import Kind, Task
from rrfp.nn.grad_accumulation import one_pass
from rrfp.nn.moe_aux_loss import aux_loss_scale
from rrfp.nn.split_functions import SplitFunctions, split_modules
from rrfp.nn.split_linear import WeightGradQueue, collect_weight_grads
from rrfp.pipeline.boundary import received, requires_grad_bits
from rrfp.pipeline.split_backward import weight_split
from rrfp.pipeline.split_backward.weight_split import WeightWork, queued_parameters
from rrfp.pipeline.user_code import (
    about_shapes,
    blame,
    calling,
    first_layer_takes,
    function_name,
    in_user_frames,
    module_name,
    shape_of,
)

log = logging.getLogger(__name__)


# how W is split from B: "autograd" (the generic split), "layers" (split-aware layers queue their
# own W, the generic split the rest), "functions" (also the module's own linear, norm, embedding
# and scale ops, rrfp/nn/split_functions.py)
WORKER_SPLIT_MODES = ("autograd", "layers", "functions")
WHOLE_STAGE = "B runs this stage's whole backward and W nothing (schedule.unsplit_stages)"


class _State(enum.Enum):
    F_DONE = "F done"
    B_DONE = "B done"
    FINISHED = "finished"


@dataclass
class _Slot:
    """What one microbatch holds between its F and its last backward task."""

    state: _State
    input: (
        torch.Tensor | tuple | None
    )  # as the module got it: a tensor, or a tuple of tensors and None
    output: torch.Tensor | tuple | list | None  # stage output, or the scaled loss on the last stage
    queue: WeightGradQueue
    nbytes: int
    weights: WeightWork | None = None  # split backward: what W computes with autograd
    dw_runner: Callable[[], None] | None = None  # split backward with a dw_builder: what W runs
    functions: bool = False  # F ran the split-aware functions (mode "functions")


@dataclass(frozen=True)
class SplitSummary:
    """How much of a stage's weight-gradient work its W tasks carry.

    ``w_share`` is measured in FLOPs (torch.utils.flop_counter: matmuls, convolutions and
    attention; elementwise work is not counted) on the first microbatch whose backward
    was split: W's FLOPs over all weight-gradient FLOPs, those B computed included."""

    in_b: dict  # parameter name -> why its gradient is computed in B
    params: int  # parameters the split covers (split-aware layers' own queue excluded)
    w_share: float | None  # None until a split microbatch has run W (or nothing to measure)


class StageWorker:
    """Runs F(mb), B(mb), W(mb) of stage `stage` of `num_stages` on `module`."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        split: bool,
        measure_activations: bool = True,
        weight_split: str = "autograd",
        dw_builder: Callable[[], Callable[[], None]] | None = None,
        whole: bool = False,
    ) -> None:
        if weight_split not in WORKER_SPLIT_MODES:
            raise ValueError(
                f"weight_split must be one of {', '.join(map(repr, WORKER_SPLIT_MODES))}, "
                f"got {weight_split!r}"
            )
        self.weight_split = weight_split
        self._queued = queued_parameters(
            module
        )  # left to split-aware layers' own W queue (modes "layers" and "functions")
        self._functions: set[int] = (
            set()
        )  # parameters split-aware functions queued (mode "functions")
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
        if n_microbatches <= 0:
            raise ValueError(f"n_microbatches must be positive, got {n_microbatches}")
        if whole and not split:
            raise ValueError(
                "whole=True is a split schedule's stage whose B runs the whole backward; "
                "with split=False every B does"
            )
        # a stage of a split schedule that does not split (schedule.unsplit_stages): its W tasks
        # still run, in the schedule's order, and do nothing. The split's own cost (F's split-aware
        # functions and graph analysis, B and W apart) buys overlap only where the stage has a
        # bubble to fill; on the stage that limits the pipeline it is pure cost
        self.whole = whole
        # mode "functions": the module's own linears, norms and embeddings split their ops, and
        # the torch-function mode intercepts the ops of the modules that own a bare parameter;
        # every op where the stage module owns one, and on CUDA: autograd recomputes a
        # checkpointed region on its device thread, which sees the caller's mode stack but not
        # its context variables (split_functions._ACTIVE)
        self._intercept = (  # nothing to make split-aware on a stage that runs whole
            split
            and not whole
            and weight_split == "functions"
            and (split_modules(module) or any(p.is_cuda for p in module.parameters()))
        )
        self.module, self.stage, self.num_stages = module, stage, num_stages
        self._splat = takes_several(module)  # a tuple input becomes separate arguments
        self.n_microbatches, self.loss_fn, self.split = n_microbatches, loss_fn, split
        # torch's PipelineStage(dw_builder=): weight gradients that the module's own autograd
        # functions leave to a runner (zero-bubble custom functions). As torch's stage does, B then
        # runs the whole autograd backward, and the runner dw_builder() builds right after it runs
        # as W (split), or at once (whole backward)
        self.dw_builder = dw_builder
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.measure_activations = (
            measure_activations  # hooks on every saved tensor: only for byte budgets
        )
        self.losses: dict[int, torch.Tensor] = {}  # last stage: unscaled loss of each microbatch
        self._slots: dict[int, _Slot] = {}
        self._names = {id(p): n for n, p in module.named_parameters()}
        self._in_b: dict[str, str] = {}  # parameter name -> why B computes its gradient
        self._said_unsplit = False  # logged that the stage's graph cannot be split
        self._flops: dict | None = None  # first split microbatch: {"mb", "input", "b", "w"}

    # -- tasks ---------------------------------------------------------------

    def forward(
        self,
        mb: int,
        x,
        targets: torch.Tensor | None = None,
        requires_grad: list[bool] | None = None,
    ):
        """F(mb). Returns the detached output to send (a tensor, or a tuple/list as the module
        returned it), or the (unscaled) loss on the last stage. ``requires_grad``: per received
        tensor, whether its sender produced it requiring grad (None: every floating one did)."""
        self._check(Task(Kind.F, mb), None)
        if self.is_last and targets is None:
            raise RuntimeError(f"stage {self.stage}: F{mb} on the last stage needs targets")
        if not self.is_first:
            x = self._grad_leaves(mb, x, requires_grad)
        queue = WeightGradQueue()
        counter = _SavedBytes(self.module) if self.measure_activations else None
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack)
            if counter is not None
            else contextlib.nullcontext()
        )
        # the split-aware functions where B has an input gradient to compute: on a first stage W
        # runs the whole backward (weight_split.WeightWork.in_w), with nothing to split
        functions = (
            SplitFunctions(queue, intercept=self._intercept)
            if self.split
            and not self.whole
            and self.weight_split == "functions"
            and not self.is_first
            and any(_carries_grad(t) for t in _flat(x))
            else contextlib.nullcontext()
        )
        use_queue = (
            self.split
            and not self.whole
            and (self.weight_split == "layers" or isinstance(functions, SplitFunctions))
        )
        # the loss of a microbatch is divided by M: so is the gradient its MoE layers' auxiliary
        # losses inject (rrfp/nn/moe_aux_loss.py)
        aux_scale = aux_loss_scale(1 / self.n_microbatches)
        with (
            torch.enable_grad(),
            collect_weight_grads(queue if use_queue else None),
            functions,
            hooks,
            aux_scale,
        ):
            out = self._run_module(x)
            if self.is_last:
                loss = self._loss(out, targets)
                out = loss / self.n_microbatches
        outputs = _flat(out)
        if not self.is_last:
            self._check_output(mb, out, outputs)
        if counter is not None:  # what the slot keeps until B: the received inputs and the outputs
            for t in outputs + ([] if self.is_first else _flat(x)):
                if isinstance(t, torch.Tensor):
                    counter.add(t)
        nbytes = counter.total if counter is not None else 0
        weights = None
        if self.whole:
            weights = WeightWork(whole=WHOLE_STAGE)
            self._unsplit(WHOLE_STAGE, asked=True)
        elif self.split and self.dw_builder is None:
            deferred = self._deferred if use_queue else frozenset()
            if isinstance(functions, SplitFunctions) and functions.deferred:
                self._functions.update(functions.deferred)
                deferred = deferred | functions.deferred
            weights = weight_split.analyse(
                self.module,
                [t for t in outputs if _carries_grad(t)],
                [] if self.is_first else [t for t in _flat(x) if _carries_grad(t)],
                deferred,
            )
            for p in weights.in_b:
                self._in_b.setdefault(self._names.get(id(p), "?"), weights.reasons[id(p)])
            if weights.whole:
                self._unsplit(weights.whole)
        self._slots[mb] = _Slot(
            _State.F_DONE,
            None if self.is_first else x,
            out,
            queue,
            nbytes,
            weights,
            functions=isinstance(functions, SplitFunctions),
        )
        if self.is_last:
            self.losses[mb] = (
                loss.detach()
            )  # stays on the device: read once per iteration, not per task
            return self.losses[mb]
        if isinstance(out, torch.Tensor):
            return out.detach()
        detached = [None if t is None else t.detach() for t in out]
        return detached if isinstance(out, list) else tuple(detached)

    def output_requires_grad(self, mb: int) -> list[bool]:
        """Between F(mb) and B(mb): which of F(mb)'s outputs carry a gradient, known before F
        detached them. The message to the next stage says so per tensor, so a constant arrives as
        one."""
        slot = self._check(Task(Kind.B, mb), _State.F_DONE)
        return requires_grad_bits(slot.output)

    def evaluate(self, x, targets=None):
        """F without a graph (evaluation): (output, unscaled loss on the last stage, else None).
        Keeps nothing and checks no task order: it is no part of a training iteration."""
        with torch.no_grad():
            out = self._run_module(x)
            return out, self._loss(out, targets) if self.is_last and targets is not None else None

    def _run_module(self, x):
        """The stage module on ``x``: its error is the user's forward's, with the input's shapes."""
        where = f"the forward of stage {self.stage} ({module_name(self.module)})"
        with calling(where, lambda e: self._input_detail(x, about_shapes(e))):
            return (
                self.module(*x) if self._splat and isinstance(x, (tuple, list)) else self.module(x)
            )

    def _loss(self, out, targets):
        """The workload's loss: its error is the user's loss's, with both shapes."""
        with calling(
            f"the loss ({function_name(self.loss_fn)})",
            lambda e: (
                f"it got the output {shape_of(out)} and the targets {shape_of(targets)}"
                + (
                    ": make the last stage's output and the batches' targets fit the loss"
                    if about_shapes(e)
                    else ""
                )
            ),
        ):
            return self.loss_fn(out, targets)

    def _input_detail(self, x, shapes: bool) -> str:
        """What the forward got, and from whom: the batch's inputs, or the previous stage's
        output; with the first layer's input size and what to fix when the error is about
        ``shapes``."""
        if self.is_first:
            return f"its input (from the workload's batches) is {shape_of(x)}"
        prev, me = self.stage - 1, self.stage
        sent = f"stage {prev} sent {shape_of(x)}"
        if not shapes:
            return sent
        takes = first_layer_takes(self.module)
        expected = f"; stage {me}'s first layer, {takes}" if takes else ""
        return f"{sent}{expected}: make stage {prev}'s output fit stage {me}'s input"

    def backward(self, mb: int, grad_output=None):
        """B(mb). Returns the gradient for the stage input in the input's structure: a tensor (or
        None) for a lone tensor, else a tuple with None where no gradient exists; None on the first
        stage.

        ``grad_output`` matches the output: a tensor, or a tuple/list with None for outputs that
        carry no gradient. Only floating outputs that require grad and got a gradient take part."""
        slot = self._check(Task(Kind.B, mb), _State.F_DONE)
        outputs = _flat(slot.output)
        if self.is_last:
            if grad_output is not None:
                raise RuntimeError(
                    f"stage {self.stage}: B{mb} on the last stage takes no grad_output"
                )
            pairs = [(slot.output, None)]  # the scaled loss: autograd seeds it with 1
        else:
            if grad_output is None and any(_carries_grad(t) for t in outputs):
                raise RuntimeError(
                    f"stage {self.stage}: B{mb} needs grad_output from stage {self.stage + 1}"
                )
            grads = _flat(grad_output) if grad_output is not None else [None] * len(outputs)
            if len(grads) != len(outputs):
                raise RuntimeError(
                    f"stage {self.stage}: B{mb} got {len(grads)} grad_output tensor(s) "
                    f"for {len(outputs)} output(s)"
                )
            for i, (o, g) in enumerate(zip(outputs, grads)):
                if o is not None and g is not None and g.shape != o.shape:
                    which = " " if len(outputs) == 1 else f" {i} "
                    raise RuntimeError(
                        f"stage {self.stage}: B{mb} grad_output{which}shape {tuple(g.shape)} "
                        f"!= output{which}shape {tuple(o.shape)}"
                    )
            pairs = [(o, g) for o, g in zip(outputs, grads) if _carries_grad(o) and g is not None]
        inputs = [] if slot.input is None else [t for t in _flat(slot.input) if _carries_grad(t)]
        with self._user_backward():
            found = self._backward(mb, slot, pairs, inputs)
        grad_input = None if slot.input is None else _in_structure(slot.input, inputs, found)
        slot.input = slot.output = None
        if self.dw_builder is not None:
            with self._user_backward():
                if self.split and not self.whole:
                    slot.dw_runner = self.dw_builder()
                else:
                    self.dw_builder()()
        if self.split:
            slot.state = _State.B_DONE
        else:
            self._finish(mb, slot)
        return grad_input

    def _backward(self, mb: int, slot: _Slot, pairs: list, inputs: list) -> list:
        """B's autograd work: the gradients of ``inputs`` (and the weights', unless split)."""
        outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if not pairs:  # no gradient reaches this stage's outputs: nothing to do in B or W
            found = []
        elif slot.weights is not None:  # input gradient only; W does the weights
            if (
                self._measured(mb) and slot.weights.in_b and not self._deferred
            ):  # B without them, once
                # (not with split-aware layers: an extra backward would queue their W twice)
                self._flops["input"] = _flops(
                    lambda: (
                        torch.autograd.grad(
                            outs, inputs, grads, retain_graph=True, allow_unused=True
                        )
                        if inputs
                        else None
                    )
                )
            with (
                self._counting(mb, "b"),
                self._layers_checkpoint(Task(Kind.B, mb)),
                one_pass(),
                self._recomputing(slot),
            ):
                found = weight_split.backward_input(slot.weights, outs, grads, inputs)
        else:
            torch.autograd.backward(outs, grads)
            found = [t.grad for t in inputs]
        return found

    @contextlib.contextmanager
    def _user_backward(self):
        """An error autograd raises from the user's own code (a custom Function's backward, a
        hook) or its in-place check (the forward changed a saved tensor) is the user's backward's;
        anything else in B or W is rrfp's."""
        try:
            yield
        except Exception as e:
            if in_user_frames(e) or "modified by an inplace operation" in str(e):
                blame(e, f"the backward of stage {self.stage} ({module_name(self.module)})")
            raise

    def weight(self, mb: int) -> None:
        """W(mb): run the weight-gradient closures B queued."""
        if not self.split:
            raise RuntimeError(
                f"stage {self.stage}: W{mb} called but the backward is not split "
                "(split=False: B computes all gradients)"
            )
        slot = self._check(Task(Kind.W, mb), _State.B_DONE)
        # one pass per task (B or W of a microbatch): each parameter's post-accumulate-grad hooks
        # run once, also for a weight both gathered by the split and queued by its layer
        with (
            self._user_backward(),
            self._counting(mb, "w"),
            self._layers_checkpoint(Task(Kind.W, mb)),
            one_pass(),
        ):
            if (
                slot.weights is not None
            ):  # first: on the first stage it also runs the layers that queue closures
                with self._recomputing(slot):
                    weight_split.backward_weight(slot.weights)
            # the closures recompute nothing: outside the mode, their ops do not dispatch through
            # Python
            slot.queue.run()
            if slot.dw_runner is not None:
                slot.dw_runner()
        self._finish(mb, slot)

    @contextlib.contextmanager
    def _recomputing(self, slot: _Slot):
        """Around B and W of a microbatch whose F ran the split-aware functions: a checkpointed
        region that autograd recomputes there runs them as its forward did, so it saves what F
        saved."""
        if not slot.functions:
            yield
            return
        with (
            collect_weight_grads(slot.queue),
            SplitFunctions(slot.queue, intercept=self._intercept),
        ):
            yield

    @contextlib.contextmanager
    def _layers_checkpoint(self, task: Task):
        """Mode "layers" and torch.utils.checkpoint(use_reentrant=False): the recomputation runs the
        split-aware layers outside the W queue, so its saved tensors differ from the forward's."""
        try:
            yield
        except CheckpointError as e:
            if self.weight_split != "layers":
                raise
            raise RuntimeError(
                f"stage {self.stage}: {task}: weight_split='layers' cannot run split-aware layers "
                "inside torch.utils.checkpoint(use_reentrant=False): its recomputation runs them "
                "outside the W queue; use weight_split='autograd' (the default). torch said: "
                f"{str(e).splitlines()[0]}"
            ) from e

    def _unsplit(self, why: str, asked: bool = False) -> None:
        """Unsplittable graph (or a stage ``asked`` to run whole): say so once, and count the
        stage's parameters as computed in B."""
        if self._said_unsplit:
            return
        self._said_unsplit = True
        log.log(logging.INFO if asked else logging.WARNING, "stage %d: %s", self.stage, why)
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in self._deferred:
                self._in_b[name] = why

    def split_summary(self) -> SplitSummary:
        """Which weight gradients stay in B and why, and the measured share of that work in W."""
        share = None
        f = self._flops
        if f is not None and "w" in f:
            in_b = f.get("b", 0) - f.get("input", f.get("b", 0))
            share = f["w"] / (f["w"] + in_b) if f["w"] + in_b > 0 else None
        params = sum(
            1 for p in self.module.parameters() if p.requires_grad and id(p) not in self._deferred
        )
        return SplitSummary(dict(self._in_b), params, share)

    @property
    def _deferred(self) -> frozenset[int]:
        """Parameters that split-aware layers' W queue owns: none in mode "autograd"; in mode
        "functions" also those the split-aware functions queued in a forward so far."""
        if self.weight_split == "autograd" or self.whole:
            return frozenset()
        return self._queued | self._functions if self._functions else self._queued

    def _measured(self, mb: int) -> bool:
        """Whether mb is the microbatch whose split backward split_summary measures (the first)."""
        if self._flops is None:
            self._flops = {"mb": mb}
        return self._flops["mb"] == mb

    @contextlib.contextmanager
    def _counting(self, mb: int, what: str):
        """Count the FLOPs of ``what`` ("b" or "w") when mb is the measured microbatch."""
        if not self._measured(mb) or what in self._flops:
            yield
            return
        with StageFlopCounter() as counter:
            yield
        self._flops[what] = counter.get_total_flops()

    def reset(self) -> None:
        """Start a new iteration: every microbatch must have finished its last backward."""
        if self.inflight:
            raise RuntimeError(
                f"stage {self.stage}: reset with microbatches in flight {list(self.inflight)}"
            )
        self._slots.clear()
        self.losses.clear()

    # -- state ---------------------------------------------------------------

    @property
    def inflight(self) -> tuple[int, ...]:
        """Microbatches whose F is done and whose last backward task (W if split, else B) is not."""
        return tuple(sorted(m for m, s in self._slots.items() if s.state is not _State.FINISHED))

    def activation_bytes(self, mb: int) -> int:
        """Bytes the autograd graph saved for mb in F, plus its output (parameters excluded)."""
        slot = self._slots.get(mb)
        return 0 if slot is None or slot.state is _State.FINISHED else slot.nbytes

    def _check(self, task: Task, want: _State | None) -> _Slot | None:
        mb = task.mb
        if not 0 <= mb < self.n_microbatches:
            raise RuntimeError(
                f"stage {self.stage}: {task} out of range (n_microbatches={self.n_microbatches})"
            )
        slot = self._slots.get(mb)
        have = None if slot is None else slot.state
        if have is want:
            return slot
        if want is None:
            raise RuntimeError(
                f"stage {self.stage}: {task} twice in one iteration (call reset() between "
                "iterations)"
            )
        if have is None:
            raise RuntimeError(f"stage {self.stage}: {task} before F{mb}")
        if want is _State.B_DONE and have is _State.F_DONE:
            raise RuntimeError(f"stage {self.stage}: {task} before B{mb}")
        raise RuntimeError(f"stage {self.stage}: {task} twice in one iteration")

    def _finish(self, mb: int, slot: _Slot) -> None:
        slot.state, slot.queue, slot.nbytes, slot.weights, slot.dw_runner = (
            _State.FINISHED,
            WeightGradQueue(),
            0,
            None,
            None,
        )

    def _grad_leaves(self, mb: int, x, bits: list[bool] | None):
        """A received input as autograd leaves: floats its sender had require grad require it (all
        floats when ``bits`` is None); other tensors and None pass."""
        if not isinstance(x, torch.Tensor) and (
            not isinstance(x, (tuple, list))
            or not all(t is None or isinstance(t, torch.Tensor) for t in x)
        ):
            raise RuntimeError(
                f"stage {self.stage}: F{mb} input must be a tensor or a tuple of tensors and None, "
                f"got {_describe(x)}"
            )
        try:
            return received(x, bits)
        except ValueError as e:
            raise RuntimeError(f"stage {self.stage}: F{mb}: {e}") from None

    def _check_output(self, mb: int, out, outputs: list) -> None:
        """What a stage sends on must fit a message: tensors and None, at least one entry."""
        if (
            not isinstance(out, (torch.Tensor, tuple, list))
            or not outputs
            or not all(t is None or isinstance(t, torch.Tensor) for t in outputs)
        ):
            raise RuntimeError(
                f"stage {self.stage}: F{mb} output must be a tensor or a non-empty tuple/list "
                f"of tensors and None, got {_describe(out)}"
            )


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: every FLOP counts under "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _CountAsRun(TorchDispatchMode):
    """Runs every op with the kernel it would run anyway and counts it with torch's registry.
    torch's own mode runs an op it has no count for through the op's Python decomposition when
    there is one (``silu_backward``: ``math_silu_backward``), whose rounding differs from the
    kernel's: the measured microbatch would compute other gradients than the rest, so a run
    resumed from a checkpoint, which measures its own first step again, would leave the unbroken
    run by an ulp."""

    def __init__(self, counter: FlopCounterMode) -> None:
        super().__init__()
        self.counter = counter

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Leaves ``__torch_dispatch__`` unwrapped. torch wraps it in ``torch._disable_dynamo``,
        which imports torch._dynamo at the first op (about 2 CPU-s a process: a script that builds
        no optimizer would pay it for this count alone). Nothing is lost: dynamo compiles no frame
        while a dispatch mode is on the stack."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return self.counter._count_flops(func._overloadpacket, out, args, kwargs)


class StageFlopCounter(FlopCounterMode):
    """torch's FLOP counter without its module tracker and without decomposing. The tracker
    (torch/utils/module_tracker.py) installs process-wide module forward hooks that put multi-grad
    hooks on the tensors of every forward any thread runs meanwhile; a later ``autograd.grad``
    through such a tensor fails with "A leaf node was passed to _will_engine_execute_node". Ranks
    run as threads in one process, a user's own threads, or the drop-in's background loop would
    hit it. Only the total is used, and the ops compute as they do uncounted (``_CountAsRun``)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()

    def __enter__(self) -> StageFlopCounter:
        self.flop_counts.clear()
        self._running = _CountAsRun(self)
        self._running.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._running.__exit__(*exc)
        del self._running  # breaks the cycle through the mode


def _flops(fn) -> int:
    with StageFlopCounter() as counter:
        fn()
    return counter.get_total_flops()


def _flat(value) -> list:
    """A tensor (or None) as a one-element list; a tuple or list as a list."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _carries_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()


def _in_structure(x, inputs: list, grads: list):
    """The gradients of ``inputs`` (the grad-carrying entries of ``x``) laid out like ``x``."""
    by_id = {id(t): g for t, g in zip(inputs, grads)}
    if isinstance(x, torch.Tensor):
        return by_id.get(id(x))
    return tuple(None if t is None else by_id.get(id(t)) for t in x)


def takes_several(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes a stage's several input tensors as separate positional
    arguments (``forward(self, h, mask)`` or ``*args``, as torch.distributed.pipelining calls it)
    rather than one tuple (``forward(self, x)``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: one tuple, the default
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > 1 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of ({', '.join(type(t).__name__ for t in value)})"
    return type(value).__name__


class _SavedBytes:
    """Counts the storage autograd keeps for backward, once per storage, parameters excluded."""

    def __init__(self, module: nn.Module) -> None:
        self._seen = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.total = 0

    def add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (
            RuntimeError,
            NotImplementedError,
        ):  # no plain storage (sparse, nested): not counted
            return
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.total += storage.nbytes()

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.add(t)
        kept = t.detach()  # keeping t itself could tie a saved output to its own grad_fn (a cycle)
        return kept, kept._version  # a detached tensor shares t's version counter


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Autograd skips its in-place check for tensors that went through saved-tensor hooks, so it is
    made here: a saved tensor modified in place after F would give silently wrong gradients."""
    t, version = packed
    if t._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (the stage's forward changed a tensor in "
            f"place after autograd saved it, as plain PyTorch also refuses)"
        )
    return t
