"""Your own model under `rrfp train`: a Workload is its config, how to build one stage, the loss
and the batches. On 2 CPU ranks:

    .venv/bin/rrfp train --nproc-per-node 2 --config examples/my_model.toml
"""

from dataclasses import dataclass

import torch
from torch import nn

import rrfp


@dataclass(frozen=True)
class ModelConfig:  # the config's [model] section
    width: int = 32  # features of every layer
    layers: int = 4  # Linear + Tanh layers, split evenly over the stages


@dataclass(frozen=True)
class DataConfig:  # the config's [data] section
    rows: int = 16  # samples in a microbatch
    width: int = 32  # features of a sample: model.width


def check(model, data, num_stages, tp):
    """Called before any process group exists: a ValueError here is one error line, exit 2."""
    if model.layers % num_stages or model.width != data.width:
        raise ValueError(f"{model.layers} layers of width {model.width} do not split that way")


def build_stage(model, stage, num_stages, tp_group):
    """The whole model from the current seed, cut down to stage `stage` of `num_stages`, so the
    pieces on every rank are pieces of one model."""
    layers = [
        nn.Sequential(nn.Linear(model.width, model.width), nn.Tanh()) for _ in range(model.layers)
    ]
    head = nn.Linear(model.width, 1)
    per = model.layers // num_stages
    mine = layers[stage * per : (stage + 1) * per]
    return nn.Sequential(*mine, head) if stage == num_stages - 1 else nn.Sequential(*mine)


def batches(data, step, n):
    """This step's n microbatches of (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(step)
    xs = [torch.randn(data.rows, data.width, generator=g) for _ in range(n)]
    return [(x, x[:, :4].sum(dim=1, keepdim=True).tanh()) for x in xs]


workload = rrfp.Workload(
    "my_model", ModelConfig, DataConfig, build_stage, nn.functional.mse_loss, batches, check
)
