"""The embedding API as a newcomer meets it: docs/embedding.md's snippet runs as written on 2
ranks as torchrun runs a script (tests/harness/train_rows.py); an error raised by the user's own
module reaches the driver as that exception, with where it happened noted on it; a cost model
without the batches' features is a clear error, and with them it sets the task durations.
Real gloo ranks (tests/harness/distributed.py), each test with a timeout."""

from __future__ import annotations

import re

import pytest
from harness import ROOT
from harness.distributed import run_ranks
from harness.train_rows import TrainJob

M = 2
UNIT_MS = 10.0


def readme_snippet() -> str:
    """The python block of docs/embedding.md's "Embedding a pipeline iteration" section."""
    text = (ROOT / "docs/embedding.md").read_text()
    section = text.split("## Embedding a pipeline iteration", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block in docs/embedding.md's embedding section"
    return block.group(1)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_readme_embedding_snippet_runs_as_written(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    job = TrainJob(tmp_path / "job", [], script=script).finish(140)  # as torchrun runs it
    assert job.codes() == [0, 0], job.tails()
    out = job.out(0) + job.out(1)
    losses = [float(x) for x in re.findall(r"stage 1: step \d+: loss (\d+\.\d+)", out)]
    assert len(losses) == 10 and losses[-1] < losses[0], out  # the last stage reports, and learns
    assert re.search(r"stage 0: step 9: loss None", out), out  # the others hold no loss


def _embedding_rank(rank, world):
    import torch
    from torch import nn

    import rrfp
    from rrfp.core.durations import TaskTimes
    from rrfp.core.tasks import Kind

    class Picky(nn.Linear):
        """Raises a TypeError in its second forward, as a model with a bug would."""

        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise TypeError("Picky.forward got a batch it cannot take")
            return super().forward(x)

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)) for _ in range(M)]
    feats = [rrfp.token_features(b) for b in batches]
    # every task costs 30 ms (3 units of 10 ms) on every stage, whatever the microbatch holds
    cost = rrfp.CostModel((((0.03, 0, 0, 0), (0.03, 0, 0, 0), (0.0, 0, 0, 0)),) * world, 0.01)
    out = {}

    async def main():
        async with rrfp.PipelineRuntime.start(pp=world, timeout_s=30, unit_ms=UNIT_MS) as rt:
            torch.manual_seed(0)
            module = nn.Linear(4, 4)
            ex = rt.stage_executor(
                module, loss_fn, n_microbatches=M, dispatch="fixed", hint="1f1b", cost=cost
            )
            for what, call in (
                ("run", lambda: ex.run_iteration(0, batches)),
                ("short", lambda: ex.run_iteration(0, batches, feats[:1])),
                ("keys", lambda: ex.run_iteration(0, batches, [{"tokens": 1.0}] * M)),
            ):
                try:
                    await call()
                    out[what] = None
                except ValueError as e:
                    out[what] = str(e)
            try:
                ex.prepare(1)
                out["prepare"] = None
            except ValueError as e:
                out["prepare"] = str(e)
            res = await ex.run_iteration(0, batches, feats)
            out["busy_with_cost"] = res.stats.busy
            plain = TaskTimes(rrfp.Variability(), 0, split=False)
            out["busy_without_cost"] = (
                sum(plain.units(0, rt.stage, mb, k) for mb in range(M) for k in (Kind.F, Kind.B))
                * UNIT_MS
                / 1000
            )
            module.zero_grad()

            picky = Picky(4, 4) if rt.stage == 1 else nn.Linear(4, 4)
            ex = rt.stage_executor(picky, loss_fn, n_microbatches=M, dispatch="fixed", hint="1f1b")
            await ex.run_iteration(5, batches)

    try:
        rrfp.run(main())
        out["raised"] = None
    except TypeError as e:  # a plain except, as a driver would write it
        out["raised"] = ("TypeError", str(e), list(getattr(e, "__notes__", [])))
    except Exception as e:  # noqa: BLE001 - what the other rank gets
        out["raised"] = (
            type(e).__name__,
            str(e),
            isinstance(e, rrfp.PeerFailure),
            isinstance(e, BaseExceptionGroup),
        )
    return out


@pytest.fixture(scope="module")
def embedded():
    return run_ranks(_embedding_rank, 2, timeout=90)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_models_own_error_reaches_the_driver_as_itself(embedded):
    kind, text, notes = embedded[1]["raised"]
    assert (kind, text) == ("TypeError", "Picky.forward got a batch it cannot take"), embedded[1][
        "raised"
    ]
    assert (
        "rrfp: raised in task F1 (microbatch 1) of iteration 5, on stage 1 of 2 (rank 1)" in notes
    ), notes
    kind, text, peer, group = embedded[0][
        "raised"
    ]  # its neighbour: the peer that left, not a group
    assert peer and not group and "rank 1" in text, embedded[0]["raised"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_cost_model_without_features_is_an_error(embedded):
    for rank in (0, 1):
        got = embedded[rank]
        for what in ("run", "prepare"):
            assert got[what] == (
                f"stage {rank}: the executor has a cost model (cost=) but got no features: pass "
                "features=[workload.features(b) for b in batches], one dict per microbatch "
                "(tokens, attn, patches)"
            ), got[what]
        assert (
            got["short"] == f"stage {rank}: got features for 1 microbatches, configured for {M}"
        ), got["short"]
        assert got["keys"] == (
            f"stage {rank}: the features of microbatch 0 lack attn, patches (the cost model "
            "needs tokens, attn, patches)"
        ), got["keys"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_cost_model_with_features_sets_the_durations(embedded):
    for rank in (0, 1):
        got = embedded[rank]
        with_cost = 2 * M * 3 * UNIT_MS / 1000  # F and B of each microbatch, 3 units each
        assert got["busy_without_cost"] < 0.8 * with_cost, (
            "the preset alone must not reach the cost's time"
        )
        assert got["busy_with_cost"] >= 0.98 * with_cost, got
