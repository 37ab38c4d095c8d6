"""The evaluation pass of a training run ([eval]): the mean loss of held-out microbatches, each
run forward only through the pipeline (``StageExecutor.run_eval``: F tasks alone, under
``torch.no_grad`` on every stage, nothing kept for a backward, gradients untouched).

The held-out data is the workload's ``eval_batches`` or, without it, its ``batches`` at step
indices from ``HELD_OUT_STEP`` on, which no run reaches (run.steps is at most 10**9): the same
microbatches at every evaluation, so the losses compare across steps. rrfp/models/data.py's
``eval_batches`` (gpt, llama) draws from data that training never draws: the stdlib bytes after
the training corpus, or the last of the user's documents.

The stage modules are in eval mode for the pass (dropout off), so it draws no random numbers and
a resumed run, whose generators come from its checkpoint, evaluates as the unbroken run did.
"""

from __future__ import annotations

import torch

from rrfp.pipeline.user_code import counted, function_name

HELD_OUT_STEP = 1 << 40


def held_out(workload, data_cfg, index: int, n_microbatches: int):
    """Held-out iteration ``index``'s microbatches, the same on every rank; checked as a step's
    (rrfp/pipeline/user_code.py)."""
    own = workload.eval_batches is not None
    fn = workload.eval_batches if own else workload.batches
    what = "eval_batches" if own else "batches"
    where = f"{what} ({function_name(fn)}) for held-out iteration {index + 1}"
    return counted(fn, where, data_cfg, index if own else HELD_OUT_STEP + index, n_microbatches)


def due(every: int, step: int, steps: int) -> bool:
    """Evaluate after (0-based) ``step``? Every ``every`` steps and after the last; never at 0."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


async def evaluate(
    rt, ex, modules, workload, data_cfg, eval_cfg, n_microbatches: int, step: int, thread_state=None
) -> float:
    """Collective: the mean loss over the held-out microbatches of every data-parallel replica,
    on every rank. ``step`` names the pass in the pipeline's messages."""
    dp, dp_rank = rt.layout.dp, rt.dp_rank
    total = torch.zeros(2, dtype=torch.float64)  # sum of microbatch losses, their count
    training = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        for index in range(eval_cfg.batches):
            data = held_out(workload, data_cfg, index, n_microbatches * dp)
            mine = data[dp_rank * n_microbatches : (dp_rank + 1) * n_microbatches]
            if rt.device.type != "cpu":
                mine = [
                    (x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                    for x, y in mine
                ]
            res = await ex.run_eval(step, mine, thread_state=thread_state)
            total[0] += sum(res.losses.values())
            total[1] += len(res.losses)
    finally:
        for m, was in zip(modules, training, strict=True):
            m.train(was)
    await rt.all_reduce(total, what=f"step {step + 1}: world all-reduce of the evaluation loss")
    return total[0].item() / total[1].item()
