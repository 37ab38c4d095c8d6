"""The failure board: ranks post how they failed on the run's store, and a rank
that lost a peer finds the rank that failed first, or the one that went silent."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch.distributed as dist
from harness.distributed import free_port

from rrfp.app.job import failure_board
from rrfp.app.job.failure_board import GRACE_S, FailureBoard
from rrfp.comm.job_store import OWN_STORE_CONNECT_S


@pytest.fixture
def board(monkeypatch):
    port = free_port()
    # the store's own client connects within 60 s (a loaded machine has taken over 5 s to accept
    # it); its operations are bounded at 5 s after, as before
    master = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )
    master.set_timeout(datetime.timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    # the board's own 1 s is a failing rank's best effort; here connecting is no part of a test,
    # and a loaded machine has taken over 1 s to accept a client of this process's store
    b = FailureBoard.connect(timeout_s=30.0)
    assert b is not None
    yield b
    del master


def test_a_primary_post_is_the_origin(board):
    board.post(3, "primary")
    board.post(2, "secondary 3")
    board.post(1, "secondary 2")
    assert board.origin(0, peer=1) == (3, True), "across the chain 0 <- 1 <- 2 <- 3"
    assert board.origin(4, peer=None) == (3, True), "a collective names no peer; the post does"


def test_the_chain_ends_at_the_rank_that_posted_nothing(board):
    board.post(1, "secondary 2")  # rank 2 was killed: no post
    assert board.origin(0, peer=1) == (2, False)
    assert board.origin(3, peer=2) == (2, False)
    assert board.origin(4, peer=None) == (2, False), (
        "ranks 2 and 3 posted nothing, but rank 1 names rank 2"
    )
    board.post(0, "secondary 1")
    board.post(3, "secondary ?")
    assert board.origin(4, peer=None) == (2, False), (
        "one rank in the collective stays silent: that one"
    )


def test_a_secondary_that_lost_an_unknown_peer_ends_the_chain(board):
    board.post(1, "secondary ?")
    assert board.origin(0, peer=1) is None


def test_a_world_collective_names_the_rank_another_post_names_within_the_grace(board):
    """kill -9 of rank 0 of 5: rank 1 lost its channel from rank 0 and posted so; rank 3's world
    all-reduce names no peer, and ranks 0 and 2 (still failing) are both silent."""
    board.post(1, "secondary 0")
    board.post(4, "secondary ?")
    t0 = time.monotonic()
    assert board.origin(3, peer=None) == (0, False)
    assert time.monotonic() - t0 < GRACE_S + 0.5, "no slower than the grace a silent peer gets"


def test_a_dead_end_chain_falls_back_on_what_the_other_posts_name(board):
    """A rank whose own peer lost a peer it could not name still learns the rank others name."""
    board.post(1, "secondary ?")
    board.post(2, "secondary 4")
    board.post(3, "secondary 4")
    assert board.origin(0, peer=1) == (4, False)
    board.post(4, "primary")
    assert board.origin(0, peer=1) == (4, True)


def test_no_store_is_no_board_and_no_noise(monkeypatch, capfd):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert FailureBoard.connect(timeout_s=0.5) is None
    assert capfd.readouterr().err == "", "torch's C++ store log is kept off the terminal"


def test_with_no_post_naming_it_the_rank_whose_alive_counter_stood_still_is_named(board):
    """A kill during a world collective (DCP's save): every survivor failed in it, naming no peer,
    and rank 0, blocked in it until a ring neighbour leaves, has not posted yet: its stop relay
    still ticks, the killed rank 2's does not."""
    import threading

    from rrfp.app.job.failure_board import alive_key

    board.post(1, "secondary ?")
    board.post(4, "secondary ?")
    assert board.origin(3, peer=None) is None, "no counter moved: nothing tells 0 from 2"
    done = threading.Event()

    def tick():
        while not done.wait(0.1):
            board.store.add(alive_key(0), 1)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        t0 = time.monotonic()
        assert board.origin(3, peer=None) == (2, False)
        assert time.monotonic() - t0 < GRACE_S + 0.5
    finally:
        done.set()
        ticker.join()


class _Stalling:
    """The store as a loaded machine serves it: its first ``n`` operations time out."""

    def __init__(self, store, n: int) -> None:
        self.store, self.left = store, n

    def __getattr__(self, name):
        op = getattr(self.store, name)

        def call(*args):
            if self.left > 0:
                self.left -= 1
                raise dist.DistStoreError("wait timeout after 1000ms")
            return op(*args)

        return call


def test_a_refusal_survives_store_operations_that_time_out(board):
    """Rank 0's post and another rank's read each meet timeouts first: the text still gets across,
    so the other rank stays silent rather than printing the refusal a second time."""
    store = board.store
    board.store = _Stalling(store, 3)
    assert board.post_refusal("no such file", wait_s=30.0)
    board.store = _Stalling(store, 3)
    assert board.refusal(wait_s=30.0) == "no such file"


def test_a_refusal_never_posted_is_none_after_the_wait(board):
    board.store = _Stalling(board.store, 10**9)
    assert board.refusal(wait_s=0.2) is None
    assert not board.post_refusal("text", wait_s=0.2)


@pytest.mark.parametrize(
    ("rank", "agent_store", "listening", "bound"),
    [
        ("0", None, True, OWN_STORE_CONNECT_S),
        ("0", None, False, None),
        ("1", None, False, 1.0),
        ("0", "True", False, 1.0),
    ],
    ids=["rank0-hosts-it", "rank0-hosted-it-gone", "a-client-rank", "torchrun-agent-hosts-it"],
)
def test_a_store_this_process_hosts_gets_the_longer_bound_or_none(
    monkeypatch, rank, agent_store, listening, bound
):
    """Rank 0 under env:// hosts the store: alive while rank 0 reads it, however slowly it accepts
    on a loaded machine (the board then named no origin after 1 s), unless a failed rendezvous
    took it with it, when its port refuses and there is no board at once (not after the client's
    retries). Any other rank keeps the short bound: the store may have died with its host."""
    asked: list[float] = []

    def client(timeout_s):
        asked.append(timeout_s)
        raise RuntimeError("not reached")

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if not listening:
        listener.close()
    monkeypatch.setattr(failure_board, "store_client", client)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", rank)
    if agent_store is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    try:
        assert FailureBoard.connect() is None
    finally:
        listener.close()
    assert asked == ([] if bound is None else [bound])
