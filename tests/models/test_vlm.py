"""The VLM workload: procedural image+caption data, the stage split, pipelined
gradients against a single-process reference on gloo, and that it learns."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from harness.whole_model import as_tensors, one_iteration

from rrfp.models.shapes import (
    COLOURS,
    PLACES,
    SHAPES,
    VLMDataConfig,
    VLMInputs,
    _masks,
    batches,
    max_seq_len,
)
from rrfp.models.vlm import VLM, Boundary, VLMConfig, check, loss_fn, make_stage, split_blocks

CFG = VLMConfig(
    image_size=16,
    patch_size=4,
    enc_layers=1,
    enc_embd=16,
    n_layer=4,
    n_head=4,
    n_embd=32,
    block_size=320,
)
DATA = VLMDataConfig(
    seed=8, microbatch_size=2, image_size=16, patch_size=4, max_images=4, max_shapes=2
)
HEAVY = VLMConfig(
    enc_layers=3, enc_embd=64, n_layer=4, n_head=4, n_embd=32, block_size=320
)  # stage 0: no block
M = 4


def _model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return VLM(cfg).double()


def _text(ids: torch.Tensor, targets: torch.Tensor) -> str:
    """A sample's whole text: its ids and the last target byte."""
    return bytes(ids.tolist() + [targets[-1].item()]).decode()


# -- data ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_data_is_deterministic_and_varies():
    a, b = batches(DATA, 3, 8), batches(DATA, 3, 8)
    for ((ia, xa), ya), ((ib, xb), yb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(xa, xb) and torch.equal(ya, yb)
    counts = [x.images.size(1) for x, _ in a]
    assert len(set(counts)) >= 3, counts
    assert len({x.ids.size(1) for x, _ in a}) > 1  # caption lengths vary too
    assert not all(torch.equal(p[1], q[1]) for p, q in zip(a, batches(DATA, 4, 8)))
    for x, y in a:
        assert (
            isinstance(x, VLMInputs)
            and x.images.dtype == torch.float32
            and x.ids.dtype == torch.int64
        )
        assert x.images.shape[0] == x.ids.shape[0] == y.shape[0] == DATA.microbatch_size
        assert x.images.shape[2:] == (3, 16, 16) and y.dtype == torch.int64


@pytest.mark.timeout(30)
def test_targets_ignore_exactly_the_image_tokens():
    for x, y in batches(DATA, 0, 16):
        n_img = x.images.size(1) * DATA.tokens_per_image
        assert y.shape == (x.ids.size(0), n_img + x.ids.size(1))
        ignored = y == -100
        assert ignored[:, :n_img].all() and not ignored[:, n_img:].any()
        assert torch.equal(y[:, n_img:-1], x.ids[:, 1:])  # next-byte targets
        assert (x.ids[:, 0] == ord("\n")).all()


@pytest.mark.timeout(30)
def test_captions_describe_the_images():
    cfg = VLMDataConfig(seed=5, microbatch_size=3, max_images=8, max_shapes=4)
    sizes = [int(m.sum()) for m in _masks(cfg.image_size)]
    assert len(set(sizes)) == 3, sizes  # the three shapes differ in area
    half, seen = cfg.image_size // 2, set()
    for x, y in batches(cfg, 0, 12):
        n = x.images.size(1)
        for i in range(x.ids.size(0)):
            text = _text(x.ids[i], y[i]).strip()
            head, *described = text.rstrip(".").split(". ")
            assert head == f"{n} image{'' if n == 1 else 's'}" and len(described) == n, text
            for j, desc in enumerate(described):
                img, mentioned = x.images[i, j], set()
                for part in desc.split(", "):
                    colour, shape, place = part.split(" ", 2)
                    k = PLACES.index(place)
                    mentioned.add(k)
                    quad = img[
                        :,
                        (k // 2) * half : (k // 2 + 1) * half,
                        (k % 2) * half : (k % 2 + 1) * half,
                    ]
                    lit = quad.sum(dim=(1, 2))
                    assert lit[COLOURS.index(colour)] == sizes[SHAPES.index(shape)], (text, part)
                    assert lit.sum() == lit[COLOURS.index(colour)], (text, part)  # one colour only
                    seen.update((colour, shape))
                for k in set(range(4)) - mentioned:  # unmentioned quadrants are empty
                    assert (
                        img[
                            :,
                            (k // 2) * half : (k // 2 + 1) * half,
                            (k % 2) * half : (k % 2 + 1) * half,
                        ].sum()
                        == 0
                    )
    assert seen == set(COLOURS) | set(SHAPES)


@pytest.mark.timeout(30)
def test_configs_validate():
    with pytest.raises(ValueError, match="patch_size"):
        VLMDataConfig(image_size=16, patch_size=5)
    with pytest.raises(ValueError, match="max_shapes"):
        VLMDataConfig(max_shapes=5)
    with pytest.raises(ValueError, match="n_head"):
        VLMConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="enc_layers"):
        VLMConfig(enc_layers=0)
    check(CFG, DATA, 4, 1)
    with pytest.raises(ValueError, match="tensor parallelism"):
        check(CFG, DATA, 2, 2)
    with pytest.raises(ValueError, match="n_layer=4 is too few for 6"):
        check(CFG, DATA, 6, 1)
    check(CFG, DATA, 5, 1)  # stage 0 may hold no LM block
    with pytest.raises(ValueError, match="image_size"):
        check(CFG, VLMDataConfig(image_size=32), 2, 1)
    with pytest.raises(ValueError, match="block_size"):
        check(CFG, VLMDataConfig(max_images=8), 2, 1)
    assert max_seq_len(DATA) <= CFG.block_size


# -- the split, on one process -----------------------------------------------------


@pytest.mark.timeout(30)
def test_split_blocks_balances_the_encoder():
    for cfg in (CFG, HEAVY):
        for S in range(1, cfg.n_layer + 2):
            r = split_blocks(cfg, S)
            assert [i for x in r for i in x] == list(range(cfg.n_layer)) and len(r) == S
            assert all(len(x) >= 1 for x in r[1:])
    assert split_blocks(CFG, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(HEAVY, 2) == [range(0, 0), range(0, 4)]
    assert split_blocks(HEAVY, 4)[0] == range(0, 0)  # the encoder alone outweighs a block
    with pytest.raises(ValueError, match="num_stages"):
        split_blocks(CFG, 6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg,S", [(CFG, 1), (CFG, 2), (CFG, 4), (HEAVY, 4)])
def test_stages_chain_to_full_model(cfg, S):
    model = _model(cfg)
    full = dict(model.named_parameters())
    stages = [make_stage(model, s, S) for s in range(S)]
    names = [set(dict(st.named_parameters())) for st in stages]
    assert all(n <= set(full) for n in names)
    assert sum(map(len, names)) == len(full) and set().union(*names) == set(full)
    assert "vision.patch.weight" in names[0] and "lm_head.weight" in names[-1]
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.equal(p, full[n]) and p is not full[n]
    for x, _ in batches(DATA, 0, 4):
        h, n, T = x, x.images.size(1) * cfg.patches, x.ids.size(1)
        for st in stages:
            h = st(h)
            if (
                not st.is_last
            ):  # image and text travel apart, with the image token count beside them
                assert isinstance(h, Boundary)
                b = x.ids.size(0)
                assert h.image.shape == (b, n, cfg.n_embd) and h.text.shape == (b, T, cfg.n_embd)
                assert h.image.requires_grad and h.text.requires_grad
                assert h.image_tokens.dtype == torch.int64 and h.image_tokens.tolist() == [n] * b
        ref = model(x)
        assert (
            h.shape
            == ref.shape
            == (x.ids.size(0), x.images.size(1) * CFG.patches + x.ids.size(1), 256)
        )
        assert torch.equal(h, ref)


@pytest.mark.timeout(30)
def test_a_microbatch_without_images_keeps_the_encoder_in_the_graph():
    """The image part is empty, not None: the encoder gets zero gradients as in the full model."""
    ((x, _),) = [(x, y) for x, y in batches(DATA, 0, M) if x.images.size(1) == 0][:1]
    stage = make_stage(_model(), 0, 2)
    out = stage(VLMInputs(x.images.double(), x.ids))
    assert out.image.shape == (x.ids.size(0), 0, CFG.n_embd) and out.image_tokens.tolist() == [
        0
    ] * x.ids.size(0)
    (out.image.sum() + out.text.sum()).backward()
    grads = {n: p.grad for n, p in stage.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(not g.any() for n, g in grads.items() if n.startswith("vision."))
    assert grads["transformer.wte.weight"].any()


# -- pipelined on gloo, against the single-process reference ------------------------


def _data() -> list:
    return [(VLMInputs(x.images.double(), x.ids), y) for x, y in batches(DATA, 0, M)]


def _one_iteration(rank, world, configs, ref):
    import torch

    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    data = _data()
    ref_loss, ref_grads = ref[0], as_tensors(ref[1])

    async def main():
        rt = PipelineRuntime.start(pp=world, timeout_s=60)
        out = {}
        try:
            for ex, hint in configs:
                torch.manual_seed(0)
                module = make_stage(VLM(CFG), rt.stage, rt.num_stages)
                # what the runtime hands this stage: a tuple of tensors, not a joined sequence
                received = []
                module.register_forward_pre_hook(
                    lambda _, args, received=received: received.append(
                        None
                        if rt.stage == 0
                        else [(t.dtype, tuple(t.shape), t.requires_grad) for t in args[0]]
                    )
                )
                e = rt.stage_executor(
                    module, loss_fn, n_microbatches=M, dispatch=ex, hint=hint, budget="2x"
                )
                res = await e.run_iteration(0, data)
                missing = [n for n, p in module.named_parameters() if p.grad is None]
                assert not missing, missing
                grad_err = max(
                    (p.grad - ref_grads[n]).abs().max().item() for n, p in module.named_parameters()
                )
                loss_err = abs(res.loss - ref_loss) if res.loss is not None else None
                out[(ex, hint)] = grad_err, loss_err, len(res.order), received
        finally:
            await rt.aclose()
        return out

    return run(main())


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp", [2, 4])
def test_one_iteration_matches_reference(pp):
    counts = [x.images.size(1) for x, _ in batches(DATA, 0, M)]
    assert len(set(counts)) >= 3 and 0 in counts, (
        counts
    )  # differing image counts, one microbatch with none
    configs = [("ready", "bfw"), ("fixed", "1f1b")]
    reference = one_iteration(lambda: (VLM(CFG), loss_fn, _data()))
    results = run_ranks(_one_iteration, pp, configs, reference, timeout=100)
    data = batches(DATA, 0, M)
    b, C = DATA.microbatch_size, CFG.n_embd
    for cfg in configs:
        for rank in range(pp):
            grad_err, loss_err, tasks, received = results[rank][cfg]
            if rank > 0:  # F runs in microbatch order on every stage, under both executors
                assert received == [
                    [
                        (torch.float64, (b, x.images.size(1) * CFG.patches, C), True),
                        (torch.float64, (b, x.ids.size(1), C), True),
                        (torch.int64, (b,), False),
                    ]
                    for x, _ in data
                ], received
            assert grad_err < 1e-10, f"{cfg} rank {rank}: gradient differs by {grad_err}"
            assert tasks == M * (3 if cfg[1] == "bfw" else 2)
            if rank == pp - 1:
                assert loss_err < 1e-12, f"{cfg}: loss differs by {loss_err}"


# -- training -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_loss_falls():
    torch.manual_seed(0)
    model = VLM(CFG)
    # 10 steps at this rate take the loss from 5.54 to 2.96
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(10):
        loss = sum(loss_fn(model(x), y) for x, y in batches(DATA, step, M)) / M
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 2.0, losses


@pytest.mark.timeout(30)
def test_config_file_and_inputs_move():
    from rrfp.app.config.train_config import TrainConfig

    cfg = TrainConfig.load("configs/vlm-tiny.toml", world_size=4)
    assert cfg.workload.name == "vlm" and cfg.layout.pp == 4
    assert isinstance(cfg.model, VLMConfig) and isinstance(cfg.data, VLMDataConfig)
    ((x, _),) = batches(cfg.data, 0, 1)
    moved = x.to(
        "cpu", non_blocking=True
    )  # training.py calls .to(device) on first-stage inputs off CPU
    assert (
        isinstance(moved, VLMInputs)
        and torch.equal(moved.images, x.images)
        and torch.equal(moved.ids, x.ids)
    )
