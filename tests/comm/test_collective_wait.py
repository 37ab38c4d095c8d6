"""A rank's wait at a collective, bounded while its peers beat (rrfp/comm/collective_wait.py): what
its heartbeat says meanwhile, when the wait is overdue, whom it names, and what counts as progress.
In process, on a heartbeat that is never started (its reads are set by hand or from a fake store).
The ranks and the gloo collectives: the hang rows of tests/test_fault_matrix*.py."""

from __future__ import annotations

import time

import pytest

from rrfp.app.faults import Fault
from rrfp.comm import collective_wait
from rrfp.comm.collective_wait import AT, CollectiveWaits
from rrfp.comm.heartbeat import Heartbeat
from rrfp.core.errors import PeerStuck
from rrfp.pipeline.runtime import PipelineRuntime
from rrfp.pipeline.timeouts import Timeouts

BOUND_S = 4.0
WHAT = "final barrier of every rank"


def _hb(world: int = 3) -> Heartbeat:
    return Heartbeat(object(), rank=0, world=world, timeout_s=2.0)


def _asked_every_beat(waits: CollectiveWaits, start: float, until: float):
    """``overdue`` asked every 0.1 s from ``start`` to ``until``: its last answer."""
    found = None
    for i in range(round((until - start) / 0.1) + 1):
        found = waits.overdue(BOUND_S, start + i * 0.1)
    return found


def test_a_rank_at_a_collective_says_so_and_is_between_things_after():
    hb = _hb()
    waits = CollectiveWaits(hb)
    with waits.at(WHAT, (1, 2)):
        assert hb.activity == AT + WHAT
        assert waits.current is not None and waits.current.peers == (1, 2)
    assert hb.activity == "" and waits.current is None


def test_a_collective_awaited_during_a_task_is_the_tasks():
    hb = _hb()
    waits = CollectiveWaits(hb)
    hb.doing("task F3")
    with waits.at("TP agreement", (1,)):
        assert hb.activity == "task F3" and waits.current is None
    assert hb.activity == "task F3"


def test_a_wait_is_overdue_after_the_bound_with_no_progress_and_names_who_is_not_there():
    hb = _hb()
    waits = CollectiveWaits(hb)
    hb.beats[1].activity = AT + WHAT  # rank 1 waits there too; rank 2 is elsewhere
    hb.beats[2].activity = ""
    with waits.at(WHAT, (1, 2)):
        start = waits.current.since
        assert _asked_every_beat(waits, start, start + BOUND_S - 0.2) is None
        late = _asked_every_beat(waits, start + BOUND_S - 0.1, start + BOUND_S + 0.1)
    assert late is not None and late.what == WHAT and late.absent == (2,)
    assert late.seconds >= BOUND_S


def test_progress_while_waiting_puts_the_verdict_off():
    hb = _hb()
    waits = CollectiveWaits(hb)
    with waits.at(WHAT, (1, 2)):
        start = waits.current.since
        hb.progress_at = start + 3.0  # a peer read in a task, or at something new
        assert _asked_every_beat(waits, start, start + BOUND_S + 1.0) is None
        late = _asked_every_beat(waits, start + BOUND_S + 1.1, start + 3.0 + BOUND_S + 0.1)
        assert late is not None


def test_a_rank_that_was_itself_stopped_waits_afresh():
    hb = _hb()
    waits = CollectiveWaits(hb)
    with waits.at(WHAT, (1, 2)):
        start = waits.current.since
        waits.overdue(BOUND_S, start)
        # the next question comes 10 s later: this rank was stopped or starved meanwhile
        assert waits.overdue(BOUND_S, start + 10.0) is None
        assert waits.current.since == start + 10.0


def test_a_wait_counted_afresh_ends_with_its_collective():
    """A wait that ``overdue`` counted afresh (this rank stalled during it) is still the one its
    collective ends: left current, it was later named as stuck, with the collective long over
    and this rank in its next step's task."""
    hb = _hb()
    waits = CollectiveWaits(hb)
    with waits.at(WHAT, (1, 2)):
        start = waits.current.since
        waits.overdue(BOUND_S, start)
        waits.overdue(BOUND_S, start + 10.0)  # a stall: counted afresh
    assert waits.current is None and hb.activity == ""
    assert _asked_every_beat(waits, start + 10.0, start + 30.0) is None


def test_no_wait_is_never_overdue():
    waits = CollectiveWaits(_hb())
    assert waits.overdue(BOUND_S, 1e9) is None


def test_a_write_inside_a_collective_is_work_then_the_wait_again():
    hb = _hb()
    waits = CollectiveWaits(hb)
    with waits.at(WHAT, (1, 2)):
        with waits.working("writing checkpoint step-00000001"):
            assert hb.activity == "writing checkpoint step-00000001"
        assert hb.activity == AT + WHAT
    assert hb.activity == ""


class _Store:
    """What Heartbeat._read asks of the store: every peer's key, ``SEQ AGE ACTIVITY``."""

    def __init__(self, values: dict[int, str]) -> None:
        self.values = values

    def check(self, keys):
        return True

    def multi_get(self, keys):
        return [self.values[int(k.rsplit("/", 1)[1])].encode() for k in keys]


@pytest.mark.parametrize(
    ("activity", "progress"),
    [
        ("task W2", True),
        ("writing checkpoint step-00000001", True),
        ("reading checkpoint step-00000001", True),
        ("at final barrier of every rank", False),
        ("", False),
    ],
)
def test_what_a_peer_does_counts_as_progress_on_every_read_only_when_it_is_work(activity, progress):
    store = _Store({1: f"1 0.5 {activity}"})
    hb = Heartbeat(store, rank=0, world=2, timeout_s=2.0)
    hb._read()  # the first read: anything new is progress
    first = hb.progress_at
    store.values[1] = f"2 1.5 {activity}"  # the same activity, one beat later
    hb._read()
    assert (hb.progress_at > first) is progress


def _runtime(hb: Heartbeat) -> PipelineRuntime:
    """The parts of a runtime its verdict reads, without a process group."""
    rt = PipelineRuntime.__new__(PipelineRuntime)
    rt.rank, rt.heartbeat = 0, hb
    rt.timeouts = Timeouts.derive(2.0, progress_s=BOUND_S)
    rt.collective_waits = CollectiveWaits(hb)
    return rt


def test_the_line_names_the_collective_the_absent_rank_what_it_does_and_the_bound():
    hb = _hb(world=2)
    hb.beats[1].seq, hb.beats[1].activity = 5, "step 2: writing the metrics"
    rt = _runtime(hb)
    with rt.collective_waits.at(WHAT, (1,)):
        start = rt.collective_waits.current.since
        late = _asked_every_beat(rt.collective_waits, start, start + BOUND_S + 0.1)
    beat = hb.beats[1]
    beat.changed_at = beat.read_at = time.monotonic()  # read just now: it beats
    beat.activity_s = 7.0
    error = rt._unreached(late)
    assert isinstance(error, PeerStuck) and error.peer == 1
    text = str(error)
    assert text.startswith(f"rank 0: {WHAT}: rank 1 (alive, step 2: writing the metrics for 7 s)")
    assert "never reached it" in text and "(timeouts.progress_s = 4 s)" in text
    assert "\n" not in text


def test_waiting_at_outside_a_runtime_marks_nothing():
    assert collective_wait.BOUND.get() is None
    with collective_wait.waiting_at(WHAT):  # no process group needed: nothing to bound here
        pass
    with collective_wait.working_marker()("writing checkpoint x"):
        pass


def test_the_hang_fault_takes_a_phase_or_a_task_and_nothing_else():
    assert str(Fault.parse("hang:rank=1:during=barrier")) == "hang:rank=1:during=barrier"
    assert Fault.parse("hang:rank=1:step=2:during=sync").during == "sync"
    assert str(Fault.parse("hang:rank=1:step=2:task=F1").task) == "F1"
    for bad, why in [
        ("hang:rank=1:step=2", "hang takes during=P or task=T"),
        ("hang:rank=1:step=2:task=F1:during=sync", "during=P takes no task"),
        ("hang:rank=1:during=barrier:seconds=3", "other kinds take no seconds"),
    ]:
        with pytest.raises(ValueError, match=why):
            Fault.parse(bad)
