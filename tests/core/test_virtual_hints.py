"""Hints over virtual stages: valid rank orders, torch's own schedules, V = 1 unchanged."""

import pytest

from rrfp.core.budget import Budget
from rrfp.core.hints import HintError, resolve, validate_rank
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import Kind, Task
from rrfp.core.virtual_orders import interleaved_1f1b, zbv

HINTS = ["gpipe", "1f1b", "zbh1", "bf", "bfw", "plan", "zbv"]


@pytest.mark.parametrize(
    "placement,hint",
    [(p, h) for p in ("interleaved", "v") for h in ("gpipe", "bf", "bfw", "plan")]
    + [("interleaved", "1f1b"), ("v", "zbv")],
)
@pytest.mark.parametrize("S,M", [(2, 3), (4, 8), (4, 6), (3, 12)])
def test_rank_orders_are_valid(placement, hint, S, M):
    lay = VirtualLayout(S, 2, placement)
    h = resolve(hint)
    for r in range(S):
        for split in (False, True):
            order = h.rank_order(lay, r, M, split)
            validate_rank(order, lay, r, M, split)  # raises if not
            spec = h.rank_spec(lay, r, M, split, Dispatch.READY, Budget.parse("2x"))
            assert set(spec.priority) == set(order) and sorted(spec.priority.values()) == list(
                range(len(order))
            )


def test_schedules_refuse_the_other_placement_and_zbh1_has_no_virtual_form():
    with pytest.raises(HintError, match="ZB-V needs the v placement"):
        resolve("zbv").rank_order(VirtualLayout(4, 2), 0, 8, True)
    with pytest.raises(HintError, match="interleaved 1F1B needs the interleaved placement"):
        resolve("1f1b").rank_order(VirtualLayout(4, 2, "v"), 0, 8, True)
    with pytest.raises(HintError, match="hint zbh1 has no order over virtual stages"):
        resolve("zbh1").rank_order(VirtualLayout(4, 2), 0, 8, True)
    with pytest.raises(HintError, match="needs virtual = 2 and placement v"):
        resolve("zbv").order(4, 0, 8, True)


@pytest.mark.parametrize("hint", HINTS[:-1])
def test_one_stage_per_rank_is_todays_hint(hint):
    h, S, M = resolve(hint), 4, 8
    lay = VirtualLayout(S, 1)
    for r in range(S):
        for dispatch in Dispatch:
            old = h.spec(S, r, M, True, dispatch, Budget.parse("2x"))
            new = h.rank_spec(lay, r, M, True, dispatch, Budget.parse("2x"))
            assert new.priority == {(r, t): p for t, p in old.priority.items()}
            assert list(new.order) == [(r, t) for t in old.order] and new.limit == old.limit


def test_bfw_over_local_stages_ranks_kind_then_microbatch_then_later_local_stage():
    lay = VirtualLayout(2, 2)  # rank 0 holds stages 0 and 2
    prio = resolve("bfw").rank_priority(lay, 0, 2, True)
    ranked = [f"{t}@{s}" for (s, t), _ in sorted(prio.items(), key=lambda kv: kv[1])]
    assert ranked == [
        "B0@2",
        "B0@0",
        "B1@2",
        "B1@0",
        "F0@2",
        "F0@0",
        "F1@2",
        "F1@0",
        "W0@2",
        "W0@0",
        "W1@2",
        "W1@0",
    ]


def _torch_order(cls_name, S, V, M, rank):
    """torch 2.13's own pipeline_order for ``rank``, built without process groups."""
    from torch.distributed.pipelining import schedules as ts

    sched = object.__new__(getattr(ts, cls_name))
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = S, V, M
    sched.number_of_rounds = max(1, M // S)
    sched.microbatches_per_round = M // sched.number_of_rounds
    sched.num_stages = S * V
    kinds = {
        "FORWARD": Kind.F,
        "BACKWARD_INPUT": Kind.B,
        "FULL_BACKWARD": Kind.B,
        "BACKWARD_WEIGHT": Kind.W,
    }
    return [
        (a.stage_index, Task(kinds[a.computation_type.name], a.microbatch_index))
        for a in sched._calculate_single_rank_operations(rank)
        if a is not None
    ]


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (4, 16), (4, 12), (3, 3)])
def test_ports_match_torch(S, M):
    inter, v = VirtualLayout(S, 2), VirtualLayout(S, 2, "v")
    for r in range(S):
        got = [(s, t) for s, t in interleaved_1f1b(inter, r, M, False)]
        assert got == _torch_order("ScheduleInterleaved1F1B", S, 2, M, r)
        assert zbv(v, r, M, True) == _torch_order("ScheduleZBVZeroBubble", S, 2, M, r)


def test_a_csv_hint_orders_each_rank_by_its_stages_rows_in_file_order(tmp_path):
    lay = VirtualLayout(2, 2, "v")
    orders = {r: zbv(lay, r, 4, True) for r in range(2)}
    rows = [f"{s},{t}" for r in (1, 0) for s, t in orders[r]]  # ranks' rows one after the other
    path = tmp_path / "zbv.csv"
    path.write_text("stage,task\n" + "\n".join(rows) + "\n")
    h = resolve(str(path))
    assert [h.rank_order(lay, r, 4, True) for r in range(2)] == [orders[0], orders[1]]
    path.write_text("stage,task\n" + "\n".join(r for r in rows if not r.startswith("2,")) + "\n")
    with pytest.raises(HintError, match="no rows for stage 2 of 4"):
        resolve(str(path)).rank_order(lay, 1, 4, True)


@pytest.mark.parametrize(
    "S,M,V,placement,hint",
    [
        (8, 32, 2, "interleaved", "1f1b"),
        (4, 16, 3, "interleaved", "1f1b"),
        (8, 32, 2, "interleaved", "bfw"),
        (4, 16, 3, "interleaved", "bfw"),
        (8, 32, 2, "v", "zbv"),
        (4, 16, 2, "v", "bfw"),
    ],
)
def test_every_nominal_order_leads_its_next_local_stage_by_exactly_the_layouts_lead(
    S, M, V, placement, hint
):
    """The ready lead limit (RankTracker) takes nothing from these schedules: each order's local
    stage c runs at most, and at some point exactly, layout.leads(rank)[c] forwards ahead of local
    stage c + 1."""
    lay = VirtualLayout(S, V, placement)
    for r in range(S):
        stages = lay.stages_of(r)
        count, most = [0] * V, [0] * (V - 1)
        for s, t in resolve(hint).rank_order(lay, r, M, True):
            if t.kind is Kind.F:
                count[stages.index(s)] += 1
                most = [max(m, count[c] - count[c + 1]) for c, m in enumerate(most)]
        assert tuple(most) == lay.leads(r), (r, most)
