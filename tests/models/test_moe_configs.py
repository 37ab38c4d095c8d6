"""The mixture-of-experts configs are valid configs of the llama workload, of the shapes their
comments say (the 1B-active one for GPUs: read here with gloo, its stages built on the meta
device, its MFU counted on the parameters a token uses), and the model config refuses MoE
settings it cannot build."""

import pytest
import torch

from rrfp.app.config.train_config import TrainConfig
from rrfp.app.train.metrics_mfu import model_flops
from rrfp.models import llama
from rrfp.models.llama import Llama, LlamaConfig
from rrfp.models.vit_vlm import ViTVLMConfig
from rrfp.nn.moe_layer import MoELayer


def _active_and_total(stages: list[torch.nn.Module]) -> tuple[int, int]:
    """Parameters one token uses (top-k of the routed experts) and all of them, embeddings left
    out."""
    active = total = 0
    for s in stages:
        for name, p in s.named_parameters():
            if "embed_tokens" in name:
                continue
            total += p.numel()
            active += p.numel()
        for m in s.modules():
            if isinstance(m, MoELayer):
                routed = sum(p.numel() for p in m.experts.parameters())
                active -= routed - routed * m.top_k // m.num_experts
    return active, total


def test_moe_tiny_is_pp2_dp2_with_both_balancers():
    cfg = TrainConfig.load("configs/moe-tiny.toml", [], world_size=4)
    assert cfg.workload is llama.workload and (cfg.layout.pp, cfg.layout.dp) == (2, 2)
    m = cfg.model
    assert m.moe_experts == 8 and m.moe_aux_loss_coeff > 0 and m.moe_bias_update_rate > 0
    assert [m.is_moe(i) for i in range(m.n_layer)] == [False, True, True, True]


def test_moe_1b_has_about_1b_active_parameters():
    cfg = TrainConfig.load("configs/moe-1b.toml", ["compute.backend=gloo"], world_size=2)
    with torch.device("meta"):
        stages = [Llama(cfg.model, s, 2) for s in range(2)]
    active, total = _active_and_total(stages)
    assert 0.9e9 < active < 1.2e9, active
    assert 3.0e9 < total < 3.5e9, total
    # MFU counts the parameters a token uses: top_k of the routed experts
    assert model_flops(llama.workload, cfg.model, 2).params == active


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(moe_experts=4, moe_top_k=5), "moe_top_k must be in"),
        (dict(moe_experts=-1), "moe_experts must be >= 0"),
        (dict(moe_experts=4, moe_score_func="relu"), "moe_score_func"),
        (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff must be >= 0"),
    ],
)
def test_config_refuses_moe_settings_it_cannot_build(kw, words):
    with pytest.raises(ValueError, match=words):
        LlamaConfig(**kw)


def test_tp_and_vit_vlm_refuse_experts_in_one_line():
    with pytest.raises(ValueError, match="no tensor parallelism in rrfp: set tp = 1"):
        llama.validate_tp(LlamaConfig(moe_experts=4), 2)
    with pytest.raises(ValueError, match="vit_vlm's LM is dense"):
        ViTVLMConfig(moe_experts=4)
