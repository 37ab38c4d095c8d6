"""Adding a gradient computed outside autograd's own accumulation into ``.grad``.

The split backward (B and W) and the split-aware layers' W closures compute
parameter gradients themselves, so torch's AccumulateGrad node never runs for
those parameters. It does two things that users rely on, and this module does
them too (torch/csrc/autograd/functions/accumulate_grad.{h,cpp}):

- the first gradient becomes a tensor the parameter owns. Autograd may hand
  one tensor to several parameters (``F.linear(x, a + b)``), and an in-place
  grad op (``clip_grad_norm_``) on a shared one would act twice;
- before accumulating, it calls the parameter's tensor hooks
  (``Tensor.register_hook`` on a leaf: they see the gradient of one backward
  pass and may replace it), and after, its post-accumulate-grad hooks
  (``Tensor.register_post_accumulate_grad_hook``, torch's optimizer-in-backward
  recipe), each once per backward pass that reaches the parameter.

Inside ``one_pass()`` (a B or a W of one microbatch) each touched parameter's
hooks run once, when the pass ends, in no-grad mode as in backward; outside
one, at once. A parameter with tensor hooks has its pass's gradients summed
apart and added at the pass's end, so its hooks see the whole pass's gradient
as autograd's would; one without is added at once, holding nothing extra.
torch offers no public way to read or run those hooks: like torch's FSDP2
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``foreach_reduce``),
which assigns ``.grad`` itself, this reads the tensor's ``_backward_hooks`` and
``_post_accumulate_grad_hooks`` dicts, guarded so a torch without them runs none.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_PASS: contextvars.ContextVar[dict[int, list] | None] = contextvars.ContextVar(
    "rrfp_grad_accumulation_pass", default=None
)


def accumulate_grad(
    param: torch.Tensor, grad: torch.Tensor, owned: bool = False, hooked: bool = False
) -> None:
    """Add ``grad`` into ``param.grad`` (never overwrite it: a shared parameter's other uses
    may be there already); the first gradient is copied, so the parameter owns it, unless
    ``owned``: the caller made ``grad`` and holds it nowhere else (a split-aware formula's
    product), and a gradient of the parameter's dtype and strides is taken as it is, as torch's
    AccumulateGrad takes a gradient nothing else holds. ``hooked``: the gradient came from
    ``torch.autograd.grad``, which has run the parameter's tensor hooks on it already."""
    with one_pass():
        grad = grad.detach()
        entry = _touch(param)
        # a parameter with tensor hooks: summed over the pass, so its hooks see the pass's gradient
        if not hooked and _has_tensor_hooks(param):
            entry[1], entry[2] = (grad, owned) if entry[1] is None else (entry[1] + grad, True)
        else:
            _add(param, grad, owned)


def accumulate_product(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``accumulate_grad(param, a @ b, owned=True)``, as one ``addmm_`` into ``.grad`` where it
    is a dense gradient of the product's dtype and shape and nothing hooks the parameter's
    gradient (W's products add into a gradient the previous microbatches left)."""
    grad = param.grad
    fused = (
        grad is not None
        and not grad.is_sparse
        and grad.dtype == a.dtype == b.dtype
        and grad.shape == (a.shape[0], b.shape[1])
        and not _has_tensor_hooks(param)
    )
    if not fused:
        accumulate_grad(param, a.mm(b), owned=True)
        return
    with one_pass():
        _touch(param)
        grad.addmm_(a, b)


def _touch(param: torch.Tensor) -> list:
    """The current pass's entry for ``param`` ([param, gradient held for its tensor hooks, whether
    the pass owns it]): its hooks run when the pass ends."""
    return _PASS.get().setdefault(id(param), [param, None, False])


def _has_tensor_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None))


def _tensor_hooks(param: torch.Tensor) -> list:
    return list((getattr(param, "_backward_hooks", None) or {}).values())


def _add(param: torch.Tensor, grad: torch.Tensor, owned: bool) -> None:
    if param.grad is None:
        take = owned and grad.dtype == param.dtype and grad.stride() == param.stride()
        param.grad = grad if take else grad.to(param.dtype, copy=True)
    elif param.grad.is_sparse and not grad.is_sparse:  # as AccumulateGrad: the sum is dense
        param.grad = grad.to(param.grad.dtype) + param.grad
    else:
        param.grad.add_(grad)


@contextlib.contextmanager
def one_pass() -> Iterator[None]:
    """One backward pass of accumulations: each parameter touched inside gets its tensor hooks
    (on the pass's summed gradient) and post-accumulate-grad hooks called once at the end.
    Nested passes join the outer one."""
    if _PASS.get() is not None:
        yield
        return
    touched: dict[int, list] = {}
    token = _PASS.set(touched)
    try:
        yield
    finally:
        _PASS.reset(token)
    with torch.no_grad():
        for param, held, owned in touched.values():
            if held is not None:
                for hook in _tensor_hooks(param):
                    out = hook(held)
                    if out is not None:
                        held, owned = out, owned and out is held
                _add(param, held, owned)
            for hook in list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                if (
                    hook(param) is not None
                ):  # as torch refuses it (torch/csrc/autograd/python_hook.cpp)
                    raise RuntimeError(
                        "Tensor post accumulate grad hooks should return None "
                        f"(got one from {hook!r})."
                    )


def queue_accumulation(queue, grads: list) -> None:
    """Queue for W (a ``WeightGradQueue``) the accumulation of gradients that B computed: ``grads``
    pairs each parameter with its gradient, a reduction as small as the parameter (a norm's
    weight), so holding it until W costs little and W recomputes nothing."""

    def run() -> None:
        for param, grad in grads:
            accumulate_grad(param, grad, owned=True)

    queue.append(run)
