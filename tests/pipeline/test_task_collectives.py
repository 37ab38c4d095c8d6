"""A collective inside a task (a TP layer's all-reduce), as rrfp/pipeline/task_collectives.py
marks it: what this rank's heartbeat says meanwhile, and the one line its failure becomes, naming
the TP peer that never reached it. In process: a heartbeat that is never started (its reads set by
hand), the collective's failure raised by hand as gloo words it. The ranks and gloo:
tests/pipeline/test_parallel.py (the embedding API) and the "TP F" hang row of
tests/app/train/test_fault_matrix_train.py (rrfp train)."""

from __future__ import annotations

import time

import pytest
import torch

from rrfp.app.faults import Fault, FaultInjector
from rrfp.comm.collective_wait import AT
from rrfp.comm.heartbeat import Heartbeat
from rrfp.core.errors import PeerFailure, PeerStuck, PeerTimeout
from rrfp.core.tasks import Task
from rrfp.nn.collective_marks import marked, marking
from rrfp.pipeline import task_collectives
from rrfp.pipeline.task_collectives import TaskCollectives

GROUP = object()  # the TP group: its members are set by hand, no process group needed
BOUND = "timeouts.progress_s = 4 s"
AT_PROJ = "the row-parallel all-reduce of block.proj in task F3 of stage 1"
TIMED_OUT = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)


MEMBERS: dict[object, tuple[int, ...]] = {}  # group -> its other members, as _marks sets them


@pytest.fixture(autouse=True)
def _groups_by_hand(monkeypatch):
    monkeypatch.setattr(task_collectives, "peers_of", lambda group: MEMBERS[group])


def _marks(heartbeat: Heartbeat | None, peers=(1,)) -> tuple[TaskCollectives, torch.nn.Module]:
    MEMBERS[GROUP] = peers
    return TaskCollectives(0, heartbeat, BOUND), torch.nn.Sequential()


def _beating(hb: Heartbeat, rank: int, activity: str, for_s: float) -> None:
    beat = hb.beats[rank]
    beat.seq, beat.activity, beat.activity_s = 5, activity, for_s
    beat.changed_at = beat.read_at = time.monotonic()  # read just now: it beats


def _failing(marks: TaskCollectives, stage_module: torch.nn.Module, error: Exception):
    """The error a layer's collective that raised ``error`` gives, run as task F3 of stage 1."""
    stage_module.add_module("block", _Block())
    layer = stage_module.block.proj
    with pytest.raises(Exception) as raised:
        with marking(marks.marker(Task.parse("F3"), 1, stage_module)):
            with marked("row-parallel all-reduce", layer, GROUP):
                raise error
    return raised.value


def test_a_rank_at_a_tasks_collective_says_which_and_is_back_in_its_task_after():
    hb = Heartbeat(object(), rank=0, world=2, timeout_s=2.0)
    marks, stage_module = _marks(hb)
    stage_module.add_module("block", _Block())
    hb.doing("task F3")
    with marking(marks.marker(Task.parse("F3"), 1, stage_module)):
        with marked("row-parallel all-reduce", stage_module.block.proj, GROUP):
            assert hb.activity == AT + AT_PROJ
    assert hb.activity == "task F3"


def test_unmarked_a_layers_collective_runs_as_it_is():
    with marked("row-parallel all-reduce", torch.nn.Linear(2, 2), GROUP):
        pass


def test_a_timeout_names_the_peer_whose_heartbeat_is_elsewhere_what_it_does_and_the_bound():
    hb = Heartbeat(object(), rank=0, world=3, timeout_s=2.0)
    _beating(hb, 1, "task F3", 4.0)  # in the same task, not at its collective: the stuck one
    _beating(hb, 2, AT + AT_PROJ, 4.0)  # at it, as this rank
    marks, stage_module = _marks(hb, peers=(1, 2))
    error = _failing(marks, stage_module, RuntimeError(TIMED_OUT))
    assert isinstance(error, PeerStuck) and error.peer == 1
    text = str(error)
    assert text.startswith(f"rank 0: {AT_PROJ}: rank 1 (alive, in task F3 for 4 s) never reached")
    assert f"({BOUND})" in text and "rank 2" not in text and "\n" not in text
    assert isinstance(error.__cause__, RuntimeError)  # gloo's own words stay in the traceback


def test_a_timeout_with_every_peer_at_it_blames_no_one():
    hb = Heartbeat(object(), rank=0, world=2, timeout_s=2.0)
    _beating(hb, 1, AT + AT_PROJ, 4.0)
    marks, stage_module = _marks(hb)
    error = _failing(marks, stage_module, RuntimeError(TIMED_OUT))
    assert isinstance(error, PeerStuck) and error.peer is None
    assert "every rank of it is at it, yet it has not completed" in str(error), error


def test_a_dead_peer_is_one_line_naming_the_collective():
    hb = Heartbeat(object(), rank=0, world=2, timeout_s=2.0)
    marks, stage_module = _marks(hb)
    died = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [1.2.3.4]")
    error = _failing(marks, stage_module, died)
    assert type(error) is PeerFailure and error.peer == 1
    assert str(error).startswith(f"rank 0: {AT_PROJ} failed (the peer process probably died)")


def test_without_a_heartbeat_a_timeout_says_what_and_the_bound_and_names_no_one():
    marks, stage_module = _marks(None)
    error = _failing(marks, stage_module, RuntimeError(TIMED_OUT))
    assert type(error) is PeerTimeout and error.peer is None
    text = str(error)
    assert text.startswith(f"rank 0: {AT_PROJ}: not completed in ") and f"({BOUND})" in text
    assert "(no heartbeat to tell which)" in text


def test_an_error_that_is_not_a_peers_stays_as_it_is():
    marks, stage_module = _marks(None)
    mismatch = RuntimeError("gloo: mismatch in tensor sizes")
    assert _failing(marks, stage_module, mismatch) is mismatch


def test_a_hang_inside_a_task_fires_as_the_task_begins_on_the_lane_not_after_it():
    injector = FaultInjector(Fault.parse("hang:rank=1:step=2:task=F1"), rank=1, stage=0)
    fired: list[str] = []
    injector._fire = lambda module=None: fired.append("fired")  # the real one sleeps for good
    injector.begin_step(1)  # step 2
    injector.task_begins(Task.parse("F0"))
    injector.task_done(Task.parse("F1"))
    assert fired == []
    injector.task_begins(Task.parse("F1"))
    assert fired == ["fired"]
