"""``rrfp train`` on a HuggingFace mixture of experts (``model = "hf"``, family qwen3_moe or
mixtral, a tiny config built locally, float32, pp 2 on 2 gloo ranks, the balance loss on): every
step's router statistics are in metrics.jsonl, and the first step's equal what one process
finds in the whole HF model's own router logits: the balance loss (HF's function per layer,
weighted by ``router_aux_loss_coef / L``, the mean over microbatches summed over layers), the
worst layer's most loaded expert over the mean load, and no dropped tokens."""

import json

import pytest

pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")

from harness.distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

M, STEPS, COEF, TOP_K = 4, 2, 0.5, 2
MODEL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts=4,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=16,
    router_aux_loss_coef=COEF,
)


def _doc(family: str, out: str) -> dict:
    return {
        "run": dict(model="hf", steps=STEPS, seed=0, timeout_s=60),
        "parallel": dict(pp=2),
        "schedule": dict(n_microbatches=M),
        "output": dict(dir=out),
        "model": dict(family=family, **MODEL),
        "data": dict(seed=3, microbatch_size=2, min_seq_len=8, max_seq_len=40),
    }


def _train(rank, world, doc):
    import asyncio

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main

    summary = asyncio.run(stage_main(TrainConfig.from_dict(doc, world_size=world)))
    return summary.metrics


def _first_step(doc) -> tuple[float, float]:
    """(aux loss, load max over mean) of step 1, from the whole model's router logits."""
    import importlib

    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.models.hf import build_model
    from rrfp.nn.moe_aux_loss import collect_aux_losses

    cfg = TrainConfig.from_dict(doc, world_size=2)
    wl, model = cfg.workload, build_model(cfg.model, 0)
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    layers = cfg.model.num_hidden_layers
    aux, loads = 0.0, torch.zeros(layers, cfg.model.num_experts, dtype=torch.float64)
    for x, _ in wl.microbatches(cfg.data, 0, M):
        with collect_aux_losses():  # rrfp's own injection, not what is compared
            logits = model(x).router_logits
        assert len(logits) == layers
        for i, g in enumerate(logits):
            aux += COEF / layers * balance((g,), cfg.model.num_experts, TOP_K).item() / M
            ids = torch.topk(torch.softmax(g.float(), -1), TOP_K, dim=-1).indices
            loads[i] += torch.bincount(ids.reshape(-1), minlength=cfg.model.num_experts)
    return aux, max((row.max() / row.mean()).item() for row in loads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hf_moe_router_statistics_in_metrics(family, tmp_path):
    doc = _doc(family, str(tmp_path / "out"))
    path = run_ranks(_train, 2, doc, timeout=240)[0]
    rows = [json.loads(line) for line in open(path).read().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    for r in rows:
        assert r["dropped_tokens"] == 0, r
        assert 0 < r["aux_loss"] and 1 <= r["expert_load_max_over_mean"] <= 4 / TOP_K, r
    aux, load = _first_step(doc)
    assert rows[0]["aux_loss"] == pytest.approx(aux, rel=1e-5), (rows[0], aux)
    assert rows[0]["expert_load_max_over_mean"] == pytest.approx(load, rel=1e-9), (rows[0], load)
