"""The FLOP count behind ``split_summary`` must not reach into other threads' autograd.

torch's FlopCounterMode enters a module tracker that installs process-wide
forward hooks; while it is entered, every forward any thread runs gets
multi-grad hooks, and ``autograd.grad`` through them then fails. Ranks run as
threads in the fake-NCCL tests, and users run their own threads: this failed
1 in ~5 suite runs of tests/pipeline/test_gpu_path.py as a 30 s peer timeout.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rrfp.pipeline.worker import StageFlopCounter


def _grad_in_another_thread_while_counting(counter_factory):
    entered, leave = threading.Event(), threading.Event()

    def count() -> None:
        with counter_factory():
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=count)
    t.start()
    try:
        assert entered.wait(30)
        x = torch.randn(3, 4, requires_grad=True)  # a leaf, as a stage's received input is
        out = torch.nn.Linear(4, 2)(x)
        return torch.autograd.grad(out.sum(), [x])[0]
    finally:
        leave.set()
        t.join()


def test_counting_leaves_other_threads_autograd_alone():
    (grad,) = [_grad_in_another_thread_while_counting(StageFlopCounter)]
    assert grad.shape == (3, 4)


def test_torchs_counter_with_its_module_tracker_breaks_it():
    """The bug class the test above guards against, on torch's own counter."""
    with pytest.raises(RuntimeError, match="leaf node"):
        _grad_in_another_thread_while_counting(lambda: FlopCounterMode(display=False))


def test_the_total_is_torchs():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with StageFlopCounter() as ours:
        a @ b
    with FlopCounterMode(display=False) as theirs:
        a @ b
    assert ours.get_total_flops() == theirs.get_total_flops() == 2 * 8 * 16 * 4


def _silu_grads():
    """The gradients of a linear layer under silu, whose backward (``silu_backward``) torch's
    counter would run through its Python decomposition."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    return torch.autograd.grad(torch.nn.functional.silu(x @ w.T).sum(), [x, w])


def test_counting_computes_what_runs_uncounted():
    """The measured microbatch's gradients are bit for bit those of any other: a run resumed from
    a checkpoint measures its first step again, where the unbroken run did not."""
    plain = _silu_grads()
    with StageFlopCounter() as counter:
        counted = _silu_grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, counted, strict=True))
    assert counter.get_total_flops() == 3 * 2 * 64 * 32 * 16  # forward, and both gradients


def test_torchs_counter_rounds_otherwise():
    """The bug class the test above guards against, on torch's own counter."""
    plain = _silu_grads()
    with FlopCounterMode(display=False):
        counted = _silu_grads()
    assert not all(torch.equal(a, b) for a, b in zip(plain, counted, strict=True))
