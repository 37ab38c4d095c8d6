"""HF causal LMs through rrfp.pipelining.ScheduleReady (torch's PipelineStage, microbatches of
17, 33, 25 and 40 tokens, uneven user-given layer ranges, HF activation checkpointing, global
gradient clipping, AdamW with a warmup schedule): a float64 Llama and a Qwen3 whose embedding and
LM head are tied across the two ranks equal one process."""

import pytest
import torch

pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")

from harness.distributed import run_ranks  # noqa: E402
from harness.hf_reference import CLIP, LR, STEPS, WARMUP, model_config, reference  # noqa: E402

pytestmark = pytest.mark.multirank

LENGTHS = (17, 33, 25, 40)
RANGES = [(0, 3), (3, 8)]


def microbatches(step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    out = []
    for length in LENGTHS:
        tokens = torch.randint(0, 256, (2, length + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _train(rank, world, family):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady, build_hf_stage
    from rrfp.models.hf import DTYPES, loss_fn

    cfg = model_config(family)
    dist.init_process_group("gloo")
    module = build_hf_stage(
        cfg.hf(),
        rank,
        world,
        layers=RANGES,
        seed=0,
        dtype=DTYPES[cfg.dtype],
        gradient_checkpointing=True,
    )
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / WARMUP))
    history, norms = [], []
    with ScheduleReady(stage, len(LENGTHS), loss_fn=loss_fn, tied=module.ties) as schedule:
        for step in range(STEPS):
            mbs, losses = microbatches(step), []
            schedule.step(
                arg_mbs=[(x,) for x, _ in mbs] if rank == 0 else None,
                target_mbs=[y for _, y in mbs] if rank == world - 1 else None,
                losses=losses,
            )
            norms.append(schedule.clip_grad_norm_(CLIP))
            opt.step()
            warmup.step()
            opt.zero_grad()
            if losses:
                history.append(torch.stack(losses).mean().item())
    dist.destroy_process_group()
    # numpy arrays: plain pickles, no shared memory that ends with the process
    return history, {n: p.detach().numpy() for n, p in module.named_parameters()}, norms


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_schedule_ready_equals_one_process(family):
    ref_losses, ref_params, ref_norms = reference(model_config(family), None, batches=microbatches)
    results = run_ranks(_train, 2, family, timeout=240)
    losses, norms = results[1][0], results[1][2]
    assert results[0][2] == norms and max(ref_norms) > CLIP, (norms, ref_norms)
    norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms))
    params = {n: torch.from_numpy(a) for n, a in {**results[0][1], **results[1][1]}.items()}
    assert set(params) == set(ref_params) and len(losses) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    print(
        f"{family}: losses {losses}, max |loss - ref| {loss_diff:.3g}, max |param - ref| "
        f"{param_diff:.3g}, norms {norms}, max |norm - ref| {norm_diff:.3g}"
    )
    assert loss_diff < 1e-12 and param_diff < 1e-12 and norm_diff < 1e-12, (
        loss_diff,
        param_diff,
        norm_diff,
    )
