"""The ViT VLM (rrfp/models/vit_vlm.py): its split is the least heaviest stage over the chain of
parts, the encoder spreading over the first stages when heavy; for any small config a stage built
alone is that part of the whole model, the stages chained are the whole model on microbatches with
0..N images, and its LM blocks are rrfp.models.llama's; ``rrfp train`` at pp 4 with the encoder
across two stages equals one process training the whole model, in float64 under ready BFW with
clipping and weight decay."""

from __future__ import annotations

import itertools

import pytest
import torch
from harness.distributed import run_ranks
from harness.llama_reference import CLIP, differences, recipe, reference, train
from harness.whole_model import float64
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.models import vit_vlm
from rrfp.models.llama import Llama, LlamaConfig
from rrfp.models.shapes import VLMDataConfig, batches
from rrfp.models.vit_vlm import Encoding, ViTVLM, ViTVLMConfig, parts, split_parts


def _built(cfg: ViTVLMConfig, stage: int, num_stages: int, seed: int = 0) -> ViTVLM:
    torch.manual_seed(seed)
    return ViTVLM(cfg, stage, num_stages)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(remove_duplicate=False))


def _data(cfg: ViTVLMConfig, max_images: int = 2, seed: int = 0) -> list:
    data = VLMDataConfig(
        seed=seed,
        microbatch_size=2,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        max_images=max_images,
        max_shapes=1,
    )
    return batches(data, 0, 4)


# -- the split ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        ViTVLMConfig(),
        ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176),
        ViTVLMConfig(enc_layers=1, enc_embd=8, n_layer=6),
    ],
)
def test_split_is_the_least_heaviest_stage(cfg):
    """Against every way to cut the chain (brute force): contiguous, none empty, and no cut has a
    lighter heaviest stage."""
    chain = parts(cfg)
    costs = [c for *_, c in chain]
    for num_stages in range(1, min(len(chain), 6) + 1):
        runs = split_parts(cfg, num_stages)
        assert [p for run in runs for p in run] == [(k, i) for k, i, _ in chain]
        assert all(runs) and len(runs) == num_stages
        heaviest = max(sum(costs[j] for j, p in enumerate(chain) if p[:2] in run) for run in runs)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(chain))))
            for cuts in itertools.combinations(range(1, len(chain)), num_stages - 1)
        )
        assert heaviest == best, (num_stages, runs)
    with pytest.raises(ValueError, match="num_stages"):
        split_parts(cfg, len(chain) + 1)


def test_a_heavy_encoder_spreads_over_the_first_stages():
    light, heavy = ViTVLMConfig(), ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176)
    assert split_parts(light, 4)[0][-1] == ("lm", 0)  # the encoder and one LM block on stage 0
    runs = split_parts(heavy, 4)
    assert runs[0] == [("patch", 0), ("vit", 0), ("vit", 1)]
    assert runs[1] == [("vit", 2), ("vit", 3)]  # an Encoding travels from stage 0 to 1 to 2


# -- stages built alone ---------------------------------------------------------------------


@st.composite
def configs(draw):
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2]))
    enc_head = draw(st.sampled_from([1, 2]))
    return ViTVLMConfig(
        image_size=8,
        patch_size=draw(st.sampled_from([2, 4])),
        enc_layers=draw(st.integers(1, 3)),
        enc_embd=enc_head * draw(st.sampled_from([2, 4])),
        enc_head=enc_head,
        n_layer=draw(st.integers(1, 3)),
        n_embd=heads * 4,
        n_head=heads,
        n_kv_head=kv,
        intermediate_size=draw(st.sampled_from([0, 12])),
        qk_norm=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        block_size=256,
    )


def _check_chain(cfg: ViTVLMConfig, num_stages: int, seed: int) -> None:
    with float64():
        whole = _built(cfg, 0, 1, seed)
        stages = [_built(cfg, s, num_stages, seed) for s in range(num_stages)]
        want = _params(whole)
        names = [set(_params(s)) for s in stages]
        assert set().union(*names) == set(want) and sum(map(len, names)) == len(want)
        for stage in stages:
            for n, p in _params(stage).items():
                assert torch.equal(p, want[n]), n
        for x, _ in _data(cfg, seed=seed % 1000):
            h, images = x, x.images.size(1)
            for stage in stages[:-1]:
                h = stage(h)
                if stage.in_encoder and not stage.has_proj:  # inside the encoder
                    assert isinstance(h, Encoding) and h.ids is x.ids
                    assert h.patches.shape == (2, images * cfg.patches, cfg.enc_embd)
                else:
                    assert h.shape == (2, images * cfg.patches + x.ids.size(1), cfg.n_embd)
            assert torch.equal(stages[-1](h), whole(x))


@settings(max_examples=12, deadline=None)
@given(cfg=configs(), data=st.data())
def test_stages_built_alone_chain_to_the_whole_model(cfg, data):
    num_stages = data.draw(st.integers(1, len(parts(cfg))), label="num_stages")
    _check_chain(cfg, num_stages, data.draw(st.integers(0, 2**31), label="seed"))


@pytest.mark.parametrize("num_stages", [4, 6, 11])
def test_stages_that_cut_the_encoder_chain_to_the_whole_model(num_stages):
    """Splits with ViT blocks on several stages, each stage's blocks from their own index."""
    cfg = ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176, n_layer=4)
    runs = split_parts(cfg, num_stages)
    assert sum(any(kind == "vit" for kind, _ in run) for run in runs) >= 2, runs
    _check_chain(cfg, num_stages, seed=7)


def test_the_lm_blocks_are_llamas():
    """The LM of the VLM is rrfp.models.llama's: its blocks from one seed are Llama's from that
    seed."""
    cfg = ViTVLMConfig(n_layer=2, qk_norm=True)
    lm = LlamaConfig(n_layer=2, n_embd=cfg.n_embd, n_head=cfg.n_head, qk_norm=True)
    torch.manual_seed(4)
    want = _params(Llama(lm))
    got = _params(_built(cfg, 0, 1, seed=4))
    lm_names = [n for n in got if n.startswith(("layers.", "embed_tokens", "norm", "lm_head"))]
    assert len(lm_names) == len(want)
    assert all(torch.equal(got[n], want[n]) for n in lm_names)


def test_a_microbatch_without_images_keeps_the_encoder_in_the_graph():
    """The patches are empty, not None: the encoder gets zero gradients, as in the whole model."""
    cfg = ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176)
    ((x, _),) = [(x, y) for x, y in _data(cfg) if x.images.size(1) == 0][:1]
    first, second = _built(cfg, 0, 4), _built(cfg, 1, 4)
    out = second(first(x))
    assert isinstance(out, Encoding) and out.patches.shape == (2, 0, cfg.enc_embd)
    out.patches.sum().backward()
    grads = {n: p.grad for s in (first, second) for n, p in s.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values()), grads.keys()


def test_tied_embedding_sits_on_the_projector_stage():
    cfg = ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176, tie_embeddings=True)
    assert [vit_vlm.tied(cfg, s, 4) for s in range(4)] == [
        {},
        {},
        {"embedding": "embed_tokens.weight"},
        {"embedding": "lm_head.weight"},
    ]
    assert torch.equal(_built(cfg, 2, 4).embed_tokens.weight, _built(cfg, 3, 4).lm_head.weight)
    assert vit_vlm.tied(cfg, 0, 1) == {} and vit_vlm.tied(ViTVLMConfig(), 1, 4) == {}
    whole = _built(cfg, 0, 1)
    assert whole.lm_head.weight is whole.embed_tokens.weight


def test_workload_blocks_are_the_stage_blocks():
    stage = _built(ViTVLMConfig(enc_layers=4, enc_embd=64, intermediate_size=176), 1, 4)
    assert vit_vlm.workload.blocks(stage) == [stage.vision_blocks["2"], stage.vision_blocks["3"]]


@pytest.mark.parametrize(
    "sets, message",
    [
        (["tp=2", "pp=2"], "the vit_vlm workload has no tensor parallelism"),
        (["model.patch_size=8"], "model.patch_size=8 differs from data.patch_size=4"),
        (["model.block_size=100"], "model.block_size=100 is below the longest sequence"),
        (["model.enc_embd=30"], "enc_embd \\(30\\) must be divisible by enc_head \\(4\\)"),
    ],
)
def test_config_refusals(sets, message):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        TrainConfig.load("configs/vit-vlm-tiny.toml", sets, world_size=4)


# -- rrfp train against one process ---------------------------------------------------------

SIZES = [
    "pp=4",
    "model.enc_layers=4",
    "model.enc_embd=32",
    "model.enc_head=2",
    "model.n_layer=3",
    "model.n_embd=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.intermediate_size=64",
    "model.tie_embeddings=true",
    "data.microbatch_size=2",
    "data.max_images=2",
]
CONFIG = "configs/vit-vlm-tiny.toml"


def _whole(name, full, tp_rank, tp):
    return full


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_train_pp4_equals_one_process():
    """The encoder over two stages, so an Encoding crosses ranks; microbatches with and without
    images; the tie between the projector's stage and the last."""
    from rrfp.app.config.train_config import TrainConfig

    sets = [*recipe(CONFIG), *SIZES]
    split = split_parts(TrainConfig.load(CONFIG, sets, world_size=4).model, 4)
    assert split[0][-1][0] == "vit" and split[1][0][0] == "vit", f"encoder on one stage: {split}"
    want = reference(CONFIG, sets, 4)
    assert min(want[1]) > CLIP, f"clipping should act: {want[1]}"
    results = run_ranks(train, 4, CONFIG, sets, "rrfp.models.vit_vlm", "ViTVLM", timeout=180)
    images = results[0][4]
    assert 0 in images and max(images) > 0, f"want microbatches with and without images: {images}"
    loss, norm, param = differences(results, want, 1, _whole)
    print(
        f"vit_vlm pp4 {split}: max |loss - ref| {loss:.3g}, "
        f"|norm - ref| {norm:.3g}, |param - ref| {param:.3g}; losses {want[0]}"
    )
    assert loss < 1e-12 and norm < 1e-12 and param < 1e-12, (loss, norm, param)
    assert want[0][-1] < want[0][0], "the reference should learn"
