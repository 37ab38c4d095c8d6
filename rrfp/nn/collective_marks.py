"""How a layer's collective, issued inside a task, is seen by whoever runs the task.

A tensor-parallel layer's all-reduce (tensor_parallel.py) runs on the thread that computes the
task, in the middle of it, where nothing else of the runtime looks: from outside, the rank is in
its task, whether it computes or waits for a TP peer that never comes. So whoever runs a task
installs a marker on the computing thread for the task's span (``marking``), and a layer enters
``marked(what, layer, group)`` around its collective: the marker says where the rank waits (its
heartbeat) and turns the collective's failure into one line that names the collective and the
peer that never came (rrfp/pipeline/task_collectives.py). Without a marker (a layer used outside
rrfp's executor) the collective runs as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch.nn as nn

# what a marker takes: the collective in words ("row-parallel all-reduce"), the layer, its group
Marker = Callable[[str, nn.Module, object], contextlib.AbstractContextManager]

_MARKER: contextvars.ContextVar[Marker | None] = contextvars.ContextVar(
    "rrfp_collective_marker", default=None
)


@contextlib.contextmanager
def marking(marker: Marker) -> Iterator[None]:
    """The collectives this thread's layers issue meanwhile are entered through ``marker``."""
    token = _MARKER.set(marker)
    try:
        yield
    finally:
        _MARKER.reset(token)


def marked(what: str, layer: nn.Module, group) -> contextlib.AbstractContextManager:
    """Around ``layer``'s collective ``what`` over ``group``: the marker installed on this thread,
    or nothing."""
    marker = _MARKER.get()
    return contextlib.nullcontext() if marker is None else marker(what, layer, group)
