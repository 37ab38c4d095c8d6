"""Each stage's optimizer: AdamW or SGD over two weight-decay groups.

Which parameters decay is decided per parameter, from the modules that hold it and its number of
dimensions (nanoGPT's rule): a parameter of 2 or more dimensions decays, unless an embedding
(``nn.Embedding``, ``nn.EmbeddingBag``) holds it; norm scales and biases (1 dimension) never do.
So any stage module is grouped without naming its layers, and a tensor-parallel shard, which keeps
its parameter's number of dimensions, lands where the whole parameter would. A parameter held by
several modules (a tied embedding and lm head in one process) is excluded when any holder excludes
it; across stages the same rule is agreed over the world (``agree_on_ties``), so both copies of a
tie are in the same group on every stage and stay equal.

Each group records whether it decays (``DECAYS``); after a checkpoint loads, ``reconfigured``
restores those marks and applies the config's hyperparameters to the groups again: the config
wins, as for the learning rate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

DECAYS = "decays"  # a param group's key: whether optim.weight_decay applies to it
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def no_decay_names(module: nn.Module) -> set[str]:
    """The qualified names of ``module``'s parameters that take no weight decay: fewer than 2
    dimensions, or held by an embedding."""
    excluded: set[int] = set()
    for holder in module.modules():
        for p in holder.parameters(recurse=False):
            if p.ndim < 2 or isinstance(holder, EMBEDDINGS):
                excluded.add(id(p))
    return {name for name, p in module.named_parameters() if id(p) in excluded}


def tie_names(workload, model_cfg, num_stages: int) -> list[str]:
    """Every tie of the model, from the workload's declaration for every stage (no communication:
    each rank lists the same names in the same order)."""
    if workload.tied is None:
        return []
    return sorted({t for s in range(num_stages) for t in workload.tied(model_cfg, s, num_stages)})


async def agree_on_ties(
    rt, workload, model_cfg, stages: Sequence[int], no_decay: list[set[str]]
) -> None:
    """Make a tied parameter excluded from decay on every stage that holds it when any holder
    excludes it (``no_decay``: one set per stage of this rank, updated in place). One all-reduce
    on the control plane, on every rank, when the model has ties."""
    names = tie_names(workload, model_cfg, rt.num_stages)
    if not names:
        return
    held = [workload.tied(model_cfg, s, rt.num_stages) for s in stages]
    excluded = torch.zeros(len(names), dtype=torch.float64)
    for ties, mine in zip(held, no_decay, strict=True):
        for tie, qualified in ties.items():
            if qualified in mine:
                excluded[names.index(tie)] = 1.0
    await rt.all_reduce(
        excluded,
        dist.ReduceOp.MAX,
        what="optimizer: world agreement on the weight decay of tied parameters",
    )
    for ties, mine in zip(held, no_decay, strict=True):
        for tie, qualified in ties.items():
            if excluded[names.index(tie)].item():
                mine.add(qualified)


def param_groups(module: nn.Module, no_decay: set[str], decay_all: bool = False) -> list[dict]:
    """The decayed and the undecayed group (each left out when empty), in parameter order."""
    decayed, kept = [], []
    for name, p in module.named_parameters():
        (kept if name in no_decay and not decay_all else decayed).append(p)
    groups = [{"params": decayed, DECAYS: True}, {"params": kept, DECAYS: False}]
    return [g for g in groups if g["params"]]


def build_optimizer(optim, module: nn.Module, no_decay: set[str]) -> torch.optim.Optimizer:
    """``optim.name``'s optimizer over ``module``'s two weight-decay groups, hyperparameters from
    the [optim] section ``optim``."""
    groups = param_groups(module, no_decay, optim.decay_all)
    if optim.name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum)
    elif optim.name == "adamw":
        opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2))
    else:
        raise ValueError(f"unknown optimizer {optim.name!r}")
    configure(opt, optim, optim.lr)
    return opt


@contextlib.contextmanager
def reconfigured(opts: Sequence[torch.optim.Optimizer], optim) -> Iterator[None]:
    """Around loading optimizer state: the groups keep this run's decay marks, and get the
    config's hyperparameters (learning rate ``optim.lr``; each step sets its own)."""
    marks = [[g.get(DECAYS, True) for g in opt.param_groups] for opt in opts]
    yield
    for opt, flags in zip(opts, marks, strict=True):
        for group, decays in zip(opt.param_groups, flags, strict=True):
            group[DECAYS] = decays
        configure(opt, optim, optim.lr)


def configure(opt: torch.optim.Optimizer, optim, lr: float) -> None:
    """Set every group's hyperparameters from the [optim] section, with learning rate ``lr``."""
    for group in opt.param_groups:
        group["lr"] = lr
        group["weight_decay"] = optim.weight_decay if group.get(DECAYS, True) else 0.0
        if "betas" in group:
            group["betas"] = (optim.beta1, optim.beta2)
        if "momentum" in group:
            group["momentum"] = optim.momentum
