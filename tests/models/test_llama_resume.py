"""A llama resumed from a checkpoint (pp 2 x dp 2, ready BFW with the split backward) repeats the
unbroken run bit for bit: every step's loss, gradient norm and auxiliary loss, and every tensor of
the final checkpoint (weights, AdamW's moments and step, the RNG states). Dense, and a mixture of
experts with its experts local and both balancers on (the expert biases are a persistent buffer
the bias update moves)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.checkpoint_state import differing, final_state
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

# one step saved, one resumed: the resumed step crosses every saved tensor (AdamW's moments and
# step, the expert biases, the RNG and data position), whatever the number of steps
CONFIG, STEPS, STOP_AT = "configs/moe-tiny.toml", 2, 1
SIZES = [
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
    "model.n_kv_head=1",
    "model.intermediate_size=24",
    "model.moe_experts=4",
    "model.moe_intermediate_size=12",
    "model.moe_shared_intermediate_size=8",
    "model.moe_first_dense=0",
    "model.moe_bias_update_rate=0.01",
    "n_microbatches=2",
    "data.microbatch_size=2",
    "data.max_seq_len=16",
    "data.min_seq_len=8",
    "timeout_s=60",
    "output.dir=",  # no run folder: metrics nobody reads
]


def _runs(rank, world, root, sizes):
    import datetime

    import torch.distributed as dist

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    def cfg(steps, folder, *more):
        sets = [*sizes, f"steps={steps}", f"checkpoint.dir={Path(root) / folder}", *more]
        return TrainConfig.load(CONFIG, sets, world_size=world)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    whole = run(stage_main(cfg(STEPS, "whole")))
    first = run(stage_main(cfg(STOP_AT, "resumed", "checkpoint.every=1")))
    dist.barrier()
    second = run(stage_main(cfg(STEPS, "resumed", "checkpoint.resume=required")))
    dist.destroy_process_group()
    return _series(whole), _series(first, second), second.first_step


def _series(*runs) -> tuple[list, list, list]:
    """The runs' losses, gradient norms and auxiliary losses, one after the other."""
    return tuple(
        sum((getattr(r, k) for r in runs), []) for k in ("losses", "grad_norms", "aux_losses")
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["moe", "dense"])
def test_resume_equals_the_unbroken_run(tmp_path, model):
    sizes = SIZES if model == "moe" else [*SIZES, "model.moe_experts=0"]
    ranks = run_ranks(_runs, 4, str(tmp_path), sizes, timeout=280)
    for rank, (whole, resumed, start) in ranks.items():
        assert start == STOP_AT, rank
        assert resumed == whole and len(whole[0]) == STEPS, (rank, whole, resumed)
        assert bool(whole[2]) == (model == "moe"), whole[2]
    a, b = final_state(tmp_path / "whole", STEPS), final_state(tmp_path / "resumed", STEPS)
    moments = [k for k in a if k.endswith("exp_avg_sq")]
    assert moments and any(a[k].abs().max() > 0 for k in moments), moments
    assert any(k.startswith("rank3.rng") for k in a), sorted(a)[:5]
    assert a.keys() == b.keys() and not differing(a, b), differing(a, b)[:5]
    biases = [k for k in a if k.endswith("expert_bias")]
    assert bool(biases) == (model == "moe"), biases
    assert not biases or any(a[k].abs().max() > 0 for k in biases), biases
