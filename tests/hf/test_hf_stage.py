"""rrfp.hf: a HF causal LM's stages, built alone from the config (meta first, only the stage's
layers materialised), hold exactly the whole model's tensors from the same seed, chain to the
whole model's logits, and read only their own tensors from a safetensors checkpoint."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")
from harness import ROOT  # noqa: E402
from harness.forked_python import run_python  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from rrfp.hf import build_hf_model, build_hf_stage, hf_layer_ranges, hf_ties  # noqa: E402

SIZES = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def llama(**kw):
    return transformers.LlamaConfig(**{**SIZES, **kw})


def qwen3(**kw):
    return transformers.Qwen3Config(**{**SIZES, "head_dim": 8, **kw})


def mistral(**kw):
    return transformers.MistralConfig(**{**SIZES, "sliding_window": 5, **kw})


def params(module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(remove_duplicate=False))


def test_first_stage_alone_equals_the_whole_models_slice():
    cfg = llama()
    stage = build_hf_stage(cfg, 0, 4, seed=7, dtype=torch.float64)
    whole = params(build_hf_model(cfg, seed=7, dtype=torch.float64))
    mine = params(stage)
    assert set(mine) == {
        n
        for n in whole
        if n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1."))
    }
    for name, p in mine.items():
        assert p.dtype == torch.float64 and torch.equal(p, whole[name]), name
    assert not torch.equal(
        mine["model.layers.0.mlp.up_proj.weight"], mine["model.layers.1.mlp.up_proj.weight"]
    )
    other = params(build_hf_model(cfg, seed=8, dtype=torch.float64))
    assert not torch.equal(
        mine["model.layers.1.mlp.up_proj.weight"], other["model.layers.1.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize("make", [llama, qwen3, mistral], ids=["llama", "qwen3", "mistral"])
def test_stages_chain_to_the_whole_models_logits_and_gradients(make):
    """Uneven ranges, a padding mask, a tied head on Qwen3: rotary and masks rebuilt per stage."""
    cfg = make(tie_word_embeddings=make is qwen3)
    whole = build_hf_model(cfg, seed=1, dtype=torch.float64, gradient_checkpointing=True)
    ranges = [(0, 1), (1, 4), (4, 5), (5, 8)]
    stages = [
        build_hf_stage(
            cfg, s, 4, layers=ranges, seed=1, dtype=torch.float64, gradient_checkpointing=True
        )
        for s in range(4)
    ]
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 17, dtype=torch.long)
    pad[1, :4] = 0  # left padding on the second row
    ref = whole(ids, attention_mask=pad).logits
    x = (ids, None, pad)
    for st in stages:
        x = st(*x) if isinstance(x, tuple) else st(x)
    assert torch.equal(x, ref)
    assert torch.isfinite(x).all()
    ref.square().mean().backward()
    x.square().mean().backward()
    whole_p = params(whole)
    for st in stages:
        for name, p in st.named_parameters():
            if make is qwen3 and name in ("lm_head.weight", "model.embed_tokens.weight"):
                continue  # tied: the whole model's gradient is the sum of the two stages'
            assert torch.allclose(p.grad, whole_p[name].grad, rtol=0, atol=1e-12), name
    tied = stages[0].model.embed_tokens.weight.grad + stages[-1].lm_head.weight.grad
    if make is qwen3:
        assert torch.allclose(tied, whole.model.embed_tokens.weight.grad, rtol=0, atol=1e-12)


def test_rotary_buffers_are_recomputed_not_left_from_the_meta_build():
    stage = build_hf_stage(qwen3(), 2, 4, seed=0)
    whole = build_hf_model(qwen3(), seed=0)
    for buf in ("inv_freq", "original_inv_freq"):
        assert torch.equal(
            getattr(stage.model.rotary_emb, buf), getattr(whole.model.rotary_emb, buf)
        )
    assert stage.model.rotary_emb.inv_freq[0] == 1.0


def test_gradient_checkpointing_switches_hf_checkpointing_on_each_layer():
    on = build_hf_stage(llama(), 1, 2, gradient_checkpointing=True)
    off = build_hf_stage(llama(), 1, 2)
    assert all(layer.gradient_checkpointing for layer in on.model.layers.values())
    assert not any(layer.gradient_checkpointing for layer in off.model.layers.values())
    x = torch.randn(1, 9, 32)
    assert torch.equal(on(x), off(x))


def _shard_by_layer(model, folder: Path) -> None:
    """HF's sharded layout: one file per decoder layer, one for the rest, and the index."""
    weight_map = {}
    shards: dict[str, dict] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        file = f"model-{part}.safetensors"
        shards.setdefault(file, {})[name] = t.contiguous()
        weight_map[name] = file
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def test_sharded_checkpoint_reads_only_the_stages_tensors(tmp_path, monkeypatch):
    import safetensors

    cfg = qwen3(tie_word_embeddings=True)
    saved = build_hf_model(cfg, seed=5)
    _shard_by_layer(saved, tmp_path)
    read: list[str] = []
    opened: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, path, **kw):
            opened.append(Path(path).name)
            self.inner = real_open(path, **kw)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    last = build_hf_stage(
        cfg, 3, 4, seed=99, checkpoint=tmp_path
    )  # seed unused: the weights are the file's
    assert sorted(opened) == [
        "model-6.safetensors",
        "model-7.safetensors",
        "model-rest.safetensors",
    ]
    assert sorted(read) == sorted(
        [n for n in last.state_dict() if n != "lm_head.weight"] + ["model.embed_tokens.weight"]
    )
    assert not any(k.startswith(("model.layers.0.", "model.layers.5.")) for k in read)
    whole = params(saved)
    for name, p in last.named_parameters():
        assert torch.equal(p, whole[name]), name
    assert torch.equal(last.lm_head.weight, saved.model.embed_tokens.weight)
    assert torch.equal(last.model.rotary_emb.inv_freq, saved.model.rotary_emb.inv_freq)


def test_single_file_checkpoint_loads_into_its_dtype(tmp_path):
    cfg = llama()
    saved = build_hf_model(cfg, seed=2)
    save_file(
        {k: v.contiguous() for k, v in saved.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    for path in (tmp_path, tmp_path / "model.safetensors"):
        stage = build_hf_stage(cfg, 1, 2, seed=0, dtype=torch.float64, checkpoint=path)
        for name, p in stage.named_parameters():
            assert p.dtype == torch.float64 and torch.equal(p, saved.state_dict()[name].double()), (
                name
            )


def test_checkpoint_problems_are_one_clear_error(tmp_path):
    cfg = llama()
    with pytest.raises(ValueError, match="does not exist"):
        build_hf_stage(cfg, 0, 2, checkpoint=tmp_path / "nothing.safetensors")
    with pytest.raises(
        ValueError, match="neither model.safetensors.index.json nor model.safetensors"
    ):
        build_hf_stage(cfg, 0, 2, checkpoint=tmp_path)
    other = build_hf_model(
        llama(hidden_size=16, num_attention_heads=2, num_key_value_heads=1), seed=0
    )
    save_file(
        {k: v.contiguous() for k, v in other.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"has shape \(256, 16\).*another config"):
        build_hf_stage(cfg, 0, 2, checkpoint=tmp_path)


def test_layer_ranges_default_balanced_and_given_ones_checked():
    assert hf_layer_ranges(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert hf_layer_ranges(8, 2, [(0, 5), range(5, 8)]) == [range(0, 5), range(5, 8)]
    for bad, why in (
        (([0, 4], [5, 8]), "do not continue at layer 4"),
        (([0, 4],), "1 layer ranges for 2"),
        (([0, 4], [4, 4]), "at least one layer"),
        (([0, 4], [4, 7]), "end at layer 7"),
        (([0, 4], "48"), "not a range"),
    ):
        with pytest.raises(ValueError, match=why):
            hf_layer_ranges(8, 2, bad)
    with pytest.raises(ValueError, match="9 stages for 8 decoder layers"):
        hf_layer_ranges(8, 9)


def test_bad_configs_are_one_clear_error():
    with pytest.raises(NotImplementedError, match="not model_type 'gpt2'"):
        build_hf_stage(transformers.GPT2Config(), 0, 1)
    with pytest.raises(TypeError, match="expected a transformers config"):
        build_hf_stage({"model_type": "llama"}, 0, 1)
    with pytest.raises(ValueError, match=r"stage must be an integer in \[0, 2\)"):
        build_hf_stage(llama(), 2, 2)


# rrfp and transformers unloaded from a child of the preloaded forkserver, which has torch: the
# imports rrfp makes as a fresh interpreter would make them, without its 3 CPU-s of torch's import
UNLOADED = (
    "import sys\nfor name in [m for m in sys.modules if m.partition('.')[0] in ('rrfp', "
    "'transformers')]:\n    del sys.modules[name]\n"
)


@pytest.mark.e2e
def test_rrfp_loads_no_transformers_and_says_how_to_install_it():
    code = UNLOADED + (
        "import sys, rrfp, rrfp.hf; rrfp.hf.HFStage; assert 'transformers' not in sys.modules, "
        "'loaded'\nsys.modules['transformers'] = None\ntry:\n    rrfp.build_hf_stage(None, 0, "
        "1)\nexcept ImportError as e:\n    print(e)\n"
    )
    out = run_python(["-c", code], cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "rrfp.hf needs transformers" in out.stdout and "pip install 'rrfp[hf]'" in out.stdout, (
        out.stdout
    )


def test_ties_declare_the_embedding_and_head_across_stages_only():
    cfg = qwen3(tie_word_embeddings=True)
    assert [build_hf_stage(cfg, s, 3).ties for s in range(3)] == [
        {"embedding": "model.embed_tokens.weight"},
        {},
        {"embedding": "lm_head.weight"},
    ]
    assert hf_ties(cfg, 0, 1) == {} and hf_ties(qwen3(tie_word_embeddings=False), 0, 2) == {}
    alone = build_hf_stage(cfg, 0, 1)
    assert alone.lm_head.weight is alone.model.embed_tokens.weight
