"""StageTracker: the one place where a task becomes ready."""

import pytest

from rrfp.core.budget import Budget
from rrfp.core.hints import resolve
from rrfp.core.policy import Dispatch
from rrfp.core.tasks import B, F, Kind, W
from rrfp.core.tracker import StageTracker, TrackerError


def tracker(
    S=3, s=1, M=3, hint="bfw", dispatch=Dispatch.READY, budget="2x", split=True, size_of=None
):
    return StageTracker(resolve(hint).spec(S, s, M, split, dispatch, Budget.parse(budget)), size_of)


def run(tr, task):
    tr.start(task)
    return tr.finish(task)


def test_middle_stage_follows_arrivals():
    tr = tracker()
    assert tr.next() is None and tr.ready_tasks() == set()
    assert "has nothing ready: 3 input(s) and 3 gradient(s) not arrived" in tr.blocked()
    tr.arrive(Kind.F, 1)
    assert tr.next() == F(1)  # only the arrived input is ready, whatever its microbatch
    assert run(tr, F(1)) == 2  # F's output goes to the next stage
    tr.arrive(Kind.B, 1)
    assert tr.next() == B(1)
    assert run(tr, B(1)) == 0  # B's gradient goes to the previous stage
    assert tr.next() == W(1) and run(tr, W(1)) is None
    assert tr.held.count == 0 and tr.held.peak == 1


def test_gradient_before_forward_waits_for_forward():
    tr = tracker()
    tr.arrive(Kind.F, 0)
    tr.arrive(Kind.B, 0)  # cannot happen in a pipeline, but the rule still holds
    assert tr.ready_tasks() == {F(0)}
    run(tr, F(0))
    assert tr.ready_tasks() == {B(0)}


def test_first_and_last_stage():
    first = tracker(s=0)
    assert first.ready_tasks() == {F(0), F(1), F(2)}
    with pytest.raises(TrackerError, match="receives no F messages"):
        first.arrive(Kind.F, 0)
    last = tracker(s=2, split=False, hint="1f1b")
    last.arrive(Kind.F, 2)
    run(last, F(2))
    assert last.next() == B(2)  # the loss is here: B needs no gradient
    with pytest.raises(TrackerError, match="receives no B messages"):
        last.arrive(Kind.B, 2)


def test_budget_holds_forwards_back():
    tr = tracker(s=0, budget=1)
    run(tr, F(0))
    assert tr.next() is None and tr.held.count == 1
    assert "budget full" in tr.blocked()
    tr.arrive(Kind.B, 0)
    run(tr, B(0))
    assert tr.held.count == 1  # split: W frees the microbatch, not B
    run(tr, W(0))
    assert tr.next() == F(1)


def test_byte_budget_releases_admitted_size():
    sizes = {0: 70, 1: 50, 2: 10}
    tr = tracker(s=0, budget="100B", size_of=sizes.__getitem__)
    run(tr, F(0))
    assert tr.held.bytes == 70 and tr.next() is None  # F1 (50) does not fit; F2 may not jump it
    tr.arrive(Kind.B, 0)
    run(tr, B(0))
    run(tr, W(0))
    assert tr.held.bytes == 0 and tr.next() == F(1)


def test_fixed_dispatch_waits_for_its_order():
    tr = tracker(s=1, hint="1f1b", dispatch=Dispatch.FIXED, split=False)
    order = tr.spec.order
    tr.arrive(Kind.F, 1)
    assert tr.next() is None  # F1 is ready but the order says F0 first
    assert tr.blocked() == f"waits for {order[0]} in its fixed order, which needs its input"
    tr.arrive(Kind.F, 0)
    assert tr.next() == F(0)


def test_rule_breaking_events_are_refused():
    tr = tracker()
    tr.arrive(Kind.F, 0)
    with pytest.raises(TrackerError, match="arrived twice"):
        tr.arrive(Kind.F, 0)
    with pytest.raises(TrackerError, match="no F arrival for microbatch 7"):
        tr.arrive(Kind.F, 7)
    with pytest.raises(TrackerError, match="not ready"):
        tr.start(F(1))
    tr.start(F(0))
    assert tr.next() is None and tr.blocked() == "is running F0"
    with pytest.raises(TrackerError, match="started while F0 runs"):
        tr.start(F(0))
    with pytest.raises(TrackerError, match="finished but F0 runs"):
        tr.finish(B(0))


def test_among_restricts_to_agreed_tasks():
    tr = tracker(s=0)
    assert tr.next(among={F(2)}) == F(2)
    assert tr.next(among=set()) is None


def test_done_after_every_task():
    tr = tracker(S=1, s=0, M=2, hint="gpipe", split=False)
    while not tr.done:
        run(tr, tr.next())
    assert tr.finished == 4 and tr.blocked() == "has nothing left to run"


def test_unlocked_by_predicts_finish():
    last = tracker(s=2)
    last.arrive(Kind.F, 0)
    last.start(F(0))
    assert last.unlocked_by(F(0)) == {B(0)}  # the loss is here
    last.finish(F(0))
    mid = tracker(s=1)
    mid.arrive(Kind.F, 0)
    mid.start(F(0))
    assert mid.unlocked_by(F(0)) == set()  # its gradient has not arrived
    mid.finish(F(0))
    mid.arrive(Kind.B, 0)
    mid.start(B(0))
    assert mid.unlocked_by(B(0)) == {W(0)}
    assert mid.finish(B(0)) == 0 and mid.ready_tasks() == {W(0)}
