"""``rrfp train`` with optim.clip_grad_norm, on real gloo ranks in float64: each step's reported
gradient norm and every loss match one process training the whole model with
torch.nn.utils.clip_grad_norm_ and AdamW; a NaN step (optim.on_nonfinite = skip) reports a NaN norm,
is not applied, and training goes on. With model.tie_embeddings the GPT declares its tie
(Workload.tied) and trains as the truly tied model. The norm is computed once per step (clipping
uses the one the step's statistics carry), and without clipping every step still reports it: the
whole model's, over pipeline stages, TP shards, DP replicas and FSDP shards."""

from __future__ import annotations

import math

import pytest
from harness.clip_reference import CLIP, SETS, STEPS, _reference
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank


def _train(rank, world, dp, nan_step, extra=()):
    import torch

    import rrfp.comm.grad_norm as grad_norm
    import rrfp.pipeline.runtime as runtime
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    torch.set_default_dtype(torch.float64)
    fault = [f"fault=nan:step={nan_step}:stage=1"] if nan_step else []
    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml", [*SETS, f"dp={dp}", *fault, *extra], world_size=world
    )
    # the norm: one share per step, and no more (the runtime's and the clipping's own path)
    shares = _count_calls([runtime, grad_norm], "local_share")
    summary = run(stage_main(cfg))
    assert shares == [1] * len(summary.losses), shares
    # the reference in float64 too, once
    want = _reference(world, dp, nan_step, extra) if rank == 0 else None
    return summary.losses, summary.grad_norms, summary.skipped, want


def _count_calls(modules, name: str) -> list[int]:
    """Wrap ``name`` in each of ``modules``; the list holds a 1 per call to any of them (this
    rank's process only)."""
    calls: list[int] = []
    for module in modules:
        real = getattr(module, name)

        def counted(*args, real=real, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        setattr(module, name, counted)
    return calls


def _check(results, nan_step=None):
    want_losses, want_norms = results[0][3]
    assert all(n > CLIP for n in want_norms if not math.isnan(n)), "the test must clip"
    for rank, (losses, norms, skipped, _) in results.items():
        assert skipped == ([nan_step - 1] if nan_step else []), (rank, skipped)
        assert len(norms) == STEPS, (rank, norms)
        for got, want in zip(norms, want_norms):
            assert (math.isnan(got) and math.isnan(want)) or math.isclose(
                got, want, rel_tol=1e-10
            ), (rank, norms, want_norms)
        worst = max(abs(a - b) for a, b in zip(losses, want_losses))
        assert worst < 1e-10, (
            f"rank {rank}: losses differ from the reference by {worst}: {losses} {want_losses}"
        )


@pytest.mark.timeout(200)
def test_train_pp2_dp2_clips_by_the_global_norm():
    _check(run_ranks(_train, 4, 2, None, timeout=180))


@pytest.mark.timeout(200)
def test_train_nonfinite_step_reports_nan_norm_and_goes_on():
    _check(run_ranks(_train, 2, 1, 2, timeout=180), nan_step=2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "placement", ["interleaved", "v"]
)  # the two copies on two ranks, or both on rank 0
def test_train_tied_embeddings_v2_match_the_tied_model(placement):
    extra = ["model.tie_embeddings=true", "virtual=2", f"placement={placement}", "model.n_layer=4"]
    _check(run_ranks(_train, 2, 1, None, extra, timeout=180))


# without clipping every step still reports the whole model's norm, across stages, shards and
# replicas: (the layout's sets, its data-parallel degree for the reference's batch, and the sets
# the reference loads the same config with)
NORM_LAYOUTS = {
    "pp2-dp2": (["pp=2", "dp=2"], 2, ["pp=2"]),
    "pp2-tp2": (["pp=2", "tp=2"], 1, ["pp=2", "tp=2"]),
    "pp2-dp_shard2": (["pp=2", "dp_shard=2", "hint=bfw"], 2, ["pp=2"]),
}


def _unclipped(rank, world, sets, dp, same):
    import torch

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    torch.set_default_dtype(torch.float64)
    cfg = TrainConfig.load(
        "configs/gpt-tiny.toml", [*SETS, "clip_grad_norm=0", *sets], world_size=world
    )
    summary = run(stage_main(cfg))
    # the reference in float64 too, once
    want = _reference(world, dp, None, same, clip=False) if rank == 0 else None
    return summary.losses, summary.grad_norms, want


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", NORM_LAYOUTS)
def test_every_step_reports_the_global_norm_without_clipping(name):
    results = run_ranks(_unclipped, 4, *NORM_LAYOUTS[name], timeout=180)
    want_losses, want_norms = results[0][2]
    assert any(n > CLIP for n in want_norms), "clipping at CLIP would have changed the run"
    for rank, (losses, norms, _) in results.items():
        assert norms == pytest.approx(want_norms, rel=1e-10), (rank, norms, want_norms)
        assert losses == pytest.approx(want_losses, rel=1e-10, abs=1e-12), rank
