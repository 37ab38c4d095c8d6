"""Parameters shared between stages (``tied=``), on real gloo ranks in float64: a GPT whose token
embedding and lm head are one parameter trains, over several AdamW steps, exactly as one process
with the truly tied model, whichever ranks hold the two copies; the global norm counts a tie once; a
tie that differs in shape is refused on every rank, and a forgotten one is hinted at."""

from __future__ import annotations

import functools
import math

import pytest
from harness.distributed import START_S, run_ranks
from harness.whole_model import float64

M, STEPS = 2, 3


def _gpt_ties(stage, num_stages):
    from rrfp.models.gpt import GPTConfig, tied

    return tied(GPTConfig(tie_embeddings=True), stage, num_stages)


def _model_and_data(n_layer: int):
    from rrfp.models.data import DataConfig
    from rrfp.models.gpt import GPTConfig

    cfg = GPTConfig(
        n_layer=n_layer,
        n_embd=16,
        n_head=2,
        block_size=32,
        vocab_size=256,
        tie_embeddings=True,
    )
    return cfg, DataConfig(seed=7, microbatch_size=2, min_seq_len=4, max_seq_len=12)


@functools.cache
def _reference(n_layer: int, dp: int, clip: float) -> tuple[list, list, dict]:
    """One process training the truly tied model, in float64, once in the test process: each
    step's loss and clipped norm, the final state (numpy arrays: they travel to the ranks by
    value; lm_head.weight and transformer.wte.weight the one tensor)."""
    import torch

    from rrfp.models.data import batches
    from rrfp.models.gpt import GPT, loss_fn

    with float64():
        cfg, data_cfg = _model_and_data(n_layer)
        torch.manual_seed(0)
        ref = GPT(cfg)
        assert ref.lm_head.weight is ref.transformer.wte.weight
        opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
        losses, norms = [], []
        for step in range(STEPS):
            data = batches(data_cfg, step, M * dp)
            loss = sum(loss_fn(ref(x), y) for x, y in data) / len(data)
            loss.backward()
            if clip:
                norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, norms, {n: t.numpy() for n, t in ref.state_dict().items()}


def _tied(rank, world, pp, dp, virtual, placement, clip, ref, declare="ties"):
    """``ref``: ``_reference``'s for the model (pp x virtual layers), dp and clip."""
    import logging

    import torch

    from rrfp.loop import run
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, loss_fn, make_stage
    from rrfp.pipeline.runtime import PipelineRuntime

    torch.set_default_dtype(torch.float64)
    cfg, data_cfg = _model_and_data(pp * virtual)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("rrfp.pipeline.ties").addHandler(handler)
    ref_losses, ref_norms = ref[0], ref[1]
    want = {n: torch.from_numpy(t) for n, t in ref[2].items()}

    async def main():
        rt = PipelineRuntime.start(pp=pp, dp=dp, timeout_s=60, virtual=virtual, placement=placement)
        try:
            torch.manual_seed(0)
            full = GPT(cfg)
            modules = [make_stage(full, s, rt.num_stages) for s in rt.stages]
            for m in (
                modules
            ):  # the last stage starts from other values: the setup makes the copies equal
                for n, p in m.named_parameters():
                    if n == "lm_head.weight" and declare == "ties":
                        p.data.normal_()
            tied = {
                "ties": [_gpt_ties(s, rt.num_stages) for s in rt.stages],
                "none": None,
                "shapes": [
                    {"e": "transformer.wte.weight"}
                    if s == 0
                    else {"e": "transformer.ln_f.weight"}
                    if s == rt.num_stages - 1
                    else {}
                    for s in rt.stages
                ],
            }[declare]
            ex = rt.stage_executor(modules, loss_fn, n_microbatches=M, tied=tied)
            sync = rt.grad_sync(torch.nn.ModuleList(modules), ex)
            params = list({id(p): p for m in modules for p in m.parameters()}.values())
            opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
            losses, norms = [], []
            for step in range(STEPS):
                mine = make_batches(data_cfg, step, M * dp)[rt.dp_rank * M : (rt.dp_rank + 1) * M]
                res = await ex.run_iteration(step, mine)
                await sync.sync()
                if clip:
                    norms.append(await rt.clip_grad_norm_(clip))
                opt.step()
                opt.zero_grad()
                losses.append(res.loss)
            err = max(
                (p - want[n]).abs().max().item() for m in modules for n, p in m.named_parameters()
            )
            # a DP replica's loss is over its own microbatches: with dp > 1 the parameters carry the
            # check
            return {
                "losses": losses if dp == 1 else [None] * STEPS,
                "norms": norms,
                "err": err,
                "warnings": warnings,
            }
        finally:
            await rt.aclose()

    try:
        out = run(main())
    except ValueError as e:
        return {"error": str(e)}
    out.update(ref_losses=ref_losses, ref_norms=ref_norms)
    return out


def _check(results):
    for rank, r in results.items():
        assert r["err"] < 1e-10, f"rank {rank}: parameters differ from the tied model by {r['err']}"
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert got is None or abs(got - want) < 1e-10, (rank, r["losses"], r["ref_losses"])
        assert len(r["norms"]) == len(r["ref_norms"])
        assert all(math.isclose(a, b, rel_tol=1e-10) for a, b in zip(r["norms"], r["ref_norms"])), (
            rank,
            r,
        )
        assert not r["warnings"], r["warnings"]  # a declared tie is no forgotten one


@pytest.mark.multirank
def test_tied_embedding_pp4_interleaved_v2_first_and_last_on_ranks_0_and_3():
    _check(run_ranks(_tied, 4, 4, 1, 2, "interleaved", 0.0, _reference(4 * 2, 1, 0.0), timeout=180))


@pytest.mark.multirank
def test_tied_embedding_pp2_clipping_counts_the_tie_once():
    results = run_ranks(
        _tied, 2, 2, 1, 1, "interleaved", 0.05, _reference(2 * 1, 1, 0.05), timeout=120
    )
    _check(results)
    assert all(n > 0.05 for n in results[0]["ref_norms"]), "the test must clip"


@pytest.mark.multirank
def test_tied_embedding_v_placement_two_parameters_on_one_rank():
    _check(run_ranks(_tied, 2, 2, 1, 2, "v", 0.0, _reference(2 * 2, 1, 0.0), timeout=120))


@pytest.mark.multirank
def test_tied_embedding_pp2_dp2_sums_after_the_dp_average():
    _check(run_ranks(_tied, 4, 2, 2, 1, "interleaved", 0.0, _reference(2 * 1, 2, 0.0), timeout=180))


@pytest.mark.multirank
def test_tied_pair_of_different_shapes_is_refused_on_every_rank():
    results = run_ranks(
        _tied, 2, 2, 1, 1, "interleaved", 0.0, _reference(2 * 1, 1, 0.0), "shapes", timeout=120
    )
    for rank, r in results.items():
        assert "tie 'e'" in r.get("error", "") and "differ in shape" in r["error"], (rank, r)


@pytest.mark.multirank
def test_forgotten_tie_is_one_warning_naming_both():
    results = run_ranks(
        _tied, 2, 2, 1, 1, "interleaved", 0.0, _reference(2 * 1, 1, 0.0), "none", timeout=120
    )
    assert results[1]["warnings"] == []
    (line,) = results[0]["warnings"]
    assert "transformer.wte.weight" in line and "lm_head.weight" in line, line


def _schedule_tied(rank, world):
    import copy
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    vocab, dim, clip = 11, 8, 0.05

    class Chunk(nn.Module):
        def __init__(self, first, last):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim) if first else None
            self.body = nn.Linear(dim, dim)
            self.head = nn.Linear(dim, vocab, bias=False) if last else None

        def forward(self, h):
            h = torch.tanh(self.body(self.embed(h) if self.embed is not None else h))
            return self.head(h) if self.head is not None else h

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    torch.manual_seed(0)
    model = nn.Sequential(Chunk(True, False), Chunk(False, True))
    chunk = copy.deepcopy(model[rank])  # this stage's own copy of the shared weight
    model[1].head.weight = model[0].embed.weight  # the truly tied reference
    g = torch.Generator().manual_seed(3)
    data = [
        (
            torch.randint(0, vocab, (2 * M, 5), generator=g),
            torch.randint(0, vocab, (2 * M, 5), generator=g),
        )
        for _ in range(STEPS)
    ]
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_norms = []
    for x, y in data:
        (sum(loss_fn(model(a), b) for a, b in zip(x.chunk(M), y.chunk(M))) / M).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        ref_opt.step()
        ref_opt.zero_grad()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        stage = PipelineStage(chunk, rank, world, torch.device("cpu"))
        tied = {"shared": "embed.weight"} if rank == 0 else {"shared": "head.weight"}
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
        norms = []
        with ScheduleReady(stage, M, loss_fn=loss_fn, tied=tied) as schedule:
            for x, y in data:
                schedule.step(x) if rank == 0 else schedule.step(target=y)
                norms.append(schedule.clip_grad_norm_(clip))
                opt.step()
                opt.zero_grad()
        want = model[rank].state_dict()
        err = max((p - want[n]).abs().max().item() for n, p in chunk.named_parameters())
    finally:
        dist.destroy_process_group()
    return {"err": err, "norms": norms, "ref_norms": ref_norms}


@pytest.mark.multirank
def test_schedule_ready_tied_and_clip_grad_norm():
    for rank, r in run_ranks(_schedule_tied, 2, timeout=120).items():
        assert r["err"] < 1e-10, (rank, r)
        assert all(n > 0.05 for n in r["ref_norms"]), "the test must clip"
        assert all(math.isclose(a, b, rel_tol=1e-10) for a, b in zip(r["norms"], r["ref_norms"])), (
            rank,
            r,
        )


def test_declarations_are_looked_up_in_the_rank_s_modules():
    import torch
    from torch import nn

    from rrfp.pipeline.ties import _declared

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight  # one Parameter object in two modules: one copy, nothing to sum
    assert [s for s, _ in _declared([a, b], [0, 3], {"t": "weight"})["t"]] == [0]
    head = nn.Module()
    head.proj = nn.Linear(2, 2)
    found = _declared([a, head], [0, 3], [{"t": "weight"}, {"t": "proj.weight"}])["t"]
    assert [s for s, _ in found] == [0, 3] and found[1][1] is head.proj.weight
    assert list(_declared([a, head], [0, 3], {"t": "proj.weight"})) == ["t"]  # found in one of them
    with pytest.raises(ValueError, match=r"tie 't': no parameter 'nope' in stage\(s\) \[0, 3\]"):
        _declared([a, head], [0, 3], {"t": "nope"})
    with pytest.raises(ValueError, match="tie 't': stage 1 has no parameter 'proj.weight'"):
        _declared([a], [1], {"t": "proj.weight"})
    with pytest.raises(ValueError, match="one dict per stage module, got 1"):
        _declared([a, head], [0, 3], [{"t": "weight"}])
    with pytest.raises(TypeError, match="tie names and parameter names are strings"):
        _declared([a], [0], {"t": 3})
    with pytest.raises(ValueError, match="differ in shape"):
        _declared([a, nn.Linear(3, 3)], [0, 3], {"t": "weight"})
    assert torch.equal(a.weight, b.weight)


def _one_rank_never_sets_up(rank, world, bound_s, mark):
    """Rank 0 builds a tied stage executor; rank 1 stays in the runtime, beating, and never does
    (until rank 0 has its answer)."""
    import asyncio
    import dataclasses
    import time
    from pathlib import Path

    import torch

    import rrfp
    from rrfp.pipeline.timeouts import Timeouts

    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    began = time.monotonic()

    async def main():
        nonlocal began
        # the groups' creation (gloo's connect, bounded by process_group_s too) gets the start-up's
        # bound, so that a loaded machine's slow connect does not end the row before its point;
        # the exchange then reads the bound under test
        waits = Timeouts.derive(2.0, process_group_s=START_S, store_connect_s=START_S)
        async with rrfp.PipelineRuntime.start(pp=world, timeout_s=2.0, timeouts=waits) as rt:
            rt.timeouts = dataclasses.replace(rt.timeouts, process_group_s=bound_s)
            if rank == 1:
                while not Path(mark).exists() and time.monotonic() - began < bound_s + 30:
                    await asyncio.sleep(0.1)
                return
            began = time.monotonic()
            rt.stage_executor(
                module, lambda y, t: ((y - t) ** 2).mean(), n_microbatches=2, tied={"w": "weight"}
            )

    try:
        rrfp.run(main())
    except Exception as e:  # rank 0's outcome: its line, and when; rank 1's end is not the point
        Path(mark).write_text("done")
        return {"error": f"{type(e).__name__}: {e}", "took": time.monotonic() - began}
    Path(mark).write_text("done")
    return {"error": None}


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_rank_that_never_sets_up_its_ties_is_named_after_process_group_s(tmp_path):
    """The tie setup's exchange blocks the loop thread, where the heartbeat's watcher cannot bound
    it, and the world group's own timeout is the one-day backstop: it sets its own bound."""
    bound_s = 4.0
    results = run_ranks(_one_rank_never_sets_up, 2, bound_s, str(tmp_path / "done"), timeout=70)
    error, took = results[0]["error"], results[0].get("took")
    assert error is not None and "tie setup" in error and "process_group_s" in error, error
    # rank 1's own outcome beside rank 0's: an exchange cut short means rank 1 left early, and why
    assert bound_s - 0.5 <= took <= bound_s + 6, (took, error, results[1])
    print(f"rank 0: {error} (after {took:.1f} s)")
