"""The Llama-family LM (rrfp/models/llama.py): its blocks are HF Llama's and Qwen3's (same weights,
same logits); for any small config a stage built alone is that part of the whole model and builds no
other stage's blocks, and the stages chained are the whole model; ``rrfp train`` at pp 4 (tied and
untied) and pp 2 x tp 2 equals one process training the whole model, in float64 under ready BFW with
clipping and weight decay."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from harness.llama_reference import CLIP, differences, recipe, reference, train
from hypothesis import given, settings
from hypothesis import strategies as st

from rrfp.models import llama
from rrfp.models.llama import Llama, LlamaConfig, full_grad_slice, tp_shard_spec, validate_tp


def _tiny(**kw) -> LlamaConfig:
    return LlamaConfig(**{"n_layer": 3, "n_embd": 32, "n_head": 4, "n_kv_head": 2, **kw})


def _built(cfg: LlamaConfig, stage: int, num_stages: int, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(cfg, stage, num_stages)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name; a tied weight under both of its names."""
    return dict(module.named_parameters(remove_duplicate=False))


# -- the architecture against transformers --------------------------------------------------


@pytest.mark.parametrize("qk_norm,tie", [(False, False), (False, True), (True, True)])
def test_logits_equal_transformers_llama_and_qwen3(qk_norm, tie):
    """Same weights, same logits: RMSNorm, rotary, GQA, SwiGLU (and QK-norm) are HF's."""
    transformers = pytest.importorskip("transformers", reason="the rrfp[hf] extra")
    cfg = _tiny(head_dim=16, intermediate_size=48, qk_norm=qk_norm, tie_embeddings=tie)
    kind = transformers.Qwen3Config if qk_norm else transformers.LlamaConfig
    hf_cfg = kind(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.hd,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=tie,
        attention_bias=False,
        dtype="float64",
    )
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).double().eval()
    ours = _built(cfg, 0, 1).double()
    state = {(n if n == "lm_head.weight" else f"model.{n}"): p for n, p in _params(ours).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    # transformers computes the rotary angles in float32 whatever the model's dtype
    diff = (want - got).abs().max().item()
    assert diff < 1e-6 * want.abs().max().item(), diff


# -- stages built alone ---------------------------------------------------------------------


@st.composite
def configs(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    hd = draw(st.sampled_from([2, 4, 8]))
    own_hd = draw(st.booleans())
    return LlamaConfig(
        n_layer=draw(st.integers(1, 4)),
        n_embd=heads * hd if not own_hd else draw(st.sampled_from([8, 12, 16])),
        n_head=heads,
        n_kv_head=kv,
        head_dim=hd if own_hd else 0,
        intermediate_size=draw(st.sampled_from([0, 8, 20])),
        qk_norm=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        vocab_size=draw(st.sampled_from([256, 300])),
    )


@settings(max_examples=25, deadline=None)
@given(cfg=configs(), data=st.data())
def test_stages_built_alone_chain_to_the_whole_model(cfg, data):
    num_stages = data.draw(st.integers(1, cfg.n_layer), label="num_stages")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    whole = _built(cfg, 0, 1, seed)
    want = _params(whole)
    made = []
    real_block = llama.Block

    class Counted(real_block):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    stages = []
    for s in range(num_stages):
        made.clear()
        llama.Block = Counted
        try:
            stages.append(_built(cfg, s, num_stages, seed))
        finally:
            llama.Block = real_block
        assert len(made) == len(stages[-1].layer_ids), "a stage built another stage's blocks"
    names = [set(_params(s)) for s in stages]
    assert set().union(*names) == set(want)
    assert sum(map(len, names)) == len(want)  # each name on one stage
    for stage in stages:
        for n, p in _params(stage).items():
            assert torch.equal(p, want[n]), n
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(seed))
    h = ids
    for stage in stages:
        h = stage(h)
    assert h.shape == (2, 7, cfg.vocab_size)
    assert torch.equal(h, whole(ids))


def test_the_seed_sets_every_part():
    a, b = _built(_tiny(), 0, 1, seed=0), _built(_tiny(), 0, 1, seed=1)
    for n, p in _params(a).items():
        if "norm" not in n:  # norms start at one whatever the seed
            assert not torch.equal(p, _params(b)[n]), n
    assert not torch.equal(a.layers["0"].mlp.up_proj.weight, a.layers["1"].mlp.up_proj.weight)


def test_tied_copies_start_equal_and_the_whole_model_shares_one():
    cfg = _tiny(tie_embeddings=True)
    whole = _built(cfg, 0, 1)
    assert whole.lm_head.weight is whole.embed_tokens.weight
    first, last = _built(cfg, 0, 3), _built(cfg, 2, 3)
    assert torch.equal(first.embed_tokens.weight, last.lm_head.weight)
    assert llama.tied(cfg, 0, 3) == {"embedding": "embed_tokens.weight"}
    assert llama.tied(cfg, 2, 3) == {"embedding": "lm_head.weight"}
    assert llama.tied(cfg, 1, 3) == {} and llama.tied(cfg, 0, 1) == {}
    assert llama.tied(_tiny(), 0, 3) == {}


def test_workload_blocks_are_the_stage_blocks():
    stage = _built(_tiny(n_layer=4), 1, 2)
    assert llama.workload.blocks(stage) == [stage.layers["2"], stage.layers["3"]]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(n_kv_head=3), "n_kv_head \\(3\\) must divide n_head \\(4\\)"),
        (dict(n_embd=30), "n_embd \\(30\\) must be divisible by n_head"),
        (dict(head_dim=5), "rotary needs an even head_dim, got 5"),
        (dict(n_layer=0), "n_layer must be positive"),
        (dict(intermediate_size=-1), "intermediate_size must be >= 0"),
        (dict(rope_theta=0.0), "rope_theta must be positive"),
    ],
)
def test_config_refuses_shapes_it_cannot_build(kw, message):
    with pytest.raises(ValueError, match=message):
        _tiny(**kw)


def test_tp_layout():
    validate_tp(_tiny(), 2)
    with pytest.raises(ValueError, match="does not divide n_kv_head=2"):
        validate_tp(_tiny(), 4)
    with pytest.raises(ValueError, match="qk_norm has no tensor parallelism"):
        validate_tp(_tiny(qk_norm=True), 2)
    assert tp_shard_spec("layers.3.self_attn.q_proj.weight") == (0, 1)
    assert tp_shard_spec("layers.0.self_attn.o_proj.weight") == (1, 1)
    assert tp_shard_spec("layers.0.mlp.down_proj.weight") == (1, 1)
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.input_layernorm.weight"):
        assert tp_shard_spec(name) is None, name
    w = torch.arange(12.0).view(4, 3)
    assert torch.equal(full_grad_slice("layers.1.self_attn.k_proj.weight", w, 1, 2), w[2:])
    assert torch.equal(full_grad_slice("layers.1.mlp.down_proj.weight", w.T, 0, 2), w.T[:, :2])


def test_a_token_file_over_the_vocabulary_is_refused_in_one_line(tmp_path):
    """The user's token file: ids must fit model.vocab_size (a tokenizer's vocabulary, not 256)."""
    import numpy as np

    from rrfp.models.data import DataConfig

    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    data = DataConfig(tokens=str(path), cache_dir=str(tmp_path / "c"), max_seq_len=64)
    with pytest.raises(ValueError, match="token id 999 >= model.vocab_size=256"):
        llama.check(_tiny(block_size=64), data, 1, 1)
    llama.check(_tiny(block_size=64, vocab_size=1000), data, 1, 1)


@pytest.mark.parametrize("name,world", [("llama-tiny", 4), ("llama-1b", 2)])
def test_named_configs_load(name, world):
    """The named configs are valid configs of this model (the 1B one is for GPUs: read here with
    gloo, not built)."""
    from rrfp.app.config.train_config import TrainConfig

    sets = ["compute.backend=gloo"] if name == "llama-1b" else []
    cfg = TrainConfig.load(f"configs/{name}.toml", sets, world_size=world)
    assert cfg.workload is llama.workload and isinstance(cfg.model, LlamaConfig)
    if name == "llama-1b":  # its stages on the meta device: shapes, no memory
        m = cfg.model
        assert (m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.ffn) == (16, 2048, 32, 8, 8192)
        with torch.device("meta"):
            stages = [Llama(m, s, 2) for s in range(2)]
        block = 2 * m.n_embd * m.n_head * m.hd + 2 * m.n_embd * m.n_kv_head * m.hd
        block += 3 * m.n_embd * m.ffn + 2 * m.n_embd  # + its two norms
        held = [sum(p.numel() for p in s.parameters()) for s in stages]
        embedding = m.vocab_size * m.n_embd  # on both stages: the tie's two copies
        assert held == [8 * block + embedding, 8 * block + m.n_embd + embedding]
        assert 0.9e9 < sum(held) < 1.3e9, held


# -- rrfp train against one process ---------------------------------------------------------

SIZES = [
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.intermediate_size=48",
    "model.block_size=32",
    "data.microbatch_size=2",
    "data.min_seq_len=6",
    "data.max_seq_len=20",
]
CONFIG = "configs/llama-tiny.toml"


@pytest.mark.multirank
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "layout",
    [
        ["pp=4"],
        ["pp=4", "model.tie_embeddings=true", "model.qk_norm=true"],
        ["pp=2", "tp=2"],
    ],
    ids=["pp4", "pp4-tied-qknorm", "pp2-tp2"],
)
def test_train_equals_one_process(layout):
    sets = [*recipe(CONFIG), *SIZES, *layout]
    want = reference(CONFIG, sets, 4)
    assert min(want[1]) > CLIP, f"clipping should act: {want[1]}"
    results = run_ranks(train, 4, CONFIG, sets, "rrfp.models.llama", "Llama", timeout=180)
    tp = 2 if "tp=2" in layout else 1
    loss, norm, param = differences(results, want, tp, full_grad_slice)
    print(
        f"llama {layout}: max |loss - ref| {loss:.3g}, "
        f"|norm - ref| {norm:.3g}, |param - ref| {param:.3g}; losses {want[0]}"
    )
    assert loss < 1e-12 and norm < 1e-12 and param < 1e-12, (loss, norm, param)
    assert want[0][-1] < want[0][0], "the reference should learn"
