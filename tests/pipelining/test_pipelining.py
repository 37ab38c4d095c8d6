"""ScheduleReady (rrfp/pipelining) against torch's own Schedule1F1B on real gloo ranks: the same
PipelineStage-wrapped chunks, model and data give the same losses, gradients and outputs, and
both match a single-process reference; microbatches of different lengths run through
ScheduleReady, where torch's schedule refuses them."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import ROOT
from harness.distributed import run_ranks
from harness.pipelining_model import (
    BATCH,
    VOCAB,
    M,
    batch,
    full_model,
    grads_of,
    loss_fn,
    max_diff,
)
from torch import nn


def reference_grads(model, chunk_index: int, mbs) -> tuple[list[float], dict]:
    """Single process: the mean of the microbatch losses, backpropagated; this chunk's gradients."""
    model.zero_grad()
    losses = [loss_fn(model(x), y) for x, y in mbs]
    (sum(losses) / len(losses)).backward()
    return [loss.item() for loss in losses], {
        n: p.grad.clone() for n, p in model[chunk_index].named_parameters()
    }


def _parity(rank, world):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    first, last = rank == 0, rank == world - 1
    model = full_model(world)
    x, y = batch(1, 5)
    x2, y2 = batch(2, 5)
    chunks = {"torch": copy.deepcopy(model[rank]), "rrfp": copy.deepcopy(model[rank])}
    out = {}
    try:
        for name, cls in (("torch", Schedule1F1B), ("rrfp", ScheduleReady)):
            stage = PipelineStage(chunks[name], rank, world, torch.device("cpu"))
            schedule = cls(stage, M, loss_fn=loss_fn)
            args = (x,) if first else ()
            kwargs = {"scale": 0.5} if first else {}
            losses, eval_losses = [], []
            merged = schedule.step(*args, target=y if last else None, losses=losses, **kwargs)
            after_one = grads_of(chunks[name])
            # a second step without zero_grad: torch divides the whole accumulated .grad by M
            schedule.step(*((x2,) if first else ()), target=y2 if last else None, **kwargs)
            after_two = grads_of(
                chunks[name]
            )  # before eval: torch's eval divides .grad by M once more
            evaluated = schedule.eval(
                *args, target=y if last else None, losses=eval_losses, **kwargs
            )
            out[name] = dict(
                losses=[loss.item() for loss in losses],
                grads1=after_one,
                grads2=after_two,
                merged=merged,
                eval_losses=[loss.item() for loss in eval_losses],
                evaluated=evaluated,
            )
            if name == "rrfp":
                out["bubble"] = schedule.last_result.stats.bubble
                schedule.close()
    finally:
        dist.destroy_process_group()
    scaled = copy.deepcopy(model)
    scaled[0].embed.weight.data.mul_(0.5)  # the scale kwarg, folded into a plain reference
    ref_losses, ref = reference_grads(
        scaled,
        rank,
        [(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]) for i in range(M)],
    )
    t, r = out["torch"], out["rrfp"]
    result = dict(
        grad1=max_diff(t["grads1"], r["grads1"]),
        grad2=max_diff(t["grads2"], r["grads2"]),
        names=sorted(r["grads1"]),
        bubble=out["bubble"],
    )
    if (
        rank == 0
    ):  # the reference's embedding gradient is for the scaled weight: chain rule by the scale
        ref = {k: v * (0.5 if k == "embed.weight" else 1.0) for k, v in ref.items()}
    result["ref"] = max_diff(ref, r["grads1"])
    if last:
        result.update(
            n_losses=len(r["losses"]),
            loss=max(abs(a - b) for a, b in zip(t["losses"], r["losses"])),
            ref_loss=max(abs(a - b) for a, b in zip(ref_losses, r["losses"])),
            eval_loss=max(abs(a - b) for a, b in zip(t["eval_losses"], r["eval_losses"])),
            merged=(t["merged"] - r["merged"]).abs().max().item(),
            shape=tuple(r["merged"].shape),
            evaluated=(t["evaluated"] - r["evaluated"]).abs().max().item(),
        )
    else:
        result.update(merged=r["merged"], losses=r["losses"])
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_losses_gradients_and_outputs_equal_torch_1f1b(world):
    results = run_ranks(_parity, world, timeout=120)
    for rank, res in results.items():
        assert res["grad1"] < 1e-12 and res["grad2"] < 1e-12, (rank, res)
        assert res["ref"] < 1e-12, (rank, res)  # and both equal the single-process reference
        assert res["names"], rank
    last = results[world - 1]
    assert last["n_losses"] == M
    assert last["loss"] < 1e-12 and last["ref_loss"] < 1e-12 and last["eval_loss"] < 1e-12, last
    assert (
        last["merged"] < 1e-12
        and last["evaluated"] < 1e-12
        and last["shape"] == (BATCH * M, 5, VOCAB)
    ), last
    for rank in range(world - 1):  # only the last stage returns an output and losses, as torch's
        assert results[rank]["merged"] is None and results[rank]["losses"] == []
    assert all(0.0 <= res["bubble"] < 1.0 for res in results.values())


def _variable_length_data(world):
    model = full_model(world)
    return model, [batch(10 + i, length, rows=BATCH) for i, length in enumerate((3, 7, 5, 9))]


def _variable_lengths(rank, world, csv_path):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    first, last = rank == 0, rank == world - 1
    model, mbs = _variable_length_data(world)
    chunk = copy.deepcopy(model[rank])
    try:
        with ScheduleReady(
            PipelineStage(chunk, rank, world, torch.device("cpu")), M, loss_fn=loss_fn
        ) as schedule:
            losses = []
            merged = schedule.step(
                arg_mbs=[(x,) for x, _ in mbs] if first else None,
                target_mbs=[y for _, y in mbs] if last else None,
                losses=losses,
            )
        # torch's schedule CSV as the hint, followed exactly under fixed dispatch
        stage = PipelineStage(copy.deepcopy(model[rank]), rank, world, torch.device("cpu"))
        with ScheduleReady(stage, M, loss_fn=loss_fn, dispatch="fixed") as schedule:
            schedule._load_csv(csv_path)
            schedule.step(
                arg_mbs=[(x,) for x, _ in mbs] if first else None,
                target_mbs=[y for _, y in mbs] if last else None,
            )
            csv_order = [str(t) for t in schedule.last_result.order]
    finally:
        dist.destroy_process_group()
    ref_losses, ref = reference_grads(model, rank, mbs)
    res = dict(ref=max_diff(ref, grads_of(chunk)), csv_order=csv_order)
    if last:
        res.update(
            loss=max(abs(a - b.item()) for a, b in zip(ref_losses, losses)),
            merged=[tuple(o.shape) for o in merged],
        )  # shapes: tensors would need the child alive
    return res


def _torch_variable_lengths(rank, world, err_dir):
    """The same microbatches through torch 2.13's Schedule1F1B (``_step_microbatches`` is its way to
    take them pre-split; 2.14's ``step(arg_mbs=)``): its receive buffers have the first one's
    shape. The rank's stderr goes to ``err_dir``/err{rank}: gloo's abort writes there, at the C
    level, what the test reads."""
    import datetime
    import os

    os.dup2(os.open(f"{err_dir}/err{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    model, mbs = _variable_length_data(world)
    stage = PipelineStage(model[rank], rank, world, torch.device("cpu"))
    Schedule1F1B(stage, M, loss_fn=loss_fn)._step_microbatches(
        [(x,) for x, _ in mbs] if rank == 0 else None,
        None,
        [y for _, y in mbs] if rank == world - 1 else None,
        [],
    )
    dist.destroy_process_group()
    return "ran"


@pytest.mark.multirank
def test_microbatches_of_different_lengths_run_where_torch_refuses_them(tmp_path):
    (tmp_path / "1f1b.csv").write_text(ONE_F_ONE_B_CSV)
    results = run_ranks(_variable_lengths, 2, str(tmp_path / "1f1b.csv"), timeout=60)
    for rank, res in results.items():
        assert res["ref"] < 1e-12, (rank, res)
        row = [c for c in ONE_F_ONE_B_CSV.splitlines()[rank].split(",") if c]
        assert res["csv_order"] == [c[1:] for c in row], (rank, res["csv_order"])
    last = results[1]
    assert last["loss"] < 1e-12
    # outputs of different lengths cannot be concatenated: the last stage gets one per microbatch
    assert last["merged"] == [(BATCH, n, VOCAB) for n in (3, 7, 5, 9)]
    # torch's receiver aborts the process (gloo: received size != expected), its peer then fails
    with pytest.raises(AssertionError, match="failed|did not finish"):
        run_ranks(_torch_variable_lengths, 2, str(tmp_path), timeout=40)
    errs = [(tmp_path / f"err{r}").read_text(errors="replace") for r in range(2)]
    assert any("Received data size doesn't match expected size" in e for e in errs), errs


# -- what is not supported says so; torch's schedule CSV read as a hint ---------------------------

ONE_F_ONE_B_CSV = (
    "0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"  # torch's compute_only
)


def test_non_stages_are_refused():
    """Several stages per rank are taken (test_pipelining_virtual.py); what is no stage is not."""
    from rrfp import ScheduleReady

    with pytest.raises(ValueError, match="at least one PipelineStage, got an empty list"):
        ScheduleReady([], M)
    with pytest.raises(
        TypeError,
        match=r"takes a torch.distributed.pipelining PipelineStage \(or a list of them\), "
        r"got object",
    ):
        ScheduleReady([object(), object()], M)
    with pytest.raises(
        TypeError, match="takes a torch.distributed.pipelining PipelineStage.*got Linear"
    ):
        ScheduleReady(nn.Linear(2, 2), M)
    with pytest.raises(NotImplementedError, match="custom functions"):
        ScheduleReady.register_custom_function(None, "F", print)


def test_torch_csv_reads_as_the_stage_order(tmp_path):
    from torch.distributed.pipelining.schedules import _Action

    from rrfp.core.hints import validate
    from rrfp.core.tasks import Kind, Task
    from rrfp.pipelining import read_torch_csv

    path = tmp_path / "1f1b.csv"
    path.write_text(ONE_F_ONE_B_CSV)
    hint, split = read_torch_csv(path)
    assert not split
    for s, row in enumerate(ONE_F_ONE_B_CSV.splitlines()):
        order = hint.fn(2, s, M, False)
        validate(order, M, False)
        # each cell as torch itself parses it
        actions = [_Action.from_str(c) for c in row.split(",") if c]
        assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions] == [
            (s, t.kind.name, t.mb) for t in order
        ]
    assert hint.fn(2, 1, M, False)[:2] == [Task(Kind.F, 0), Task(Kind.B, 0)]
    path.write_text("0F0,0I0,0W0\n")
    hint, split = read_torch_csv(path)
    assert split and hint.fn(1, 0, 1, True) == [Task(Kind.F, 0), Task(Kind.B, 0), Task(Kind.W, 0)]


@pytest.mark.parametrize(
    "text, error",
    [
        ("0F0,0SEND_F0,1RECV_F0\n", "'0SEND_F0' is an action rrfp runs itself"),
        ("0F0,0UNSHARD\n", "'0UNSHARD' is an action rrfp runs itself"),
        ("0F0,bogus\n", "'bogus' is not an action"),
        ("0F0,0B0,0I1,0W1\n", "mixes full backwards"),
        ("\n", "no actions"),
    ],
)
def test_torch_csv_refuses_what_rrfp_cannot_follow(tmp_path, text, error):
    from rrfp.core.hints import HintError
    from rrfp.pipelining import read_torch_csv

    path = tmp_path / "s.csv"
    path.write_text(text)
    with pytest.raises(HintError, match=error):
        read_torch_csv(path)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_example_prints_equal_losses_on_two_ranks(tmp_path):
    """examples/torch_pipelining.py: one training loop, both schedules, the same losses. Its two
    ranks are children of the preloaded forkserver running the script as torchrun runs it
    (tests/harness/train_rows.py); torchrun's own agent is tests/app/job's."""
    import re

    from harness.train_rows import TrainJob

    job = TrainJob(tmp_path, [], script=ROOT / "examples" / "torch_pipelining.py").finish(170)
    assert job.codes() == [0, 0], job.tails()
    out = job.out(0) + job.out(1)
    rows = re.findall(r"^\s*\d+\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, re.M)
    assert len(rows) == 3 and all(a == b for a, b in rows), out
    assert "equal losses: True" in out
    varied = re.search(r"ScheduleReady only\): (.*)$", out, re.M)
    assert varied and len(varied.group(1).split(", ")) == 4, out
