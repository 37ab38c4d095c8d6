"""torch's multi-stage schedule CSVs as ScheduleReady's hint (rrfp/pipelining/torch_csv.py): the
CSV torch's own ``_dump_csv`` writes for ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and
ScheduleZBVZeroBubble reads as the order torch wrote for every rank, ``load_csv`` takes it on real
gloo ranks, where fixed dispatch then runs exactly that order and the gradients and losses are a
single-process run's; what rrfp cannot take is refused in one line naming the cell or the row.
(One stage per rank: tests/pipelining/test_pipelining.py.)"""

from __future__ import annotations

import copy
import csv
import re

import pytest
import torch
from harness.distributed import run_ranks
from harness.pipelining_model import BATCH, M, batch, full_model, loss_fn, max_diff
from harness.pipelining_virtual import TOL, V, held_stages, loss_diff, reference

from rrfp.core.hints import HintError
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind, Task
from rrfp.pipelining import read_torch_csv

# torch's multi-stage schedules that dump a compute_only CSV, by placement
SCHEDULES = {
    "ScheduleInterleaved1F1B": "interleaved",
    "ScheduleInterleavedZeroBubble": "interleaved",
    "ScheduleZBVZeroBubble": "v",
}
KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.B, "W": Kind.W}


def _as_rrfp(cell: str) -> tuple[int, Task]:
    """A torch action cell as the (stage, task) rrfp runs for it: I is B of a split backward."""
    stage, kind, mb = re.fullmatch(r"(\d+)([FBIW])(\d+)", cell).groups()
    return int(stage), Task(KINDS[kind], int(mb))


def _torch_schedule(name: str, world: int, m: int):
    """torch's ``name`` for rank 0 of ``world`` ranks of a fake process group (one process, no
    communication: a schedule plans every rank's order when it is built)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    S = world * V
    stages = [
        PipelineStage(torch.nn.Linear(2, 2), s, S, torch.device("cpu"))
        for s in held_stages(0, world, SCHEDULES[name])
    ]
    return getattr(schedules, name)(stages, m, loss_fn=loss_fn)


@pytest.fixture
def torch_csv(tmp_path):
    """``make(name, world, m)``: the path of the CSV torch's ``name`` dumps (compute_only), and
    torch's own order, one list of action strings per rank."""
    import torch.distributed as dist

    def make(name: str, world: int = 4, m: int = 8, format: str = "compute_only"):
        schedule = _torch_schedule(name, world, m)
        path = tmp_path / f"{name}-{format}.csv"
        schedule._dump_csv(str(path), format=format)
        order = [
            [str(a) for a in schedule.pipeline_order[r] if a is not None] for r in range(world)
        ]
        dist.destroy_process_group()
        return path, order

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_torch_multi_stage_csv_reads_as_the_order_torch_wrote(torch_csv, name):
    world, m = 4, 8
    path, order = torch_csv(name, world, m)
    hint, split = read_torch_csv(path)
    assert split is (name != "ScheduleInterleaved1F1B")  # I and W: a split backward
    layout = VirtualLayout(world, V, SCHEDULES[name])
    for rank in range(world):
        assert hint.rank_order(layout, rank, m, split) == [_as_rrfp(a) for a in order[rank]]
    # the other placement holds other stages on the same rank: refused, naming the row
    other = VirtualLayout(world, V, "v" if SCHEDULES[name] == "interleaved" else "interleaved")
    with pytest.raises(HintError, match=r"row 1: actions for stages 1, \d, but rank 1 holds"):
        hint.rank_order(other, 1, m, split)
    with pytest.raises(HintError, match=f"written for {m} microbatches, the schedule has 4"):
        hint.rank_order(layout, 0, 4, split)
    with pytest.raises(HintError, match="4 rows \\(one per rank\\), the pipeline has 2 ranks"):
        hint.rank_order(VirtualLayout(2, 4), 0, m, split)
    with pytest.raises(HintError, match="it has actions for stages 0, 1, .*, 7, the pipeline has"):
        hint.rank_order(VirtualLayout(world, 1), 0, m, split)  # one stage per rank: 4 stages


def test_what_cannot_be_taken_is_refused_in_one_line(torch_csv, tmp_path):
    path, _ = torch_csv("ScheduleInterleaved1F1B", format="compute_comms")  # _dump_csv's default
    with pytest.raises(HintError) as comms:
        read_torch_csv(path)
    assert re.search(
        r"row 0: '0UNSHARD' is an action rrfp runs itself \(communication or FSDP: "
        r"torch's compute_comms format; dump with _dump_csv\(path, format='compute_only'\)\)",
        str(comms.value),
    ), comms.value
    cases = {
        "0F0,(0F1;1B0)OVERLAP_F_B\n": "'(0F1;1B0)OVERLAP_F_B' is an overlapped forward and "
        "backward (DualPipeV's OVERLAP_F_B), which rrfp does not take",
        "0F0,0X0\n": "'0X0' is an unknown action type 'X'",
        "0F0,0B\n": "'0B' is an action without a microbatch index",
    }
    for text, error in cases.items():
        (tmp_path / "bad.csv").write_text(text)
        with pytest.raises(HintError) as refused:
            read_torch_csv(tmp_path / "bad.csv")
        assert error in str(refused.value) and "\n" not in str(refused.value), refused.value


def _csv_step(rank, world, name, csv_dir):
    """torch's ``name`` on this rank's stages dumps its CSV; ScheduleReady on copies of the same
    stages loads it and runs one step under fixed dispatch."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    placement, S = SCHEDULES[name], world * V
    mine = held_stages(rank, world, placement)
    first, last = 0 in mine, S - 1 in mine
    model = full_model(S)
    x, y = batch(1, 5, rows=BATCH * M)
    path = f"{csv_dir}/{name}-{rank}.csv"
    try:
        planned = [PipelineStage(copy.deepcopy(model[s]), s, S, torch.device("cpu")) for s in mine]
        getattr(schedules, name)(planned, M, loss_fn=loss_fn)._dump_csv(path, format="compute_only")
        with open(path, newline="") as f:
            row = [c for c in list(csv.reader(f))[rank] if c]
        local = [copy.deepcopy(model[s]) for s in mine]
        stages = [PipelineStage(c, s, S, torch.device("cpu")) for s, c in zip(mine, local)]
        losses: list = []
        with ScheduleReady(stages, M, loss_fn=loss_fn, dispatch="fixed") as schedule:
            schedule.load_csv(path)
            schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
            ran = schedule.last_result.ran
    finally:
        dist.destroy_process_group()
    grads = {(s, n): p.grad for s, c in zip(mine, local) for n, p in c.named_parameters()}
    ref_losses, ref_grads, _ = reference(S, mine, x, y)
    return dict(
        ran=ran,
        torch_row=[_as_rrfp(c) for c in row],
        grad=max_diff(ref_grads, grads),
        loss=loss_diff(ref_losses, [loss.item() for loss in losses]) if last else None,
    )


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_ready_runs_the_csv_torch_dumped(name, tmp_path):
    world = 2
    results = run_ranks(_csv_step, world, name, str(tmp_path), timeout=120)
    for rank, res in results.items():
        assert res["ran"] == res["torch_row"], (rank, res["ran"], res["torch_row"])
        assert res["grad"] < TOL, (rank, res)
    holder = 0 if SCHEDULES[name] == "v" else world - 1  # the rank of the last stage
    assert results[holder]["loss"] < TOL, results[holder]
