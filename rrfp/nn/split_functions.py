"""Split-aware backward formulas for a module's own ops, with no change to the module.

The generic split (rrfp/pipeline/split_backward/weight_split.py) restarts autograd in W at every
node where B left weight work behind: one engine call per such node, a layer norm's backward run
in B and again in W, and, under activation checkpointing, every checkpointed region recomputed a
second time for W. The ops that carry a stage's weight FLOPs have simple gradients, so under
``SplitFunctions`` (entered by the stage worker around F, B and W) each of them, applied to a
leaf parameter in grad mode, runs as a custom autograd Function whose
backward computes the input gradient and queues a closure for W (``WeightGradQueue``). A product's
closure computes the parameter's gradient from what B already holds (the saved input and the
gradient arriving there); a norm's or a scale's weight gradient is a reduction with no FLOPs worth
deferring, so B computes it beside the input's (one kernel call, where W would recompute the
normalized input) and its closure only adds it to ``.grad``. W then needs neither the graph nor a
recomputation for those parameters, and every parameter's gradient is final after W.

Covered: ``F.linear`` (nn.Linear, attention's projections), ``F.layer_norm``, ``F.rms_norm``
(nn.RMSNorm, rrfp/nn/split_rms_norm.py), ``F.embedding``
(dense, no max_norm) and an elementwise product with a parameter (the weight of an RMSNorm written
out by hand, as HF's Llama is). Anything else (a computed weight, a frozen one, other ops on
parameters) stays with the generic split, which treats the queued parameters as another owner
(mode "layers"). The ops reach the rules through the stage's own linear, norm and embedding
modules (``split_modules``), and through a ``TorchFunctionMode`` that intercepts the ops of each
module that owns a parameter outside them (every op, where the stage module itself owns one).
``SplitFunctions`` is also active when B or W recomputes a checkpointed region, so the
recomputation saves what the forward saved.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from rrfp.nn.grad_accumulation import accumulate_grad, queue_accumulation
from rrfp.nn.split_linear import QUEUEING_NODES as split_linear_nodes
from rrfp.nn.split_linear import WeightGradQueue, split_linear
from rrfp.nn.split_rms_norm import split_rms_norm


def _splits(w: torch.Tensor | None) -> bool:
    """Whether a parameter's gradient can be queued: a leaf that wants one (or no parameter)."""
    return w is None or (w.grad_fn is None and w.requires_grad)


class _LayerNormFn(torch.autograd.Function):
    """A layer norm whose weight and bias gradients B computes in the same kernel call as the
    input's (a reduction over rows: no FLOPs worth deferring, and W would recompute the normalized
    input), and W adds to ``.grad``, so they are final after W as every other parameter's."""

    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps, queue):
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.shape, ctx.queue, ctx.params = shape, queue, (weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        need = [ctx.needs_input_grad[i] for i in (0, 2, 3)]
        grad_x, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad, x, ctx.shape, mean, rstd, weight, bias, need
        )
        grads = [(p, g) for p, g, n in zip(ctx.params, (gw, gb), need[1:]) if n]
        if grads:
            queue_accumulation(ctx.queue, grads)
        return grad_x, None, None, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, padding_idx, scale_grad_by_freq, queue):
        ctx.save_for_backward(indices)
        ctx.param, ctx.queue = weight, queue
        ctx.rows, ctx.padding_idx, ctx.scale = weight.shape[0], padding_idx, scale_grad_by_freq
        return F.embedding(indices, weight, padding_idx, scale_grad_by_freq=scale_grad_by_freq)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        param, rows, pad, scale = ctx.param, ctx.rows, ctx.padding_idx, ctx.scale

        def run() -> None:
            g = torch.ops.aten.embedding_dense_backward(
                grad, indices, rows, -1 if pad is None else pad, scale
            )
            accumulate_grad(param, g, owned=True)

        ctx.queue.append(run)
        return None, None, None, None, None


class _ScaleFn(torch.autograd.Function):
    """``x * weight`` for a parameter ``weight`` that broadcasts to ``x``'s shape. The weight's
    gradient is a reduction, computed in B and added in W (as a layer norm's)."""

    @staticmethod
    def forward(ctx, x, weight, queue):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.queue = weight, queue
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        param = ctx.param
        queue_accumulation(ctx.queue, [(param, (grad * x).sum_to_size(param.shape))])
        return (grad * weight if ctx.needs_input_grad[0] else None), None, None


def _linear(queue, x, weight, bias=None):
    if not (_splits(weight) and weight.requires_grad and _splits(bias)):
        return NotImplemented
    return split_linear(x, weight, bias, queue), [weight, bias]


def _layer_norm(queue, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if weight is None or not (_splits(weight) and _splits(bias)):
        return NotImplemented
    shape = list(normalized_shape)
    return _LayerNormFn.apply(x, shape, weight, bias, eps, queue), [weight, bias]


def _embedding(
    queue,
    indices,
    weight,
    padding_idx=None,
    max_norm=None,
    norm_type=2.0,
    scale_grad_by_freq=False,
    sparse=False,
):
    if max_norm is not None or sparse or not (_splits(weight) and weight.requires_grad):
        return NotImplemented
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _EmbeddingFn.apply(indices, weight, padding_idx, scale_grad_by_freq, queue), [weight]


def _scale(queue, a, b):
    """An elementwise product with a parameter that broadcasts to the other operand's shape, both
    of one floating dtype (an RMSNorm's weight); anything else stays with autograd."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    x, w = (a, b) if isinstance(b, torch.nn.Parameter) else (b, a)
    if (
        not isinstance(w, torch.nn.Parameter)
        or isinstance(x, torch.nn.Parameter)
        or not w.requires_grad
        or w.dtype != x.dtype
        or not w.is_floating_point()
        or torch.broadcast_shapes(x.shape, w.shape) != x.shape
    ):
        return NotImplemented
    return _ScaleFn.apply(x, w, queue), [w]


_SPLITS: dict[Callable, Callable] = {
    F.linear: _linear,
    F.layer_norm: _layer_norm,
    F.rms_norm: split_rms_norm,  # nn.RMSNorm (rrfp/nn/split_rms_norm.py)
    F.embedding: _embedding,
    torch.mul: _scale,
    torch.Tensor.mul: _scale,
    torch.Tensor.__mul__: _scale,
    torch.Tensor.__rmul__: _scale,
}

# the autograd nodes of these Functions and of the split linear (rrfp/nn/split_linear.py): their
# backward queues their parameters' W
QUEUEING_NODES = (
    *split_linear_nodes,
    "_LayerNormFnBackward",
    "_EmbeddingFnBackward",
    "_ScaleFnBackward",
    "_RMSNormFnBackward",
)


class SplitFunctions(TorchFunctionMode):
    """Inside, the covered ops on leaf parameters queue their weight gradients to ``queue``;
    ``deferred`` collects the ids of the parameters they queued for.

    ``intercept=False``: only the modules ``split_modules`` made split-aware split their ops, and
    only the forwards of modules that own a bare parameter run under the mode. A torch-function
    mode costs every op a call of ``__torch_function__`` in Python (about 8 µs, a few percent of a
    small stage's forward), so it runs where nothing else reaches a parameter."""

    def __init__(self, queue: WeightGradQueue, intercept: bool = True) -> None:
        super().__init__()
        self.queue = queue
        self.intercept = intercept
        self.depth = 0  # modules owning a bare parameter whose forward runs now (split_modules)
        self.deferred: set[int] = set()
        self._token: contextvars.Token | None = None

    def __enter__(self) -> SplitFunctions:
        self._token = _ACTIVE.set(self)
        return super().__enter__() if self.intercept else self

    def __exit__(self, *exc_info) -> None:
        if self.intercept:
            super().__exit__(*exc_info)
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None

    def split(self, func: Callable, *args, **kwargs):
        """``func(*args, **kwargs)`` with its weight gradient queued, or NotImplemented where no
        rule covers the call (autograd's own then)."""
        rule = _SPLITS.get(func)
        if rule is None or not torch.is_grad_enabled():
            return NotImplemented
        got = rule(self.queue, *args, **kwargs)
        if got is NotImplemented:
            return got
        out, params = got
        self.deferred.update(id(p) for p in params if p is not None)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.split(func, *args, **kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out


_ACTIVE: contextvars.ContextVar[SplitFunctions | None] = contextvars.ContextVar(
    "rrfp_split_functions", default=None
)


def _through(func: Callable, plain: Callable, *args):
    """A split-aware module's forward: its op split under active SplitFunctions, else ``plain``."""
    split = _ACTIVE.get()
    if split is not None:
        out = split.split(func, *args)
        if out is not NotImplemented:
            return out
    return plain(args[0])


class _SplitAware:
    """What the split-aware subclasses share: the user's class name in ``print(model)``."""

    def _get_name(self) -> str:
        return written_class(self).__name__  # type: ignore[arg-type]


def written_class(module: nn.Module) -> type:
    """The class the user wrote: a split-aware module's own type, which split_modules swapped."""
    cls = type(module)
    return _WRITTEN.get(cls, cls)


class _SplitAwareLinear(_SplitAware, nn.Linear):
    def forward(self, input):
        return _through(F.linear, super().forward, input, self.weight, self.bias)


class _SplitAwareLayerNorm(_SplitAware, nn.LayerNorm):
    def forward(self, input):
        args = (input, self.normalized_shape, self.weight, self.bias, self.eps)
        return _through(F.layer_norm, super().forward, *args)


class _SplitAwareRMSNorm(_SplitAware, nn.RMSNorm):
    def forward(self, x):
        args = (x, self.normalized_shape, self.weight, self.eps)
        return _through(F.rms_norm, super().forward, *args)


class _SplitAwareEmbedding(_SplitAware, nn.Embedding):
    def forward(self, input):
        args = (input, self.weight, self.padding_idx, self.max_norm, self.norm_type)
        return _through(F.embedding, super().forward, *args, self.scale_grad_by_freq, self.sparse)


_SPLIT_AWARE: dict[type, type] = {
    nn.Linear: _SplitAwareLinear,
    nn.LayerNorm: _SplitAwareLayerNorm,
    nn.RMSNorm: _SplitAwareRMSNorm,
    nn.Embedding: _SplitAwareEmbedding,
}
_WRITTEN: dict[type, type] = {aware: cls for cls, aware in _SPLIT_AWARE.items()}


def split_modules(module: nn.Module) -> bool:
    """Make ``module``'s own nn.Linear, nn.LayerNorm, nn.RMSNorm and nn.Embedding split-aware (as
    torch.nn.utils.parametrize does, by swapping each instance's class for a subclass): their
    forward splits its op under active SplitFunctions, and is theirs otherwise. Subclasses of
    those types keep their class: their forward may be anything. Any other submodule that owns a
    parameter wanting a gradient (HF Llama's RMSNorm, whose weight is a bare product) gets hooks
    that have SplitFunctions intercept the ops of its own forward. Returns whether ``module``
    itself owns such a parameter: its forward is the whole stage, so SplitFunctions must
    intercept every op. A use of a parameter outside its module's forward that nothing intercepts
    stays with autograd, and the generic split gives its gradient."""
    whole = False
    for m in module.modules():
        cls = type(m)
        aware = _SPLIT_AWARE.get(cls)
        if aware is not None:
            m.__class__ = aware
            continue
        if cls in _WRITTEN or getattr(m, "defers_weight_grad", False):
            continue  # made split-aware before (a worker built again), or a split-aware layer
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        if m is module:
            whole = True
        elif m not in _HOOKED:
            m.register_forward_pre_hook(_intercept_begins)
            m.register_forward_hook(_intercept_ends, always_call=True)
            _HOOKED.add(m)
    return whole


_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _intercept_begins(module: nn.Module, args) -> None:
    """Before a module that owns a bare parameter: the mode on, unless it already intercepts."""
    split = _ACTIVE.get()
    if split is not None and not split.intercept:
        if split.depth == 0:
            TorchFunctionMode.__enter__(split)
        split.depth += 1


def _intercept_ends(module: nn.Module, args, output) -> None:
    """After it, also when its forward raised (``always_call``): the mode off again."""
    split = _ACTIVE.get()
    if split is not None and not split.intercept and split.depth:
        split.depth -= 1
        if split.depth == 0:
            TorchFunctionMode.__exit__(split, None, None, None)
