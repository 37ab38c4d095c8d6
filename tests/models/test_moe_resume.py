"""A mixture of experts resumed from a checkpoint (experts local, pp 2 x dp 2, both balancers on)
repeats the unbroken run bit for bit: every step's loss and auxiliary loss, and the expert biases
of the final checkpoint (a persistent buffer the bias update moves). (The final weights may differ
by one float32 ulp between the two, as a dense model's do: not what this test is about.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.checkpoint_state import differing, final_state
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

CONFIG, STEPS, STOP_AT = "configs/moe-tiny.toml", 4, 2
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
]


def _runs(rank, world, root):
    import datetime

    import torch.distributed as dist

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    def cfg(steps, folder, *more):
        sets = [*SIZES, f"steps={steps}", f"checkpoint.dir={Path(root) / folder}", *more]
        return TrainConfig.load(CONFIG, sets, world_size=world)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    whole = run(stage_main(cfg(STEPS, "whole")))
    first = run(stage_main(cfg(STOP_AT, "resumed", "checkpoint.every=1")))
    dist.barrier()
    second = run(stage_main(cfg(STEPS, "resumed", "checkpoint.resume=required")))
    dist.destroy_process_group()
    return (
        (whole.losses, whole.aux_losses),
        (first.losses + second.losses, first.aux_losses + second.aux_losses),
        second.first_step,
    )


@pytest.mark.timeout(300)
def test_moe_resume_equals_the_unbroken_run(tmp_path):
    for rank, (whole, resumed, start) in run_ranks(_runs, 4, str(tmp_path), timeout=280).items():
        assert start == STOP_AT, rank
        assert resumed == whole and len(whole[0]) == STEPS, (rank, whole, resumed)
    a, b = final_state(tmp_path / "whole", STEPS), final_state(tmp_path / "resumed", STEPS)
    biases = [k for k in a if k.endswith("expert_bias")]
    assert biases and any(a[k].abs().max() > 0 for k in biases), biases
    assert a.keys() == b.keys() and not differing({k: a[k] for k in biases}, b), biases
