"""``rrfp train`` with expert parallelism (configs/moe-tiny.toml, pp 2 x dp 2 on 4 gloo ranks,
``parallel.ep = 2``): the run equals the one with the experts local, and with the rest of each stage
FSDP-sharded (``dp_shard``) the one with it replicated; a run resumed from its
step-2 checkpoint, whose EP members saved their own experts, repeats the unbroken run bit for bit:
its losses, its gradient norms and every tensor of its final checkpoint. The unbroken run with the
experts sharded (every block a MoE block, as in the FSDP test's layouts) is trained once for the
module: the local-experts test compares against it, the FSDP test's pp 2 x dp 2 row takes it as its
replicated run, and the resume test resumes from its checkpoint. It has three steps of two
microbatches: two before the save and one after it make the resume cross a saved optimizer state,
data position and learning rate. The runs compared with it run its first two steps: the second
step's loss and norm come after the first's update, and what is compared (sharded or local
experts, FSDP or replicated stages) does not depend on how many."""

from __future__ import annotations

import shutil

import pytest
from harness.checkpoint_state import differing, final_state
from harness.distributed import run_ranks
from harness.moe_tiny_run import CONFIG, short_run

pytestmark = pytest.mark.multirank

STEPS, SAVED = 3, 2
COMPARED = 2  # the steps of the runs compared with the module's
SETS = ["n_microbatches=2", "model.moe_first_dense=0"]


def _train(rank, world, ep, ckdir, resume, extra=(), steps=STEPS):
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    sets = [*short_run(steps), *SETS, f"parallel.ep={ep}", *extra]
    if ckdir is not None:
        sets += [f"checkpoint.dir={ckdir}", f"checkpoint.every={SAVED}", "checkpoint.keep=5"]
        sets += [f"checkpoint.resume={resume}"]
    cfg = TrainConfig.load(CONFIG, sets, world_size=world)
    s = run(stage_main(cfg))
    return s.first_step, s.losses, s.grad_norms


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """The unbroken run with ``parallel.ep = 2``, saving every ``SAVED`` steps: (its folder,
    rank 0's first step, losses and gradient norms)."""
    whole = tmp_path_factory.mktemp("ep-train") / "whole"
    return whole, run_ranks(_train, 4, 2, whole, "off", timeout=180)[0]


@pytest.mark.timeout(400)
def test_experts_sharded_train_as_local_ones(sharded_run):
    local = run_ranks(_train, 4, 1, None, "off", (), COMPARED, timeout=180)[0]
    sharded = sharded_run[1]
    assert len(sharded[1]) == STEPS and sharded[1][-1] < sharded[1][0], sharded[1]
    assert len(local[1]) == COMPARED, local[1]
    # float32, the experts' products over other row groupings: equal to rounding
    assert sharded[1][:COMPARED] == pytest.approx(local[1], rel=1e-5), (local[1], sharded[1])
    assert sharded[2][:COMPARED] == pytest.approx(local[2], rel=1e-4), (local[2], sharded[2])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("pp, replicas", [(2, 2), (1, 4)])
def test_experts_beside_fsdp_stages_train_as_beside_replicated_ones(pp, replicas, sharded_run):
    """``dp_shard``: the rest of each stage FSDP-sharded over the replicas, the experts over the EP
    group as with ``dp`` (pp 2 x dp_shard 2 = ep 2: every replica holds its own experts; pp 1 x
    dp_shard 4 over ep 2: two replicas hold each, their gradients summed between them)."""
    layout = [f"parallel.pp={pp}"]
    replicated = (  # the module's run is pp 2 x dp 2 (the config's layout)
        sharded_run[1]
        if (pp, replicas) == (2, 2)
        else run_ranks(
            _train, 4, 2, None, "off", [*layout, f"parallel.dp={replicas}"], COMPARED, timeout=180
        )[0]
    )
    sharded = run_ranks(
        _train,
        4,
        2,
        None,
        "off",
        [*layout, "parallel.dp=1", f"parallel.dp_shard={replicas}"],
        COMPARED,
        timeout=180,
    )[0]
    assert len(sharded[1]) == COMPARED and sharded[1][-1] < sharded[1][0], sharded[1]
    # float32, the FSDP shards' norms summed in other groupings: equal to rounding
    want_losses, want_norms = replicated[1][:COMPARED], replicated[2][:COMPARED]
    assert sharded[1] == pytest.approx(want_losses, rel=1e-6), (replicated[1], sharded[1])
    assert sharded[2] == pytest.approx(want_norms, rel=1e-6), (replicated[2], sharded[2])


@pytest.mark.timeout(400)
def test_resume_with_sharded_experts_repeats_the_unbroken_run(sharded_run, tmp_path):
    (whole, a), broken = sharded_run, tmp_path / "broken"
    broken.mkdir()
    shutil.copytree(whole / f"step-{SAVED:08d}", broken / f"step-{SAVED:08d}")
    b = run_ranks(_train, 4, 2, broken, "required", timeout=180)[0]
    assert a[0] == 0 and b[0] == SAVED, (a[0], b[0])
    assert b[1] == a[1][SAVED:] and b[2] == a[2][SAVED:], (a, b)
    x, y = final_state(whole, STEPS), final_state(broken, STEPS)
    # each EP member's experts under its own key, and they differ
    w1 = sorted(k for k in x if k.endswith("experts.w1") and ".model." in k)
    assert any(".ep1." in k for k in w1) and any(".ep0." in k for k in w1), w1
    pair = [k for k in w1 if k.startswith("stage1.tp0.ep")][:2]
    assert len(pair) == 2 and not (x[pair[0]] == x[pair[1]]).all()
    assert x.keys() == y.keys()
    assert not differing(x, y), f"the resumed run's final state differs in {differing(x, y)[:5]}"
