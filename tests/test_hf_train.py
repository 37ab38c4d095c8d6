"""rrfp train on HF causal LMs (model = "hf"): a tiny Llama and Qwen3 in float64, 4 stages on 2
gloo ranks (virtual stages), HF activation checkpointing and a warmup of the learning rate,
equal to the whole model trained on one process with the same seed and data."""
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")

from distributed import run_ranks  # noqa: E402
from hf_reference import LR, M, STEPS, WARMUP, data_config, model_config, reference  # noqa: E402


def _train(rank, world, family, folder):
    import asyncio

    from rrfp.app.config import RunConfig, TrainConfig
    from rrfp.app.train import stage_main

    run = RunConfig(model="hf", pp=world, virtual=2, microbatches=M, steps=STEPS, lr=LR, warmup_steps=WARMUP,
                    seed=0, timeout_s=60, checkpoint_dir=folder)
    return asyncio.run(stage_main(TrainConfig(run, model_config(family), data_config(), world_size=world))).losses


def _saved_parameters(folder: str) -> dict:
    """{name: tensor} of every stage's module in the run's last checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted(Path(folder).glob("step-*"))[-1]
    flat = Path(folder) / "whole.pt"
    dcp_to_torch_save(last, flat)
    state = torch.load(flat, weights_only=False)
    return {name: t for key, part in state.items() if key.startswith("stage") for name, t in part["model"].items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rrfp_train_equals_one_process(family):
    ref_losses, ref_params = reference(model_config(family), data_config())
    with tempfile.TemporaryDirectory() as folder:
        results = run_ranks(_train, 2, family, folder, timeout=240)
        params = _saved_parameters(folder)
    losses = results[0]
    assert results[1] == losses and len(losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert set(params) == set(ref_params)
    param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    print(f"{family}: losses {losses}, max |loss - ref| {loss_diff:.3g}, max |param - ref| {param_diff:.3g}")
    assert loss_diff < 1e-12 and param_diff < 1e-12, (loss_diff, param_diff)
    assert ref_losses[2] < ref_losses[0], "the reference should learn"
