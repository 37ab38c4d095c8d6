"""The heartbeat (rrfp/comm/heartbeat.py) on a real TCPStore in this process: a peer
that beats is never silent, one that stops is named within timeout_s, a rank that
was itself stopped gives its peers a fresh timeout_s, and a stuck store is a
finding of its own."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time

import pytest
import torch.distributed as dist
from harness.distributed import free_port

from rrfp.comm.beater import Beater
from rrfp.comm.heartbeat import Heartbeat
from rrfp.comm.job_store import OWN_STORE_CONNECT_S

TIMEOUT_S = 0.6


@pytest.fixture
def server():
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=5),
    )
    yield store


def _pair(server, timeout_s: float = TIMEOUT_S) -> list[Heartbeat]:
    """Two heartbeats on clients of ``server``. Connecting is no part of these tests, and a loaded
    machine has taken over 5 s to accept a client of this process's own store: 60 s to connect,
    then the clients' operations bounded at 5 s as before."""
    beats = []
    for rank in range(2):
        client = dist.TCPStore(
            "127.0.0.1",
            server.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        client.set_timeout(datetime.timedelta(seconds=5))
        beats.append(Heartbeat(client, rank, 2, timeout_s, prefix=f"test/{id(server)}"))
    return beats


def _start(*beats: Heartbeat) -> None:
    """Start each heartbeat and wait until each has read every peer's first beat: a beater forked
    from this big test process can take longer than TIMEOUT_S to beat first on a loaded machine,
    and the tests' clocks start once the peers beat."""
    for hb in beats:
        hb.start()
    end = time.monotonic() + 10
    while any(hb.beats[p].seq < 0 for hb in beats for p in hb.peers):
        assert time.monotonic() < end, [hb.describe(p) for hb in beats for p in hb.peers]
        for hb in beats:
            hb.check()  # as the runtime's watcher does meanwhile
        time.sleep(0.01)


def _watch(hb: Heartbeat, seconds: float):
    """Check every beat for ``seconds`` (as the runtime's watcher does); the first silence found."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found = hb.check()
        if found is not None:
            return found
        time.sleep(hb.period_s)
    return None


@pytest.mark.multirank
def test_a_beating_peer_is_never_silent_and_says_what_it_does(server):
    a, b = _pair(server)
    _start(a, b)
    try:
        b.doing("task F3")
        assert _watch(a, 3 * TIMEOUT_S) is None, "a peer that beats was called silent"
        assert a.describe(1).startswith("alive, in task F3 for "), a.describe(1)
        assert b.describe(0) == "alive", b.describe(0)
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_beating_is_not_progress_a_task_or_a_new_activity_is(server):
    """``progress_at`` moves while a peer is in a task or starts something new, and stands still
    while it beats on at one wait (the executor's progress bound reads it)."""
    a, b = _pair(server)
    _start(a, b)
    try:
        b.doing("waiting for rank 0")
        _watch(a, 3 * a.period_s)
        stood = a.progress_at
        assert _watch(a, 4 * a.period_s) is None and a.progress_at == stood, "a wait is progress"
        b.doing("task B1")
        _watch(a, 3 * a.period_s)
        assert a.progress_at > stood, "a peer in a task is not progress"
        b.doing("")
        _watch(a, 3 * a.period_s)
        idle = a.progress_at
        assert _watch(a, 4 * a.period_s) is None and a.progress_at == idle, "idling is progress"
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_a_peer_that_stops_beating_is_named_within_timeout_s(server):
    a, b = _pair(server)
    _start(a, b)
    try:
        assert _watch(a, 2 * TIMEOUT_S) is None
        b.close()  # what SIGSTOP does to its thread
        found = _watch(a, 5 * TIMEOUT_S)
        assert found is not None and found.rank == 1, found
        # named once silent for timeout_s by a's own clock, and at the first check past it: a check
        # more than timeout_s / 2 after the one before gives every peer a fresh timeout_s, so a
        # peer is named before its silence reaches 1.5 x timeout_s, however loaded the machine
        assert TIMEOUT_S <= found.seconds < 1.5 * TIMEOUT_S, found
        assert a.describe(1).startswith("no heartbeat for "), a.describe(1)
    finally:
        a.close()


@pytest.mark.multirank
def test_a_rank_that_was_itself_stopped_gives_its_peers_a_fresh_timeout(server):
    a, b = _pair(server)
    _start(a, b)
    try:
        assert _watch(a, 2 * TIMEOUT_S) is None
        b.close()
        # this rank's own checks stopped for longer than timeout_s (as a SIGSTOP of it does): the
        # peer's old beat is no evidence, so nobody is blamed at once ...
        assert a.check(time.monotonic() + 3 * TIMEOUT_S) is None
        # ... only after timeout_s of checks that saw nothing new
        found = _watch(a, 5 * TIMEOUT_S)
        assert found is not None and found.rank == 1, found
    finally:
        a.close()


@pytest.mark.multirank
def test_a_store_that_stops_answering_is_named_as_the_store(server):
    """This rank's reads block (the server is stopped) while the peer goes on beating behind it:
    the store is named, not the peer whose beats it can no longer read."""
    a, b = _pair(server)
    a.store = stalling = StallingStore(a.store)
    _start(a, b)
    try:
        assert _watch(a, 2 * TIMEOUT_S) is None
        stalling.stall.set()
        found = _watch(a, 5 * TIMEOUT_S)
        assert found is not None and found.rank is None, found
        assert found.seconds >= TIMEOUT_S
    finally:
        stalling.release.set()
        a.close(), b.close()


@pytest.mark.multirank
def test_a_rank_that_hosts_the_store_never_names_it(server):
    """The store's server is a thread of the hosting rank's process: its own read that does not
    return says that process is starved, not that the store's host is gone, so the host names
    nobody for it (its peers, reading from outside, name the store, as above)."""
    a, b = _pair(server)
    a.host = a.rank
    a.store = stalling = StallingStore(a.store)
    _start(a, b)
    try:
        assert _watch(a, 2 * TIMEOUT_S) is None
        stalling.stall.set()
        assert _watch(a, 4 * TIMEOUT_S) is None
    finally:
        stalling.release.set()
        a.close(), b.close()


class StallingStore:
    """A client whose server stops answering when ``stall`` is set, as a SIGSTOPped store host does
    (TCPStore.cpp, torch 2.13): ``set`` only sends, so it returns; ``check`` and ``multi_get`` wait
    for a reply with no timeout, so they block until ``release``."""

    def __init__(self, client) -> None:
        import threading

        self.client, self.stall, self.release = client, threading.Event(), threading.Event()

    def set(self, key, value):
        if not self.stall.is_set():
            self.client.set(key, value)

    def _reply(self, call, *args):
        if self.stall.is_set():
            self.release.wait()
            raise RuntimeError("the store's connection was closed")
        return call(*args)

    def check(self, keys):
        return self._reply(self.client.check, keys)

    def multi_get(self, keys):
        return self._reply(self.client.multi_get, keys)


@pytest.mark.multirank
def test_a_store_that_stops_after_a_read_without_a_new_beat_is_still_named_as_the_store(server):
    """The race seen with a stopped store host: this rank's last good read saw no new beat from the
    peer, so the peer's beat looked older than the last read. Its silence must count only up to
    the stuck read, or the peer is blamed for what the store did not deliver."""
    a, b = _pair(server)
    a.store = stalling = StallingStore(a.store)
    _start(a, b)
    try:
        assert _watch(a, 2 * TIMEOUT_S) is None
        b.close()  # the peer's beat stops moving ...
        end = time.monotonic() + TIMEOUT_S / 3
        while (
            a.last_read - a.beats[1].changed_at < 2 * a.period_s
        ):  # ... for reads that still work ...
            assert time.monotonic() < end, "reads stopped before the store did"
            time.sleep(a.period_s / 4)
        stalling.stall.set()  # ... and then the store stops answering
        found = _watch(a, 5 * TIMEOUT_S)
        assert found is not None and found.rank is None, found
    finally:
        stalling.release.set()
        a.close(), b.close()


@pytest.mark.multirank
def test_a_rank_whose_beating_process_ends_beats_from_its_thread(server, caplog):
    """The beating process can end while its rank works (killed on its own, or it lost the store):
    the rank's thread then beats, so its peers do not call a working rank silent."""
    a, b = _pair(server)
    _start(a, b)
    try:
        os.kill(b._beater.pid, signal.SIGKILL)
        assert _watch(a, 3 * TIMEOUT_S) is None, a.describe(1)
        assert a.describe(1) == "alive", a.describe(1)
        assert b._beater is None
        assert "beating process ended (exit code -9)" in caplog.text
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_a_rank_whose_beating_process_lives_but_never_beats_beats_from_its_thread(
    server, caplog, monkeypatch
):
    """A beating process can live without beating (stuck on a lock another thread held when the
    rank forked it, or never accepted by the store): the rank's thread beats beside it, so its
    peers do not call a working rank silent."""
    # in the child, once it has closed the rank's descriptors: it never reaches the store
    monkeypatch.setattr(Beater, "_connect", lambda self, parent: time.sleep(3600))
    a, b = _pair(server)
    try:
        _start(a, b)
        assert _watch(a, 3 * TIMEOUT_S) is None, a.describe(1)
        assert a.describe(1) == "alive", a.describe(1)
        assert b._beater is not None and not b._beater.ended(), "the child should live on"
        assert "has not beaten for" in caplog.text
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_a_beating_process_the_store_accepts_late_still_beats():
    """On a loaded machine the store can take longer than a heartbeat's timeout to accept the
    beating process's connection: the process keeps trying instead of ending unheard."""
    port = free_port()
    child = Beater("127.0.0.1", port, "late/0", period_s=0.06, timeout_s=TIMEOUT_S).start()
    try:
        time.sleep(2.5)  # past the old one-second connect timeout, with nothing listening
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=5),
        )
        store.wait(["late/0"], datetime.timedelta(seconds=15))
        assert store.get("late/0").split()[0].isdigit()
        assert not child.ended()
    finally:
        child.close()


@pytest.mark.multirank
def test_a_rank_waits_for_the_store_as_long_as_store_connect_s(monkeypatch):
    """A rank's heartbeat client connects within ``timeouts.store_connect_s``, not within its
    (shorter) silence bound: a store slow to accept leaves the rank with a heartbeat."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores = []
    later = threading.Timer(
        2.0,
        lambda: stores.append(
            dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        ),
    )
    later.start()
    try:
        hb = Heartbeat.connect(0, 2, timeout_s=TIMEOUT_S, connect_s=15)
        assert hb is not None, "no heartbeat: the connect gave up before store_connect_s"
    finally:
        later.join()


class SlowStore:
    """A live store that is slow to answer a read (a loaded store host): ``reading`` is set while
    a ``multi_get`` is in flight, which returns after ``delay_s``."""

    def __init__(self, client, delay_s: float) -> None:
        self.client, self.delay_s, self.reading = client, delay_s, threading.Event()

    def set(self, key, value):
        self.client.set(key, value)

    def check(self, keys):
        return self.client.check(keys)

    def multi_get(self, keys):
        self.reading.set()
        time.sleep(self.delay_s)
        return self.client.multi_get(keys)


class FailingStore:
    """A live store whose reads fail ``failures`` times (None: for good) from when ``fail`` is set,
    as ``multi_get``'s wait does once the client's timeout passes on a loaded store host."""

    def __init__(
        self, client, failures: int | None, error: str = "wait timeout after 5000ms"
    ) -> None:
        self.client, self.failures, self.fail = client, failures, threading.Event()
        self.failed, self.error = 0, error

    def set(self, key, value):
        self.client.set(key, value)

    def check(self, keys):
        return self.client.check(keys)

    def multi_get(self, keys):
        if self.fail.is_set() and (self.failures is None or self.failed < self.failures):
            self.failed += 1
            raise dist.DistStoreError(f"{self.error}, keys: {keys[0]}")
        return self.client.multi_get(keys)


@pytest.mark.multirank
def test_a_read_that_failed_once_is_tried_again_and_names_nobody(server):
    """One read that timed out under load is no finding: the next round reads again, so neither
    the store nor the peer is named."""
    a, b = _pair(server)
    a.store = failing = FailingStore(a.store, failures=1)
    _start(a, b)
    try:
        failing.fail.set()
        assert _watch(a, 4 * TIMEOUT_S) is None
        assert failing.failed == 1
        assert a.describe(1) == "alive", a.describe(1)
    finally:
        a.close(), b.close()


@pytest.mark.multirank
@pytest.mark.parametrize("hosts", [False, True])
def test_a_store_whose_reads_keep_failing_is_named_as_the_store(server, hosts):
    """Reads that fail round after round are a store that does not answer: named as the store
    after timeout_s, never as the peer whose beats it no longer delivers; the rank that hosts the
    store names nobody (its own server failing says this process is in trouble, not the peer)."""
    a, b = _pair(server)
    if hosts:
        a.host = a.rank
    a.store = failing = FailingStore(a.store, failures=None)
    _start(a, b)
    try:
        failing.fail.set()
        found = _watch(a, 5 * TIMEOUT_S)
        assert failing.failed > 2, "the reader stopped trying"
        if hosts:
            assert found is None, found
        else:
            assert found is not None and found.rank is None, found
            assert found.seconds >= TIMEOUT_S
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_a_closed_store_connection_ends_the_reading_and_names_the_store(server):
    """A closed connection is for good (the client never reconnects): the reader stops at the
    first such failure instead of retrying a dead socket (each retry a C++ warning with its stack
    where torch's log level allows), and the store is named after timeout_s as before."""
    a, b = _pair(server)
    a.store = failing = FailingStore(a.store, failures=None, error="Broken pipe")
    _start(a, b)
    try:
        failing.fail.set()
        found = _watch(a, 5 * TIMEOUT_S)
        assert found is not None and found.rank is None, found
        assert failing.failed == 1, f"{failing.failed} calls on a closed connection"
    finally:
        a.close(), b.close()


@pytest.mark.multirank
def test_close_ends_the_thread_and_the_beating_process(server):
    """``close`` returns with the beating process reaped and the thread ended, even when it came
    while the thread waited for a live store's answer: a closed heartbeat leaves nothing behind."""
    a, b = _pair(server, timeout_s=10)  # stall_s 3 s: close's bound, far above the slow read
    _start(a, b)
    a.store = slow = SlowStore(a.store, delay_s=0.5)
    beating = a._beater.pid
    assert slow.reading.wait(10), "the heartbeat thread never read its peer"
    a.close()
    assert not a._thread.is_alive(), "close returned with the heartbeat thread in a store call"
    with pytest.raises(ChildProcessError):  # reaped: no longer this process's child
        os.waitpid(beating, os.WNOHANG)
    b.close()
    assert not b._thread.is_alive()


@pytest.mark.parametrize(("rank", "bound"), [("0", OWN_STORE_CONNECT_S), ("1", 2.0)])
def test_rank0s_heartbeat_waits_longer_for_the_store_it_hosts(monkeypatch, rank, bound):
    """Under env:// rank 0 hosts the store: alive while rank 0 runs, however slowly a loaded
    machine accepts its heartbeat's client (it took over 2 s, and rank 0, left with no heartbeat,
    named a busy peer silent). Other ranks keep ``connect_s``: their store may be gone."""
    from rrfp.comm import heartbeat

    asked: list[float] = []

    def client(timeout_s):
        asked.append(timeout_s)
        raise RuntimeError("not reached")

    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(heartbeat, "store_client", client)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(listener.getsockname()[1]))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    try:
        assert Heartbeat.connect(int(rank), 2, 2.0, 2.0) is None
    finally:
        listener.close()
    assert asked == [bound]
