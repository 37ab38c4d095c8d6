"""Which of the user's functions an exception came from, so that a run's error line can say it is
the user's to fix, not a bug of rrfp's.

rrfp calls the workload's code (``build_stage``, ``batches``, ``check``, the loss) and each stage's
module (forward, and backward through autograd). An exception raised there keeps its own type, so
a caller of the embedding APIs still catches what the model raised (``except TypeError``); what
rrfp knows at the call, which function it was and the shapes it passed, is attached to it as a
``UserCode`` record (``blame``), read back with ``user_code``. The executor adds the task and
iteration. ``rrfp train`` turns a marked exception into one line that names the user's function
(rrfp/app/job/failure.py); an unmarked one is rrfp's own bug.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from rrfp.nn.split_functions import written_class

ATTRIBUTE = "rrfp_user_code"  # the attribute of the exception that holds its UserCode


@dataclass
class UserCode:
    """Where in the user's code an exception was raised. ``where``: the function, as a line names
    it ("the forward of stage 1 (torch.nn.Linear)", "the loss (upkg.model.loss)"); ``detail``:
    what rrfp passed it and what to fix ("stage 0 sent [4, 16]; ..."); ``task``, ``iteration`` and
    ``stage``: the pipeline task that called it, when one did (set by the executor)."""

    where: str
    detail: str = ""
    task: str = ""
    iteration: int | None = None
    stage: int | None = None


class WorkloadError(ValueError):
    """A workload's function returned what its contract does not allow (``batches`` giving another
    number of microbatches than asked for): the user's to fix; raised by rrfp, marked as theirs."""


def blame(e: BaseException, where: str, detail: str = "") -> BaseException:
    """Mark ``e`` as raised in the user's ``where``; the innermost mark stays (a loss called from
    within a forward is the loss's error). Returns ``e``."""
    if getattr(e, ATTRIBUTE, None) is None:
        try:
            setattr(e, ATTRIBUTE, UserCode(where, detail))
        except (AttributeError, TypeError):  # an exception type that takes no attribute: unmarked
            pass
    return e


def user_code(e: BaseException) -> UserCode | None:
    """The mark ``blame`` left on ``e``, or None: not raised in the user's code."""
    mark = getattr(e, ATTRIBUTE, None)
    return mark if isinstance(mark, UserCode) else None


@contextlib.contextmanager
def calling(where: str, detail: Callable[[Exception], str] | None = None) -> Iterator[None]:
    """Any exception the block raises is the user's ``where``; ``detail(e)`` is called only then."""
    try:
        yield
    except Exception as e:
        blame(e, where, detail(e) if detail is not None else "")
        raise


SHAPE_WORDS = ("shape", "size", "dimension", "must match", "broadcast", "mat1 and mat2")


def about_shapes(e: BaseException) -> bool:
    """Whether ``e`` says that shapes do not fit (torch's words for it)."""
    text = str(e).lower()
    return any(word in text for word in SHAPE_WORDS)


def counted(batches: Callable, where: str, data_cfg, step: int, n: int):
    """``batches(data_cfg, step, n)`` (a workload's ``batches`` or ``eval_batches``), checked to
    be ``n`` (inputs, targets) pairs: an error it raises, another count, or a microbatch that is
    no pair (a bare tensor, which the loop would split into two rows) is the user's ``where``."""
    contract = "batches(data, step, n) must return exactly n (inputs, targets) pairs"
    with calling(where):
        found = batches(data_cfg, step, n)
        count = len(found)  # a generator has no len: as much the workload's error
    if count != n:
        raise blame(
            WorkloadError(
                f"returned {count} microbatch{'es' if count != 1 else ''} where {n} were asked for"
            ),
            where,
            contract,
        )
    for i, b in enumerate(found):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise blame(
                WorkloadError(
                    f"returned microbatch {i} as a {type(b).__name__} {shape_of(b)}, not an "
                    "(inputs, targets) pair"
                ),
                where,
                contract,
            )
    return found


def function_name(fn: Callable) -> str:
    """A function as its module and qualified name (``upkg.model.build_stage``); a callable object
    by its class."""
    inner = getattr(fn, "func", fn)  # functools.partial
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    module = getattr(inner, "__module__", None) or type(inner).__module__
    return f"{_short(module)}.{name}" if module else name


def module_name(module: torch.nn.Module) -> str:
    """A stage module's class, as the user wrote it in ``build_stage`` (``torch.nn.Linear``,
    ``rrfp.models.gpt.GPTStage``)."""
    cls = written_class(module)
    return f"{_short(cls.__module__)}.{cls.__qualname__}"


def _short(module: str) -> str:
    """torch's nn modules by the name users import them by: torch.nn.modules.linear -> torch.nn."""
    return "torch.nn" if module.startswith("torch.nn.modules.") else module


def shape_of(value) -> str:
    """A tensor's shape as ``[4, 16]``; a tuple or list of tensors as ``([4, 16], None)``; a dict
    by its keys' shapes; anything else by its type."""
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, (tuple, list)):
        inner = ", ".join(shape_of(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if value is None:
        return "None"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shape_of(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def first_layer_takes(module: torch.nn.Module) -> str | None:
    """What the module's first layer with a known input size takes (``Linear takes [*, 8]``), a
    guide to what its forward expected; None when no such layer is found. The first registered
    layer is the first run in a sequential stage, the common case."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            return f"{written_class(layer).__name__} takes [*, {layer.in_features}]"
        if isinstance(layer, torch.nn.modules.conv._ConvNd):
            dims = ", ".join("*" for _ in layer.kernel_size)
            return f"{written_class(layer).__name__} takes [N, {layer.in_channels}, {dims}]"
        if isinstance(layer, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            shape = ", ".join(map(str, layer.normalized_shape))
            return f"{written_class(layer).__name__} takes [*, {shape}]"
        if isinstance(layer, torch.nn.Embedding):
            return f"Embedding takes integer indices below {layer.num_embeddings}"
    return None


def in_user_frames(e: BaseException) -> bool:
    """Whether ``e``'s traceback passes through a file that is neither rrfp's nor an installed
    package's or the standard library's: the user's own code (a custom autograd Function's
    backward, a hook), as the backward, which autograd runs from rrfp's call, can only tell."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for frame in traceback.extract_tb(e.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(ours + os.sep):
            continue
        if "site-packages" in path or any(path.startswith(p + os.sep) for p in installed):
            continue
        return True
    return False
