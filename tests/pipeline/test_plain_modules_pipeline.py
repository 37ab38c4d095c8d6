"""Four stages of plain torch modules, with derived outputs between them, against one process.

Each stage sends three tensors and a None on: a hidden state, an output computed
from it (the shape that gave wrong LayerNorm gradients under the split backward
before issue 15) and an int mask. Ready BFW and ready ZB-H1 split the backward (ready BFW
also with the split-aware functions, the default schedule.weight_split = auto); fixed 1F1B does
not. Every gradient of the first step, and every parameter after three AdamW steps, must
equal a single-process run of the same model and data.
"""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks
from torch import nn

pytestmark = pytest.mark.multirank

D, T, BATCH, M, STEPS = 8, 5, 2, 4, 3
# (dispatch, hint, weight_split): the last splits with the split-aware functions (auto, the default,
# resolves to them on a pipeline-only run)
CONFIGS = [
    ("ready", "bfw", "autograd"),
    ("ready", "zbh1", "autograd"),
    ("fixed", "1f1b", "autograd"),
    ("ready", "bfw", "auto"),
]


class ConvStage(nn.Module):
    """Conv1d, then h2 = LayerNorm(relu(Linear)) and side = Linear2(h2): side derives from h2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin, self.norm, self.side = (
            nn.Conv1d(D, D, 3, padding=1),
            nn.Linear(D, D),
            nn.LayerNorm(D),
            nn.Linear(D, D),
        )

    def forward(self, x):
        h2 = self.norm(torch.relu(self.lin(self.conv(x.transpose(1, 2)).transpose(1, 2))))
        return h2, self.side(h2), (x[..., 0] > 0).long(), None


class EncoderStage(nn.Module):
    """A TransformerEncoderLayer; sends h and a slice of it, h[..., :3] (padded back to D)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(
            D, 2, dim_feedforward=16, dropout=0.0, batch_first=True
        )

    def forward(self, inputs):
        h, side, mask, nothing = inputs
        assert nothing is None and mask.dtype == torch.int64
        h = self.enc(h + side)
        return h, nn.functional.pad(h[..., :3], (0, D - 3)), mask, None


class RecurrentStage(nn.Module):
    """A GRU (hidden weights used at every step), and a LayerNorm of its output sent beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.norm = nn.GRU(D, D, batch_first=True), nn.LayerNorm(D)

    def forward(self, inputs):
        h, part, mask, _ = inputs
        g = self.gru(h + part * mask.unsqueeze(-1))[0]
        return g, self.norm(g), mask, None


class AttentionStage(nn.Module):
    """Cross-attention from g to its normalised copy, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(D, 2, batch_first=True), nn.Linear(D, 2)

    def forward(self, inputs):
        g, n, _, _ = inputs
        return self.head(self.attn(g, n, n, need_weights=False)[0])


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(ConvStage(), EncoderStage(), RecurrentStage(), AttentionStage()).double()


def run_reference(full: nn.Sequential, stages: list[nn.Module], data, opt) -> None:
    """One step in one process: the stages applied in turn, the loss averaged over microbatches."""
    loss = 0
    for x, y in data:
        h = x
        for s in stages:
            h = s(h)
        loss = loss + nn.functional.mse_loss(h, y)
    (loss / len(data)).backward()


def batches(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [
        (
            torch.randn(BATCH, T, D, generator=g, dtype=torch.float64),
            torch.randn(BATCH, T, 2, generator=g, dtype=torch.float64),
        )
        for _ in range(M)
    ]


def _ranks(rank, world):
    import asyncio

    from rrfp.pipeline.runtime import PipelineRuntime
    from rrfp.pipeline.schedule_settings import ScheduleSettings

    torch.set_default_dtype(torch.float64)
    full = build()
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    first_grads = None
    for step in range(STEPS):
        opt.zero_grad()
        run_reference(full, list(full), batches(step), opt)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in full[rank].named_parameters()}
        opt.step()
    final = {n: p.detach().clone() for n, p in full[rank].named_parameters()}

    async def main():
        out = {}
        async with PipelineRuntime.start(pp=world, timeout_s=60) as rt:
            for dispatch, hint, weight_split in CONFIGS:
                chunk = build()[rank]
                opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
                settings = ScheduleSettings.of(
                    M, dispatch=dispatch, hint=hint, weight_split=weight_split
                )
                ex = rt.stage_executor(chunk, nn.functional.mse_loss, settings=settings)
                assert ex.workers[0].weight_split == (
                    "functions" if weight_split == "auto" else weight_split
                )
                grad_err = None
                for step in range(STEPS):
                    opt.zero_grad()
                    res = await ex.run_iteration(step, batches(step))
                    if step == 0:
                        grad_err = max(
                            (p.grad - first_grads[n]).abs().max().item()
                            for n, p in chunk.named_parameters()
                        )
                        splits = sum(t.kind.name == "W" for t in res.order)
                    opt.step()
                param_err = max(
                    (p.detach() - final[n]).abs().max().item() for n, p in chunk.named_parameters()
                )
                out[(dispatch, hint, weight_split)] = (
                    grad_err,
                    param_err,
                    splits,
                    ex.workers[0].split_summary(),
                )
        return out

    return asyncio.run(main())


@pytest.mark.timeout(240)
def test_four_plain_stages_with_derived_outputs_match_one_process():
    results = run_ranks(_ranks, 4, timeout=200)
    for rank, out in sorted(results.items()):
        for (dispatch, hint, split), (grad_err, param_err, splits, summary) in out.items():
            print(
                f"stage {rank} {dispatch} {hint} ({split}): max |grad diff| {grad_err:.2e}, "
                "max |param diff| "
                f"after {STEPS} AdamW steps {param_err:.2e}, in B: {summary.in_b or '-'}"
            )
            assert grad_err < 1e-10, (rank, dispatch, hint, grad_err)
            assert param_err < 1e-10, (rank, dispatch, hint, param_err)
            assert splits == (M if hint in ("bfw", "zbh1") else 0), (rank, hint, splits)
