"""`rrfp.calibrate` fits the cost model of any stage modules, without a Workload."""

import pytest
import torch
from torch import nn

import rrfp


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def _loss(out, y):
    return nn.functional.mse_loss(out, y)


def _batches(width: int, lengths):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(1, n, width, generator=g), torch.randn(1, n, width, generator=g))
        for n in lengths
    ]


def test_a_plain_module_pipeline_gets_a_cost_model_that_prices_length():
    torch.manual_seed(0)
    stages = [nn.Sequential(Block(64), Block(64)), nn.Sequential(Block(64))]
    # each length three times: one measurement preempted on a loaded machine weighs less in the fit
    lengths = [8, 8, 16, 512, 32, 384, 64, 256, 8, 448] * 3
    model = rrfp.calibrate(stages, _loss, _batches(64, lengths))
    assert len(model.coef) == 2 and all(len(kinds) == 3 for kinds in model.coef)
    short, long = (
        rrfp.token_features(_batches(64, [16])[0]),
        rrfp.token_features(_batches(64, [512])[0]),
    )
    # F, B and W of a 32x longer microbatch cost more; but the first stage's B: its input needs
    # no gradient, so its B computes nothing and W does the stage's whole backward
    # (rrfp/pipeline/split_backward/weight_split.py), and its fit prices only the timer's noise
    for s, kind in [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]:
        assert model.seconds(s, kind, long) > model.seconds(s, kind, short), (s, kind)
    assert all(
        p.grad is None for m in stages for p in m.parameters()
    )  # measuring leaves no gradient


def test_too_few_microbatches_is_one_clear_error():
    with pytest.raises(ValueError, match="more than 2 microbatches"):
        rrfp.calibrate([Block(8)], _loss, _batches(8, [4, 4]))
    with pytest.raises(ValueError, match="at least one stage module"):
        rrfp.calibrate([], _loss, _batches(8, [4, 4, 4]))
