"""Which line a failing rank prints: its own failure names the cause, a peer's
failure points at the peer, a bug says internal error. Unit tests of
rrfp/app/job/failure.py on constructed errors (the multi-process ones are in
test_fault_injection.py and test_failure.py)."""

from __future__ import annotations

import pytest

from rrfp.app.job.failure import INTERNAL, PRIMARY, SECONDARY, Failure, write_traceback
from rrfp.comm.channels import PeerError
from rrfp.comm.message import MessageError
from rrfp.core.errors import NonFiniteError, PeerFailure, PeerTimeout, ProtocolError, StartupError


def _group(*errors):
    return ExceptionGroup(
        "unhandled errors in a TaskGroup", [ExceptionGroup("inner", list(errors))]
    )


def test_own_failure_wins_over_the_peer_failures_it_caused():
    peer = PeerError("rank 1: channel fwd 1->2 (rank 1 -> rank 2): send failed", peer=2)
    own = ProtocolError(
        "rank 1 stage 1: channel bwd 2->1 (peer rank 2): expected a B message of iteration 3"
    )
    f = Failure.of(_group(peer, own))
    assert (f.kind, f.cause) == (PRIMARY, own)
    line = f.line(1, 1, "runs/logs/rank-1.log", debug=False)
    assert line == (
        "rank 1 (stage 1): channel bwd 2->1 (peer rank 2): expected a B message of iteration 3 "
        "(traceback in runs/logs/rank-1.log)"
    )


def test_a_bug_is_an_internal_error_never_a_peer_failure():
    bug = KeyError("w_q")
    f = Failure.of(_group(PeerError("rank 0: channel x: failed", peer=1), bug))
    assert (f.kind, f.cause) == (INTERNAL, bug)
    assert f.line(0, 0, "/tmp/rank-0.log", debug=False) == (
        "rank 0 (stage 0): internal error, please report it (traceback in /tmp/rank-0.log): "
        "KeyError: 'w_q'"
    )
    assert "traceback above" in f.line(0, 0, "/tmp/rank-0.log", debug=True)


def test_peer_failures_point_at_the_peer():
    f = Failure.of(PeerTimeout("rank 2 stage 2: iteration 4: nothing arrived for 5 s", peer=1))
    assert f.kind == SECONDARY
    line = f.line(2, 2, "x.log", debug=False)
    assert (
        line.startswith("rank 2: stopped: peer rank 1 failed or left first")
        and "nothing arrived" in line
    )
    assert (
        Failure.of(PeerFailure("rank 3: world all-reduce failed"))
        .line(3, 1, "x.log", False)
        .startswith("rank 3: stopped: another rank failed or left first")
    )
    died = PeerError(
        "rank 2: channel bwd 2->1 (rank 2 -> rank 1): send of the header of B message (iteration "
        "2, microbatch 3) to rank 1 failed (the peer process probably died): RuntimeError: "
        "Connection reset by peer [127.0.0.1]:2967",
        peer=1,
    )
    assert (
        Failure.of(died)
        .line(2, 2, "x.log", False)
        .endswith("to rank 1 failed (the peer process probably died) (traceback in x.log)")
    ), "gloo's own text stays in the log"


def test_message_nonfinite_and_startup_errors_are_this_ranks_own():
    assert Failure.of(MessageError("rank 1: channel fwd 0->1: bad header magic")).kind == PRIMARY
    assert (
        Failure.of(StartupError("rank 1: start-up failed while joining the process group")).kind
        == PRIMARY
    )
    assert Failure.of(NonFiniteError("rank 0: step 2: NaN")).kind == PRIMARY
    assert Failure.of(ValueError("x")).kind == INTERNAL


def test_multiline_causes_become_one_line(tmp_path):
    f = Failure.of(RuntimeError("first\n  second\tthird"))
    assert "\n" not in f.line(0, 0, "p", False) and "first second third" in f.line(0, 0, "p", False)
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        path = write_traceback(e, str(tmp_path / "logs"), 3)
    assert path == str(tmp_path / "logs" / "rank-3.log")
    assert "Traceback" in open(path).read() and "boom" in open(path).read()
    blocked = tmp_path / "file"
    blocked.write_text(
        ""
    )  # a log_dir that is a file: the traceback still lands somewhere, and says where
    fallback = write_traceback(RuntimeError("x"), str(blocked), 3)
    assert fallback != str(blocked / "rank-3.log") and "RuntimeError" in open(fallback).read()


@pytest.mark.e2e
def test_a_rank_that_cannot_join_says_start_up_failed(tmp_path):
    """Rendezvous on a port nobody serves: a start-up failure, not an internal error."""
    from harness.cli_run import rrfp

    res = rrfp(
        "--config",
        "configs/gpt-tiny.toml",
        "--set",
        "pp=2",
        "--set",
        "model.n_layer=2",
        "--set",
        "timeout_s=2",
        "--set",
        f"log_dir={tmp_path}",
        world=2,
        rank=1,
    )
    assert res.returncode == 1, res.stderr
    assert (
        "Traceback (most recent call last)" not in res.stderr
    )  # torch's own C++ log lines may precede
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("rrfp: error:")]
    assert len(lines) == 1 and lines[0].startswith(
        "rrfp: error: rank 1 (stage 1): start-up failed: rank 0's rendezvous store at "
        "127.0.0.1:9 did not answer within run.timeout_s = 2 s"
    ), res.stderr[-2000:]
    assert lines[0].endswith(f"(traceback in {tmp_path}/rank-1.log)")


def test_a_rank_with_virtual_stages_names_all_it_holds():
    """With virtual stages a pipeline rank holds several stages: its line names them, not the
    rank's pipeline index as if it were a stage."""
    own = ProtocolError("rank 1 stages 1, 6: channel bwd 2->1 (peer rank 2): expected a B message")
    f = Failure.of(own)
    line = f.line(1, (1, 6), "x.log", debug=False)
    assert (
        line
        == "rank 1 (stages 1, 6): channel bwd 2->1 (peer rank 2): expected a B message (traceback "
        "in x.log)"
    )
    assert (
        Failure.of(KeyError("w"))
        .line(1, (1, 6), "x.log", debug=False)
        .startswith("rank 1 (stages 1, 6): internal error")
    )
    # the executor's channel errors name the one stage of the rank they happened at: it stays
    chan = ProtocolError("rank 1 stage 6: channel fwd 5->6 (peer rank 2): expected an F message")
    assert Failure.of(chan).line(1, (1, 6), "x.log", debug=False) == (
        "rank 1 (stages 1, 6): stage 6: channel fwd 5->6 (peer rank 2): expected an F message "
        "(traceback in x.log)"
    )


def test_a_waiting_rank_names_a_peer_that_owes_it_on_two_channels_once(caplog):
    """With virtual stages one peer can owe a rank on two channels (rank 2 of three, interleaved,
    waits for rank 1's F into stage 5 and its B into stage 2); the heartbeat's activity and the
    periodic warning name it once ("waiting for rank 1 and 0", not "1 and 0 and 1")."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from rrfp.pipeline.executor import _Iteration

    doing: list[str] = []
    hb = SimpleNamespace(doing=doing.append, describe=lambda p: f"peer {p} ok")
    it = _Iteration.__new__(_Iteration)
    it.ex = SimpleNamespace(
        liveness=hb,
        rank=2,
        where="stages 2, 5",
        what="rank",
        instrument=None,
        timeouts=SimpleNamespace(progress_s=None),
    )
    it.it, it.changed = 1, asyncio.Event()
    it._owing = lambda: [SimpleNamespace(peer=1), SimpleNamespace(peer=0), SimpleNamespace(peer=1)]
    it._waiting_for = lambda: "nothing ready"

    async def go():
        asyncio.get_running_loop().call_later(0.05, it.changed.set)
        await it._wait_alive(hb, 0.02, 0.0)

    with caplog.at_level(logging.WARNING, logger="rrfp.pipeline.executor"):
        asyncio.run(go())
    assert doing == ["waiting for rank 1 and 0", ""], doing
    warned = [r.getMessage() for r in caplog.records]
    assert warned and all("(rank 1: peer 1 ok; rank 0: peer 0 ok)" in w for w in warned), warned


def test_a_model_collective_that_lost_its_peer_is_a_peer_failure_not_a_bug():
    """A TP layer's all-reduce (rrfp/nn/tensor_parallel.py) raises gloo's own RuntimeError: a lost
    peer, whose line points at the rank the failure board names, not "internal error"."""
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:8068: Connection reset by peer. This is typically caused by a remote worker"
    )
    gloo.add_note("rrfp: raised in task B3 (microbatch 3) of iteration 6, on stage 0 of 2 (rank 0)")
    f = Failure.of(_group(gloo))
    assert f.kind == SECONDARY and f.note == "secondary ?"
    assert f.line(0, 0, "x.log", False, origin=(1, False)) == (
        "rank 0: stopped: rank 1 left first without a word (killed, or hung): a collective in task "
        "B3 (microbatch 3) of iteration 6, on stage 0 of 2 (rank 0) failed (the peer process "
        "probably died) (traceback in x.log)"
    )
    assert Failure.of(RuntimeError("Connection reset by my own code")).kind == INTERNAL, (
        "not gloo's: a bug"
    )
