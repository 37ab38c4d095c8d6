"""The recipe's parts in one process: which parameters decay, the optimizers and their groups after
a checkpoint loads, the learning-rate schedule, the config's refusals, and per-block activation
checkpointing of the GPT under the split backward (exact gradients, each block recomputed once in
B and once in W)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rrfp.app.config.sections import OptimSection
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.train.lr_schedule import learning_rate, optim_learning_rate
from rrfp.app.train.optimizers import (
    DECAYS,
    build_optimizer,
    configure,
    no_decay_names,
    param_groups,
    reconfigured,
)
from rrfp.models.gpt import GPT, GPTConfig, make_stage
from rrfp.models.gpt import blocks as gpt_blocks
from rrfp.models.gpt import loss_fn as gpt_loss
from rrfp.nn.activation_checkpointing import checkpoint_blocks
from rrfp.pipeline.worker import StageWorker


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=8, n_head=2, vocab_size=256, block_size=16, **kw))


def test_norms_biases_and_embeddings_take_no_decay_and_matrices_do():
    model = _gpt()
    skip = no_decay_names(model)
    for name, p in model.named_parameters():
        plain = p.dim() >= 2 and not name.startswith(("transformer.wte", "transformer.wpe"))
        assert (name not in skip) == plain, name
    assert {"transformer.wte.weight", "transformer.h.0.ln_1.weight", "lm_head.weight"} - skip == {
        "lm_head.weight"
    }


def test_a_custom_module_is_grouped_by_dimensions_and_embedding_holders():
    class Mine(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))  # a norm of its own: 1 dimension
            self.table = nn.EmbeddingBag(10, 4)
            self.mix = nn.Parameter(torch.randn(4, 4))
            self.conv = nn.Conv1d(4, 4, 3)

    skip = no_decay_names(Mine())
    assert skip == {"scale", "table.weight", "conv.bias"}


def test_a_tied_weight_is_excluded_when_one_holder_is_an_embedding():
    model = _gpt(tie_embeddings=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "transformer.wte.weight" in no_decay_names(model)
    # a pipeline's last stage holds the head alone: only the world's agreement excludes it there
    last = make_stage(model, 1, 2)
    assert "lm_head.weight" not in no_decay_names(last)


def test_groups_and_hyperparameters_of_both_optimizers():
    model = _gpt()
    skip = no_decay_names(model)
    for name, kind, key in (
        ("adamw", torch.optim.AdamW, "betas"),
        ("sgd", torch.optim.SGD, "momentum"),
    ):
        optim = OptimSection(name=name, lr=0.01, weight_decay=0.2, beta2=0.95, momentum=0.8)
        opt = build_optimizer(optim, model, skip)
        assert isinstance(opt, kind)
        decayed, kept = opt.param_groups
        assert (decayed[DECAYS], kept[DECAYS]) == (True, False)
        assert (decayed["weight_decay"], kept["weight_decay"]) == (0.2, 0.0)
        assert len(decayed["params"]) + len(kept["params"]) == len(list(model.parameters()))
        assert decayed[key] == ((0.9, 0.95) if name == "adamw" else 0.8)
    every = param_groups(model, skip, decay_all=True)
    assert len(every) == 1 and len(every[0]["params"]) == len(list(model.parameters()))


def test_a_load_keeps_the_groups_marks_and_the_configs_hyperparameters():
    model = _gpt()
    optim = OptimSection(lr=0.01, weight_decay=0.2)
    opt = build_optimizer(optim, model, no_decay_names(model))
    with reconfigured([opt], optim):  # what a loaded state dict may write into the groups
        for group in opt.param_groups:
            group.update({DECAYS: True, "weight_decay": 0.5, "lr": 7.0})
    assert [(g[DECAYS], g["weight_decay"], g["lr"]) for g in opt.param_groups] == [
        (True, 0.2, 0.01),
        (False, 0.0, 0.01),
    ]
    configure(opt, OptimSection(lr=0.01, weight_decay=0.3), 0.005)
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.3, 0.005), (0.0, 0.005)]


def test_the_schedule_warms_up_then_decays_to_min_lr():
    lr, low = 1.0, 0.1
    assert [learning_rate(s, lr, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    cos = [learning_rate(s, lr, 2, "cosine", low, 6) for s in range(8)]
    assert cos[:3] == [0.0, 0.5, 1.0] and cos[6:] == [low, low]
    assert cos[4] == pytest.approx(low + (lr - low) * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cos[3] == pytest.approx(low + (lr - low) * 0.5 * (1 + math.cos(math.pi / 4)))
    lin = [learning_rate(s, lr, 2, "linear", low, 6) for s in range(7)]
    assert lin[2:] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1])
    assert all(a >= b for a, b in zip(cos[2:], cos[3:])), cos
    # decay_steps 0: the run's length
    optim = OptimSection(lr=lr, schedule="linear", min_lr=low)
    assert optim_learning_rate(optim, 10, 5) == pytest.approx(0.55)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["min_lr=0.1", "lr=0.01"], "optim.min_lr = 0.1 is above optim.lr = 0.01"),
        (["optim.name=lion"], "optim.name must be one of adamw, sgd"),
        (["schedule=cosin"], "(did you mean cosine?)"),
        (["beta2=1"], "each must be < 1"),
        (["eval.batches=0"], "eval.batches must be >= 1"),
    ],
)
def test_bad_recipe_keys_are_one_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=4)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_activation_checkpointing_needs_the_workloads_blocks():
    sets = ["run.model=examples.my_model", "activation_checkpointing=layers"]
    with pytest.raises(ConfigError) as e:
        TrainConfig.load(None, sets, world_size=2)
    assert str(e.value) == (
        "compute.activation_checkpointing = layers: workload 'my_model' does not name its blocks "
        "(Workload.blocks); set it to off"
    )
    assert TrainConfig.load("configs/gpt-tiny.toml", sets[1:], world_size=4)


M = 2


class _Runs:
    """Counts each block's forward, recomputations included (a hook on its first norm, which the
    wrapped forward calls)."""

    def __init__(self, stage):
        self.stage, self.n = stage, {}
        for i, block in enumerate(gpt_blocks(stage)):
            block.ln_1.register_forward_hook(
                lambda *_, i=i: self.n.__setitem__(i, self.n.get(i, 0) + 1)
            )

    def __call__(self) -> list[int]:
        return [self.n.get(i, 0) for i in range(len(gpt_blocks(self.stage)))]


@pytest.mark.parametrize("position", [0, 1])
def test_checkpointed_gpt_blocks_under_the_split_give_exact_gradients_recomputing_once(position):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=8, n_head=2, block_size=16, dropout=0.1)).double()
    plain = make_stage(model, position, 2)
    stage = copy.deepcopy(plain)
    assert checkpoint_blocks(gpt_blocks(stage)) == 2
    assert checkpoint_blocks(gpt_blocks(stage)) == 2  # a second call wraps nothing again
    twin = copy.deepcopy(stage)  # runs its own blocks, not the original's
    with torch.no_grad():
        for p in (p for block in gpt_blocks(twin) for p in block.parameters()):
            p.add_(1.0)
        x = torch.randint(0, 256, (1, 4)) if position == 0 else torch.randn(1, 4, 8).double()
        outs = [torch.manual_seed(3) and m(x) for m in (twin, stage)]  # the same dropout masks
        assert not torch.equal(*outs)
    runs = _Runs(stage)
    gen = torch.Generator().manual_seed(1)
    xs = [
        torch.randint(0, 256, (2, 8), generator=gen)
        if position == 0
        else torch.randn(2, 8, 8, generator=gen, dtype=torch.float64)
        for _ in range(M)
    ]
    ys = [
        torch.randint(0, 256, (2, 8), generator=gen)
        if position == 1
        else torch.randn(2, 8, 8, generator=gen, dtype=torch.float64)
        for _ in range(M)
    ]
    got, want = {}, {}
    for module, out in ((stage, got), (plain, want)):
        w = StageWorker(module, position, 2, M, gpt_loss, split=True)
        torch.manual_seed(5)  # the same dropout draws in both
        for mb in range(M):
            w.forward(mb, xs[mb], ys[mb] if position == 1 else None)
        if module is stage:
            assert runs() == [M, M], "F ran a block more than once"
        for mb in range(M):
            before = runs()
            out[mb] = w.backward(mb, None if position == 1 else ys[mb])
            if module is stage:
                # the first stage's input needs no gradient: B has nothing to recompute
                assert [a - b for a, b in zip(runs(), before)] == [position] * 2, f"B{mb}"
        for mb in range(M):
            before = runs()
            w.weight(mb)
            if module is stage:
                assert [a - b for a, b in zip(runs(), before)] == [1, 1], f"W{mb}"
        assert w.split_summary().in_b == {}, "the split fell back to B"
    for mb in range(M):
        if position:
            assert torch.equal(got[mb], want[mb]), f"input gradient of microbatch {mb}"
    for (name, p), q in zip(stage.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_another_optimizer_is_refused_on_resume_and_older_checkpoints_were_adamw():
    from rrfp.app.train.checkpoints import _comparable, differences, fingerprint

    def fp(*sets):
        return fingerprint(TrainConfig.load("configs/gpt-tiny.toml", list(sets), world_size=4))

    adamw, sgd = fp(), fp("optim.name=sgd")
    assert differences(*_comparable(adamw, sgd)) == [
        "optim.name: checkpoint 'adamw', this run 'sgd'"
    ]
    assert differences(*_comparable(fp("lr=0.1", "schedule=cosine"), adamw)) == []
    older = {k: v for k, v in adamw.items() if k != "optim"}
    assert differences(*_comparable(older, adamw)) == []
    assert differences(*_comparable(older, sgd)) == [
        "optim.name: checkpoint 'adamw', this run 'sgd'"
    ]
