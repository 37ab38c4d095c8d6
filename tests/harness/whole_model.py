"""The one-process reference of a one-iteration test, computed once in the test process and
handed to its ranks instead of computed again in every rank: the whole model's mean loss over the
microbatches and every gradient by name, in float64."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """torch's default dtype float64 within, as it was after: a reference computed in the test
    process leaves the process's dtype to the tests after it."""
    import torch

    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(was)


def one_iteration(setup: Callable[[], tuple]) -> tuple[float, dict]:
    """``setup()`` (called in float64, torch seeded with 0) gives ``(model, loss_fn, data)``: the
    mean of ``loss_fn(model(x), y)`` over ``data`` and its gradients, numpy arrays that travel to
    the ranks by value (a tensor through a queue is shared memory)."""
    import torch

    with float64():
        torch.manual_seed(0)
        model, loss_fn, data = setup()
        loss = sum(loss_fn(model(x), y) for x, y in data) / len(data)
        loss.backward()
        return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def as_tensors(grads: dict) -> dict:
    """A rank's view of the reference's gradients: tensors by name."""
    import torch

    return {n: torch.from_numpy(g) for n, g in grads.items()}


def small_gpt() -> tuple:
    """The pipeline tests' GPT and data: 4 layers of 32, microbatches of 2 of 8 to 40 tokens."""
    from rrfp.models.data import DataConfig
    from rrfp.models.gpt import GPTConfig

    return (
        GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=64),
        DataConfig(seed=1, microbatch_size=2, min_seq_len=8, max_seq_len=40),
    )


@functools.cache
def small_gpt_reference(n_microbatches: int) -> tuple[float, dict]:
    """``small_gpt``'s loss and gradients over iteration 0's ``n_microbatches`` microbatches."""

    def setup():
        from rrfp.models.data import batches
        from rrfp.models.gpt import GPT, loss_fn

        model_cfg, data_cfg = small_gpt()
        return GPT(model_cfg), loss_fn, batches(data_cfg, 0, n_microbatches)

    return one_iteration(setup)
