"""rrfp train on HF causal LMs (model = "hf"): a tiny Llama and Qwen3 (its embedding and LM head
tied across the first and last stage) in float64, 4 stages on 2 gloo ranks (virtual stages), HF
activation checkpointing, gradient clipping and a warmup of the learning rate, equal to the whole
model trained on one process with the same seed and data."""

import shutil
from pathlib import Path

import pytest
from harness import ROOT

pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")

from harness.distributed import run_ranks  # noqa: E402
from harness.hf_reference import (  # noqa: E402
    CLIP,
    LR,
    STEPS,
    WARMUP,
    M,
    data_config,
    family_reference,
    model_config,
)


def _train(rank, world, family, folder, steps=STEPS, resume="off", every=0):
    import asyncio
    import dataclasses

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main

    doc = {
        "run": dict(model="hf", steps=steps, seed=0, timeout_s=60),
        "parallel": dict(pp=world, virtual=2),
        "schedule": dict(n_microbatches=M),
        "optim": dict(lr=LR, warmup_steps=WARMUP, clip_grad_norm=CLIP),
        "checkpoint": dict(dir=folder, resume=resume, every=every, keep=STEPS),
        "output": dict(dir=""),  # no run folder: metrics nobody reads
        "model": dataclasses.asdict(model_config(family)),
        "data": dataclasses.asdict(data_config()),
    }
    cfg = TrainConfig.from_dict(doc, world_size=world)
    summary = asyncio.run(stage_main(cfg))
    return summary.losses, summary.grad_norms


def _saved_parameters(folder: str) -> dict:
    """{name: tensor} of every stage's module in the run's last checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted(Path(folder).glob("step-*"))[-1]
    flat = Path(folder) / "whole.pt"
    dcp_to_torch_save(last, flat)
    state = torch.load(flat, weights_only=False)
    return {
        name: t
        for key, part in state.items()
        if key.startswith("stage")
        for name, t in part["model"].items()
    }


RESUMED = "llama"  # the family whose run the resume test resumes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(family)``: the family's run on 2 ranks, once for the module: (its checkpoint
    folder, each rank's losses and gradient norms). The RESUMED family's run saves every step:
    the resume test resumes its step-1 checkpoint."""
    runs = {}

    def run(family: str):
        if family not in runs:
            folder, every = tmp_path_factory.mktemp(family), int(family == RESUMED)
            runs[family] = (
                folder,
                run_ranks(_train, 2, family, str(folder), STEPS, "off", every, timeout=240),
            )
        return runs[family]

    return run


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rrfp_train_equals_one_process(family, trained):
    ref_losses, ref_params, ref_norms = family_reference(family)
    folder, results = trained(family)
    params = _saved_parameters(folder)
    losses, norms = results[0]
    assert results[1] == results[0] and len(losses) == STEPS
    assert max(ref_norms) > CLIP, f"clipping should act: norms {ref_norms}"
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms))
    assert norm_diff < 1e-12, (norms, ref_norms)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert set(params) == set(ref_params)
    param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    print(
        f"{family}: losses {losses}, max |loss - ref| {loss_diff:.3g}, max |param - ref| "
        f"{param_diff:.3g}, norms {norms}, max |norm - ref| {norm_diff:.3g}"
    )
    assert loss_diff < 1e-12 and param_diff < 1e-12, (loss_diff, param_diff)
    assert ref_losses[2] < ref_losses[0], "the reference should learn"


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_run_resumed_mid_warmup_continues_the_schedule(tmp_path, trained):
    """Resumed from its step-1 checkpoint, inside the 2-step warmup: steps 2 and 3 are the unbroken
    run's."""
    ref_losses = family_reference(RESUMED)[0]
    folder, first = trained(RESUMED)
    shutil.copytree(folder / "step-00000001", tmp_path / "step-00000001")
    resumed = run_ranks(_train, 2, RESUMED, str(tmp_path), STEPS, "auto", timeout=240)
    assert first[0][0][:1] == ref_losses[:1]
    assert resumed[0][0] == ref_losses[1:], (resumed[0][0], ref_losses)


def test_learning_rate_warms_up_linearly_from_zero():
    from rrfp.app.train.training import learning_rate

    assert [learning_rate(0.4, 4, s) for s in range(6)] == [
        0.0,
        0.1,
        0.2,
        0.30000000000000004,
        0.4,
        0.4,
    ]
    assert [learning_rate(0.4, 0, s) for s in range(2)] == [0.4, 0.4]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["warmup_steps=-1"],
            "optim.warmup_steps = -1 is out of bounds: it must be within [0, 1000000000]",
        ),
        (
            ["warmup_steps=0.5"],
            "--set warmup_steps (optim.warmup_steps) = 0.5 has the wrong type (expected int)",
        ),
        (["tp=2"], "parallel.tp = 2: rrfp.hf stages are not tensor-parallel; set parallel.tp = 1"),
        (
            ["model.family=gpt2"],
            "HFConfig.family must be one of llama, qwen3, qwen2, mistral, qwen3_moe, mixtral, "
            "got 'gpt2'",
        ),
        (["model.num_experts=4"], "HFConfig.num_experts = 4 with family 'llama': a mixture"),
        (["model.family='mixtral'"], "HFConfig.num_experts must be positive for 'mixtral'"),
        (["model.stage_layers=[1, 1]"], "HFConfig.stage_layers [1, 1] add up to 2 layers"),
        (["model.stage_layers=[4, 4]"], "model.stage_layers has 2 entries for 4 pipeline stages"),
        (["model.checkpoint='/nonexistent/hf'"], "model.checkpoint /nonexistent/hf does not exist"),
        (["model.dtype='float16'"], "HFConfig.dtype must be one of float32, float64, bfloat16"),
        (
            ["data.max_seq_len=200"],
            "data.max_seq_len=200 is above model.max_position_embeddings=128",
        ),
    ],
)
def test_bad_hf_configs_are_one_line(overrides, message):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        TrainConfig.load(ROOT / "configs" / "hf-llama-tiny.toml", overrides, world_size=4)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
