"""The caller's thread state that a pipeline iteration carries to where its tasks run.

Autocast is per thread (torch/amp/autocast_mode.py: "The autocast state is thread-local"; its
flags live in at::ThreadLocalState, ATen/ThreadLocalState.h), and rrfp runs a stage's F, B and
W on its compute lane's thread, or for ``ScheduleReady`` on a background loop's. So
``with torch.autocast(...): schedule.step(...)`` would run the stage in float32 without a word.
``ThreadState.capture()`` reads what is in force where the iteration is called, and ``wrap``
runs each task under it: every F, B and W of that call, as ``with autocast: step()`` has the
forward and the backward inside in one process.

What else is per thread, and why it is not carried:

- grad mode: F always records a graph and B always differentiates it (training), whatever the
  caller's mode; ``ScheduleReady.step`` refuses ``no_grad`` as torch does, and its forward-only
  path passes the mode itself. ``inference_mode`` is carried to a forward-only call (``eval``)
  and refused for one that trains: its tensors cannot be differentiated.
- saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``) are refused:
  a hook pair is one pack/unpack protocol for one thread's graph, and the worker's own byte count
  (``schedule.budget`` in bytes) replaces the top of that stack inside F. Put them inside the stage
  module's ``forward``, which runs where the tensors are saved.
- torch function and dispatch modes (``FlopCounterMode``, ``FakeTensorMode``, ``torch.device``
  as a context manager) are stateful objects entered on one thread; entering one on the lane as
  well would share it between two threads at once. They are not carried: use them inside the
  module's ``forward``.
- ``torch.backends`` flags and ``torch.set_num_threads`` are process-wide, not per thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# every device type torch's autocast knows; those without autocast on this build are skipped
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu")


@dataclass(frozen=True)
class Autocast:
    """One enabled ``torch.autocast``: what ``torch.autocast(device_type, dtype,
    cache_enabled=...)`` takes."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool


@dataclass(frozen=True)
class ThreadState:
    """The caller's per-thread state an iteration's tasks run under (see the module's docstring)."""

    autocast: tuple[Autocast, ...] = ()
    inference_mode: bool = False

    @classmethod
    def capture(cls, where: str, trains: bool = True) -> ThreadState:
        """What is in force on the calling thread now; ``where`` names the call in a refusal, and
        ``trains`` says whether it runs a backward."""
        inference = torch.is_inference_mode_enabled()
        if inference and trains:
            raise RuntimeError(
                f"{where} trains (its backward needs a graph) and cannot run under "
                f"torch.inference_mode(); run it outside"
            )
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            raise NotImplementedError(
                f"{where}: saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, "
                f"save_on_cpu) around it do not reach the stage's tasks, which run on "
                f"rrfp's compute lane; enter them inside the stage module's forward"
            )
        cache = torch.is_autocast_cache_enabled()
        enabled = tuple(
            Autocast(d, torch.get_autocast_dtype(d), cache)
            for d in _device_types()
            if torch.is_autocast_enabled(d)
        )
        return cls(enabled, inference)

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` run under this state, on whatever thread calls it."""
        if not self.autocast and not self.inference_mode:
            return fn

        def run(*args):
            with contextlib.ExitStack() as stack:
                if self.inference_mode:
                    stack.enter_context(torch.inference_mode())
                for a in self.autocast:
                    stack.enter_context(
                        torch.autocast(a.device_type, a.dtype, cache_enabled=a.cache_enabled)
                    )
                return fn(*args)

        return run


def _device_types() -> list[str]:
    return [
        d
        for d in (*_DEVICE_TYPES, torch._C._get_privateuse1_backend_name())
        if torch.amp.is_autocast_available(d)
    ]
