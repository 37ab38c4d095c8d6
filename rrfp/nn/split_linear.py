"""A linear layer whose backward is split into B (input grad) and W (weight grad).

Zero-bubble schedules run the weight-gradient half of a backward later (task W)
so that the input gradient (task B) reaches the previous stage sooner. The layer
returns the input gradient at once and appends a closure computing the weight and
bias gradients to the WeightGradQueue that was active when its *forward* ran.

The queue is captured at forward time (a ContextVar read in forward), not looked
up at backward time: on GPU the autograd engine runs backward on its own device
threads, where no thread-local or context variable set by the caller is visible.

With no active queue the layer is exactly nn.Linear (F.linear, grads in backward);
the single-process reference runs that way.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from rrfp.nn.grad_accumulation import (  # accumulate_grad: also imported from here
    accumulate_grad,
    accumulate_product,
    one_pass,
)

_ACTIVE: contextvars.ContextVar[WeightGradQueue | None] = contextvars.ContextVar(
    "rrfp_weight_grad_queue", default=None
)


class WeightGradQueue:
    """Deferred weight-gradient closures of one microbatch, run in order by W."""

    def __init__(self) -> None:
        self._closures: list[Callable[[], None]] = []

    def append(self, fn: Callable[[], None]) -> None:
        self._closures.append(fn)

    def run(self) -> None:
        """Run every closure in queue order, then forget them (and the tensors they hold). One
        backward pass: each parameter's post-accumulate-grad hooks run once, at the end."""
        closures, self._closures = self._closures, []
        with one_pass():
            for fn in closures:
                fn()

    def __len__(self) -> int:
        return len(self._closures)


@contextlib.contextmanager
def collect_weight_grads(queue: WeightGradQueue | None) -> Iterator[WeightGradQueue | None]:
    """Forwards run inside defer their weight grads to `queue` (None: compute them in backward)."""
    token = _ACTIVE.set(queue)
    try:
        yield queue
    finally:
        _ACTIVE.reset(token)


def active_queue() -> WeightGradQueue | None:
    return _ACTIVE.get()


class _Call:
    """One split product's state shared by its two autograd nodes: what the product needs, and
    the gradient arriving at its output, held from the product's backward to the input's."""

    __slots__ = ("weight", "bias", "queue", "reduce", "need_x", "shape", "grad_out")

    def __init__(self, weight, bias, queue, reduce, need_x: bool) -> None:
        self.weight, self.bias, self.queue, self.reduce = weight, bias, queue, reduce
        self.need_x = need_x  # whether the input wants a gradient (the product's own always does)
        self.shape = None
        self.grad_out = None


class _SplitLinearInputFn(torch.autograd.Function):
    """Before the product: saves its input and edges to the parameters. A non-reentrant
    checkpoint's recomputation stops once the region's last saved tensor is saved again, and
    torch's own ops save their inputs before computing, so the product that ends a region (an
    MLP's down projection) is skipped there; saving here, before the product, keeps that."""

    @staticmethod
    def forward(ctx, x, weight, bias, call):
        ctx.save_for_backward(x)
        ctx.call = call
        ctx.set_materialize_grads(False)  # no input gradient: None, not zeros
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (x,) = ctx.saved_tensors
        call = ctx.call
        grad_out, call.grad_out = call.grad_out, None
        if grad_out is not None:
            need_w, need_b = ctx.needs_input_grad[1:3]
            _queue_weight_grad(call.queue, x, grad_out, call.weight, call.bias, need_w, need_b)
        return grad_x, None, None, None


class _SplitLinearFn(torch.autograd.Function):
    """The product: its backward computes the input gradient and hands the output's gradient to
    the input's node, which queues the weight's."""

    @staticmethod
    def forward(ctx, x, call):
        ctx.call = call
        call.shape = x.shape
        weight, bias, reduce = call.weight, call.bias, call.reduce
        if reduce is None:  # on 2-D rows: the result is no view (see split_linear)
            return F.linear(x.reshape(-1, x.shape[-1]), weight, bias)
        out = reduce(F.linear(x, weight))
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):
        call = ctx.call
        call.grad_out = grad_out
        return (_input_grad(grad_out, call.weight, call.shape) if call.need_x else None), None


def _hooked_linear(x, weight, bias, queue: WeightGradQueue, hooks) -> torch.Tensor:
    """The split linear with no Python node: ``F.linear`` on 2-D rows and the detached parameters,
    whose native backward computes the input gradient alone, and a pre-hook on that node that, in
    B, queues W's closure from the gradient arriving there and the input it kept. (A node's
    pre-hook sees its output's gradient whatever the output went through after, an in-place op on
    a view of it among them; a tensor hook on a view changed in place never runs.) Needs an input
    that wants a gradient: otherwise the product has no node to hook.

    The input is kept as autograd keeps a saved tensor: through the active saved-tensor hooks
    (``hooks``: a non-reentrant checkpoint's, which then recomputes it in B; a count of saved
    bytes), packed before the product, as torch's own ops save their inputs before they compute,
    so a checkpoint's recomputation that ends at this product stops before computing it; with no
    hooks, the tensor itself, its version checked in B as autograd checks a saved tensor."""
    need_w, need_b = weight.requires_grad, bias is not None and bias.requires_grad
    pack, unpack = hooks if hooks is not None else (None, None)
    kept, version = (x if pack is None else pack(x)), x._version
    rows = F.linear(
        x.reshape(-1, x.shape[-1]), weight.detach(), None if bias is None else bias.detach()
    )

    def queue_w(grad_outputs: tuple[torch.Tensor, ...]) -> None:
        if unpack is not None:
            held = unpack(kept)
        elif kept._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a split linear's input is at version {kept._version}; "
                f"expected version {version} instead."
            )
        else:
            held = kept
        _queue_weight_grad(queue, held, grad_outputs[0], weight, bias, need_w, need_b)

    rows.grad_fn.register_prehook(queue_w)
    return rows


# the node whose backward queues the weight's W in the two-node form (its input's); the hooked
# form's weight is not in the graph
QUEUEING_NODES = ("_SplitLinearInputFnBackward",)


# the active saved-tensor hooks, ``(pack, unpack)`` (a non-reentrant checkpoint's, an activation
# count's) or None, asked per call with True; None on a torch without the query, where the two-node
# form, whose Function saves through autograd, is right either way
_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def split_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    queue: WeightGradQueue,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward returns the input gradient and
    appends the weight/bias-gradient closure to ``queue`` (the split-aware core).

    ``reduce``, if given, is applied to ``x @ weight.T`` before the bias is added
    and is treated as identity in backward (a tensor-parallel "reduce from the TP
    region": an all-reduce SUM of partial products, see rrfp.nn.tensor_parallel).
    """
    # both forms compute on 2-D rows (the result is no view: a view made inside a custom Function
    # cannot be modified in place, ``layer(x).relu_()``); the hooked form needs no Python node, the
    # two-node form serves ``reduce`` and an input that wants no gradient
    if reduce is None and x.requires_grad and _TOP_SAVED_TENSOR_HOOKS is not None:
        rows = _hooked_linear(x, weight, bias, queue, _TOP_SAVED_TENSOR_HOOKS(True))
    else:
        call = _Call(weight, bias, queue, reduce, x.requires_grad)
        rows = _SplitLinearFn.apply(_SplitLinearInputFn.apply(x, weight, bias, call), call)
    return rows.view(*x.shape[:-1], rows.shape[-1])


class _ReduceIdentityBackward(torch.autograd.Function):
    """``reduce`` in forward (on a copy: it may work in place), identity in backward."""

    @staticmethod
    def forward(ctx, x, reduce):
        return reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """What every split-aware layer computes: ``reduce(x @ weight.T) + bias``.

    Under an active queue (and grad mode), with a leaf weight and bias of which one wants a
    gradient, their gradients are deferred to W via ``split_linear``; otherwise it is plain
    autograd, exactly ``F.linear`` when there is no ``reduce``.
    """
    queue = _ACTIVE.get()
    # a computed weight (a parametrization: weight_norm, orthogonal) has no .grad of its own to
    # queue into, so only leaves are deferred; autograd carries the rest to the parameters they
    # come from. A frozen weight and bias leave nothing for W to do
    leaves = weight.grad_fn is None and (bias is None or bias.grad_fn is None)
    wanted = weight.requires_grad or (bias is not None and bias.requires_grad)
    if queue is not None and torch.is_grad_enabled() and leaves and wanted:
        return split_linear(x, weight, bias, queue, reduce)
    if reduce is None:
        return F.linear(x, weight, bias)
    y = _ReduceIdentityBackward.apply(F.linear(x, weight), reduce)
    return y if bias is None else y + bias


def init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """nn.Linear.reset_parameters on full-shape tensors (fan-in from ``weight``)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def _queue_weight_grad(
    queue: WeightGradQueue, x, grad_out, weight, bias, need_w: bool, need_b: bool
) -> None:
    """In B, either form: queue W's closure for the weight and bias that want a gradient."""
    if need_w or need_b:
        queue.append(
            _weight_grad_closure(x, grad_out, weight if need_w else None, bias if need_b else None)
        )


def _weight_grad_closure(x, grad_out, weight, bias) -> Callable[[], None]:
    """Called in B: W's closure for one product. The weight's gradient, a matmul, is computed in
    W; the bias's, a reduction over rows, now, while the output's gradient is in cache (as a norm's
    weight gradient, rrfp/nn/split_functions.py), and added in W."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    grad_bias = g.sum(0) if bias is not None else None

    def run() -> None:
        with torch.no_grad():
            if weight is not None:
                accumulate_product(weight, g.t(), x.reshape(-1, x.shape[-1]))
            if bias is not None:
                accumulate_grad(bias, grad_bias, owned=True)

    return run


def _input_grad(grad_rows: torch.Tensor, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The input's gradient in the input's shape, a tensor of its own (``matmul`` folds the rows and
    returns no view), so that autograd adds a second gradient into it in place."""
    return torch.matmul(grad_rows.view(*shape[:-1], grad_rows.shape[-1]), weight)


class SplitLinear(nn.Module):
    """nn.Linear (same parameters, same init) whose weight grad can be deferred to W."""

    defers_weight_grad = True  # under a split backward its parameters' gradients are final after W

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"SplitLinear sizes must be positive, got {in_features}x{out_features}"
            )
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Same as nn.Linear.reset_parameters."""
        init_like_linear(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
