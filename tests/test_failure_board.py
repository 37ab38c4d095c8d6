"""The failure board: ranks post how they failed on the run's store, and a rank
that lost a peer finds the rank that failed first, or the one that went silent."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from distributed import free_port
from rrfp.app.failure_board import FailureBoard


@pytest.fixture
def board(monkeypatch):
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=5),
                           wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    b = FailureBoard.connect()
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
    assert board.origin(4, peer=None) is None, "ranks 2 and 3 posted nothing: the board cannot tell"
    board.post(0, "secondary 1")
    board.post(3, "secondary ?")
    assert board.origin(4, peer=None) == (2, False), "one rank in the collective stays silent: that one"


def test_a_secondary_that_lost_an_unknown_peer_ends_the_chain(board):
    board.post(1, "secondary ?")
    assert board.origin(0, peer=1) is None


def test_no_store_is_no_board_and_no_noise(monkeypatch, capfd):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert FailureBoard.connect(timeout_s=0.5) is None
    assert capfd.readouterr().err == "", "torch's C++ store log is kept off the terminal"
