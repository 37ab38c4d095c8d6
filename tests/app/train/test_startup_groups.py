"""No process group is created after start-up, on any path a training run takes: the
iterations, the step's collectives, saving a checkpoint and resuming from one (real gloo,
two ranks). On NCCL each group is a communicator, so a group created later would be one
created on the event loop; tests/pipeline/test_gpu_path.py shows the same for NCCL's own
communicators on the fake."""

from __future__ import annotations

import pytest
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _groups_created(rank, world, root):
    import datetime
    import json

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run
    from rrfp.pipeline.runtime import PipelineRuntime

    phase, created = ["before"], []
    helper = c10d._new_process_group_helper

    def spy(*a, **k):
        created.append(phase[0])
        return helper(*a, **k)

    c10d._new_process_group_helper = spy
    start = PipelineRuntime.start

    def marked(*a, **k):
        phase[0] = "startup"
        rt = start(*a, **k)
        phase[0] = "run"
        return rt

    PipelineRuntime.start = marked

    def config(steps, **run_sets):
        sets = [
            "model.n_layer=2",
            "model.n_embd=32",
            "model.block_size=64",
            "data.min_seq_len=16",
            "data.max_seq_len=64",
            "n_microbatches=4",
            "pp=2",
            f"steps={steps}",
            "timeout_s=60",
            f"checkpoint.dir={root}",
            "checkpoint.every=1",
        ]
        return TrainConfig.load(
            "configs/gpt-tiny.toml", sets + [f"{k}={json.dumps(v)}" for k, v in run_sets.items()]
        )

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    first = run(stage_main(config(2)))
    dist.barrier()
    second = run(stage_main(config(3, resume="required")))
    counts = {p: created.count(p) for p in ("startup", "run")}
    phase[0] = "run"
    dist.new_group()  # the spy sees a group created after start-up
    seen = created.count("run")
    # new_group ends with no barrier (torch's TORCH_DIST_INIT_BARRIER is 0 by default), so the
    # ranks leave it apart: one that tears its groups down at once may close a connection its peer
    # is still forming (gloo's "Connection closed by peer" in that peer's new_group, under load)
    dist.barrier()
    dist.destroy_process_group()
    return counts, seen, second.first_step, len(first.losses) + len(second.losses)


@pytest.mark.timeout(120)
def test_no_process_group_is_created_after_startup(tmp_path):
    for rank, (counts, seen, resumed_from, steps) in run_ranks(
        _groups_created, 2, str(tmp_path), timeout=100
    ).items():
        assert resumed_from == 2 and steps == 3, (
            "the second run resumed from the first one's checkpoint"
        )
        assert counts["startup"] >= 2 * 2, counts  # per run: both channel groups
        assert counts["run"] == 0, (
            f"rank {rank}: {counts['run']} process group(s) created after start-up"
        )
        assert seen == 1, "the spy counts a group created after start-up"
