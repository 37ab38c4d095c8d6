"""ThreadState (rrfp/pipeline/thread_state.py): what is read on the caller's thread reaches a task
run on another thread (autocast, inference mode for a forward-only call), and what cannot be carried
is one clear error (saved-tensor hooks; inference mode for a call that trains)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rrfp.pipeline.thread_state import Autocast, ThreadState


def _elsewhere(fn):
    """``fn()`` on a fresh thread, as the compute lane runs a task."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def _autocast_here():
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_inference_mode_enabled(),
    )


def test_autocast_is_read_here_and_applied_on_another_thread():
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        state = ThreadState.capture("test")
        assert _elsewhere(_autocast_here)[0] is False, (
            "autocast is per thread: the lane does not see it"
        )
    assert state.autocast == (Autocast("cpu", torch.bfloat16, False),)
    assert _elsewhere(state.wrap(_autocast_here)) == (True, torch.bfloat16, False)
    layer = torch.nn.Linear(3, 3)
    assert _elsewhere(lambda: state.wrap(layer)(torch.randn(2, 3))).dtype == torch.bfloat16
    assert (
        ThreadState.capture("test") == ThreadState()
        and ThreadState().wrap(_autocast_here) is _autocast_here
    )


def test_inference_mode_goes_to_a_forward_only_call_and_is_refused_for_training():
    with torch.inference_mode():
        state = ThreadState.capture("eval", trains=False)
        with pytest.raises(
            RuntimeError,
            match=r"^step trains \(its backward needs a graph\) and cannot run under "
            r"torch.inference_mode\(\); run it outside$",
        ):
            ThreadState.capture("step")
    assert _elsewhere(state.wrap(_autocast_here))[2] is True


def test_saved_tensor_hooks_around_the_call_are_refused_in_one_line():
    with torch.autograd.graph.save_on_cpu(), pytest.raises(NotImplementedError) as caught:
        ThreadState.capture("ScheduleReady.step")
    assert str(caught.value).startswith(
        "ScheduleReady.step: saved-tensor hooks (torch.autograd.graph."
        "saved_tensors_hooks, save_on_cpu) around it do not reach"
    )
    assert "\n" not in str(caught.value)
