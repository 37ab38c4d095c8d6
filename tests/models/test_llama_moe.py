"""The Llama family's mixture of experts under ``rrfp train`` (experts local), in float64 on gloo
ranks, against one process training the whole model: AdamW with clipping and weight decay for 3
steps, the auxiliary loss on (added to each microbatch's loss by hand in the reference; injected
in each layer's backward under the pipeline) and DeepSeek-V3's bias update on (the reference's load
is the whole batch's; the pipeline's is each replica's summed over DP). Losses, gradient norms,
auxiliary losses, parameters and expert biases agree under ready BFW, ZB-H1 and plan, with V = 2,
with B and W together, and with activation checkpointing."""

from __future__ import annotations

import functools

import pytest
from harness.distributed import run_ranks
from harness.llama_reference import CLIP, STEPS, adamw, learning_rate, recipe
from harness.whole_model import float64

pytestmark = pytest.mark.multirank

CONFIG = "configs/moe-tiny.toml"
SIZES = [
    "model.n_layer=4",
    "model.n_embd=16",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.intermediate_size=24",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_intermediate_size=12",
    "model.moe_shared_intermediate_size=8",
    "model.moe_first_dense=1",
    "model.moe_aux_loss_coeff=0.05",
    "model.moe_bias_update_rate=0.01",
    "model.block_size=32",
    "data.microbatch_size=2",
    "data.min_seq_len=6",
    "data.max_seq_len=16",
]


def _state(module) -> dict:
    """Parameters and persistent buffers (the expert biases) by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def reference(sets: list[str], world: int):
    """The whole model in this process: (losses, gradient norms, auxiliary losses, final state)."""
    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.nn.moe_aux_loss import collect_aux_losses
    from rrfp.nn.moe_layer import moe_layers

    with float64():
        cfg = TrainConfig.load(CONFIG, sets, world_size=world)
        wl, persistent = cfg.workload, None
        torch.manual_seed(cfg.run.seed)
        model = wl.build_stage(cfg.model, 0, 1, None)
        persistent = set(model.state_dict())
        opt = adamw(model, cfg)
        layers = moe_layers(model)
        assert len(layers) == cfg.model.n_layer - 1  # the first block is dense
        assert all(m.shared_experts is not None for m in layers)
        losses, norms, auxes = [], [], []
        n = cfg.schedule.n_microbatches * cfg.layout.dp  # the global batch: every replica's
        for step in range(STEPS):
            mbs = wl.batches(cfg.data, step, n)
            ce = aux = 0
            for x, y in mbs:
                with collect_aux_losses() as found:
                    out = model(x)
                assert len(found) == len(layers)
                ce, aux = ce + wl.loss_fn(out, y), aux + sum(found)
            ((ce + aux) / n).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg.optim.lr, step)
            opt.step()
            opt.zero_grad()
            for layer in layers:
                layer.update_bias(layer.take_step().tokens_per_expert)
            losses.append(ce.item() / n)
            auxes.append(aux.item() / n)
        state = {k: v.detach().clone() for k, v in _state(model).items() if k in persistent}
        return losses, norms, auxes, state


# how the pipeline orders its tasks, not what the whole model computes: one reference for every
# value of these
SCHEDULE_ONLY = ("hint=", "unit_ms=", "split=")


@functools.cache
def _reference_of(sets: tuple[str, ...]):
    return reference(list(sets), 4)


def train(rank, world, sets: list[str]):
    """A rank of ``rrfp train`` in float64: its losses, norms, auxiliary losses and the state of
    the stage modules it trained (caught as built)."""
    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run
    from rrfp.models import llama

    torch.set_default_dtype(torch.float64)
    built = []

    class Caught(llama.Llama):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(self)

    llama.Llama = Caught
    cfg = TrainConfig.load(CONFIG, sets, world_size=world)
    summary = run(stage_main(cfg))
    trained = {
        k: v.detach().numpy().copy()
        for m, persistent in ((m, set(m.state_dict())) for m in built)
        for k, v in _state(m).items()
        if not v.is_meta and k in persistent
    }
    return summary.losses, summary.grad_norms, summary.aux_losses, trained


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [
        ["pp=2", "dp=2"],
        ["pp=2", "dp=2", "hint=zbh1"],
        ["pp=2", "dp=2", "hint=plan", "unit_ms=1"],
        ["pp=2", "dp=2", "virtual=2", "model.n_layer=5"],
        ["pp=2", "dp=2", "split=false"],
    ],
    ids=["bfw", "zbh1", "plan", "v2", "unsplit"],
)
def test_moe_train_equals_one_process(layout):
    import torch

    sets = [*recipe(CONFIG), *SIZES, *layout]
    want_losses, want_norms, want_auxes, want_state = _reference_of(
        tuple(s for s in sets if not s.startswith(SCHEDULE_ONLY))
    )
    assert want_losses[-1] < want_losses[0], "the reference should learn"
    assert min(want_norms) > CLIP, "clipping should act"
    biases = [k for k in want_state if k.endswith("expert_bias")]
    assert biases and all(want_state[k].abs().max() > 0 for k in biases), "biases should move"
    seen, gaps = set(), {"loss": 0.0, "norm": 0.0, "aux": 0.0, "state": 0.0}
    for rank, (losses, norms, auxes, trained) in run_ranks(train, 4, sets, timeout=280).items():
        assert len(losses) == len(norms) == len(auxes) == STEPS, rank
        for key, got, want in (
            ("loss", losses, want_losses),
            ("norm", norms, want_norms),
            ("aux", auxes, want_auxes),
        ):
            gaps[key] = max(gaps[key], *(abs(a - b) for a, b in zip(got, want, strict=True)))
        for k, v in trained.items():
            gaps["state"] = max(gaps["state"], (torch.from_numpy(v) - want_state[k]).abs().max())
        seen |= set(trained)
    assert seen == set(want_state), sorted(seen ^ set(want_state))
    print(f"moe {layout}: largest differences from one process {gaps}; aux {want_auxes}")
    assert all(gap < 1e-11 for gap in gaps.values()), gaps
