"""``rrfp train`` on the llama and vit_vlm workloads against one process training the whole model,
shared by tests/models/test_llama.py and tests/models/test_vit_vlm.py: the reference (AdamW with the
config's weight-decay groups, warmup then cosine decay, global clipping), the ranks (stage_main in
float64, the trained stage modules caught as they are built) and the largest differences (torch
imported inside: the ranks import it)."""

from __future__ import annotations

import math

from harness.whole_model import float64

STEPS, CLIP, DECAY, MIN_LR = 3, 0.05, 0.1, 1e-4
RECIPE = [f"steps={STEPS}", "n_microbatches=4", "timeout_s=60", f"clip_grad_norm={CLIP}"]
RECIPE += [f"weight_decay={DECAY}", "schedule=cosine", "warmup_steps=1", f"min_lr={MIN_LR}"]
RECIPE += ["output.dir="]  # no run folder: metrics nobody reads


def learning_rate(lr: float, step: int) -> float:
    """The recipe's schedule written out: step 0 warms up from 0, then a cosine from ``lr`` at
    step 1 to ``MIN_LR`` at the run's end."""
    if step == 0:
        return 0.0
    return MIN_LR + (lr - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - 1) / (STEPS - 1)))


def recipe(config: str) -> list[str]:
    """The recipe's keys this config knows: clipping, weight decay, and per-layer activation
    checkpointing where the compute section has it."""
    import dataclasses

    from rrfp.app.config.sections import ComputeSection

    compute = {f.name for f in dataclasses.fields(ComputeSection)}
    return RECIPE + (
        ["activation_checkpointing=layers"] if "activation_checkpointing" in compute else []
    )


def params(module) -> dict:
    """Every parameter by name; a tied weight under both of its names."""
    return dict(module.named_parameters(remove_duplicate=False))


def adamw(model, cfg):
    """AdamW over the groups the config asks for: every parameter decays with ``optim.decay_all``
    (or where the config has no groups), otherwise those of 2+ dimensions outside embeddings."""
    import torch

    decay_all = getattr(cfg.optim, "decay_all", True)
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decays = [p for p in model.parameters() if decay_all or (p.ndim >= 2 and id(p) not in embedded)]
    rest = [p for p in model.parameters() if all(p is not q for q in decays)]
    groups = [{"params": decays, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr)


def reference(config: str, sets: list[str], world: int):
    """The whole model trained in this process in float64: each step's loss and gradient norm
    before clipping, the final parameters {name: tensor}."""
    import torch

    from rrfp.app.config.train_config import TrainConfig

    with float64():
        cfg = TrainConfig.load(config, sets, world_size=world)
        wl = cfg.workload
        torch.manual_seed(cfg.run.seed)
        model = wl.build_stage(cfg.model, 0, 1, None)
        opt = adamw(model, cfg)
        losses, norms = [], []
        for step in range(STEPS):
            mbs = wl.batches(cfg.data, step, cfg.schedule.n_microbatches)
            loss = sum(wl.loss_fn(model(x), y) for x, y in mbs) / len(mbs)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg.optim.lr, step)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, norms, {n: p.detach().clone() for n, p in params(model).items()}


def train(rank, world, config: str, sets: list[str], module: str, cls: str):
    """A rank of ``rrfp train`` (stage_main) in float64: its losses and gradient norms, the
    parameters of the stage modules it trained (``module.cls`` instances, caught as built), its
    TP rank, and the number of images of each microbatch (0 for text)."""
    import importlib

    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    torch.set_default_dtype(torch.float64)
    mod, built = importlib.import_module(module), []
    base = getattr(mod, cls)

    class Caught(base):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self)

    setattr(mod, cls, Caught)
    cfg = TrainConfig.load(config, sets, world_size=world)
    assert cfg.schedule.dispatch.value == "ready" and cfg.schedule.hint.name == "bfw"
    summary = run(stage_main(cfg))
    # numpy arrays travel by value (a tensor through the queue is shared memory the rank frees)
    trained = {  # the trained modules, not those the start checks measure on the meta device
        n: p.detach().numpy().copy() for m in built for n, p in params(m).items() if not p.is_meta
    }
    images = [
        x.images.size(1) if hasattr(x, "images") else 0
        for s in range(STEPS)
        for x, _ in cfg.workload.batches(cfg.data, s, cfg.schedule.n_microbatches)
    ]
    return summary.losses, summary.grad_norms, trained, cfg.layout.coords(rank).tp, images


def differences(results: dict, want, tp: int, full_slice) -> tuple[float, float, float]:
    """The largest |loss - ref|, |grad norm - ref| and |parameter - ref| over every rank; asserts
    every rank ran every step and the ranks together hold every parameter."""
    import torch

    want_losses, want_norms, want_params = want
    seen: set[str] = set()
    loss = norm = param = 0.0
    for rank, (losses, norms, trained, tp_rank, _) in results.items():
        assert len(losses) == len(norms) == STEPS, (rank, losses, norms)
        loss = max(loss, *(abs(a - b) for a, b in zip(losses, want_losses)))
        norm = max(norm, *(abs(a - b) for a, b in zip(norms, want_norms)))
        for n, p in trained.items():
            diff = torch.from_numpy(p) - full_slice(n, want_params[n], tp_rank, tp)
            param = max(param, diff.abs().max().item())
        seen |= set(trained)
    assert seen == set(want_params), sorted(set(want_params) ^ seen)
    return loss, norm, param
