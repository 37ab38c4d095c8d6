"""A heartbeat on the control plane, so that a rank waiting on a peer can tell a
peer that is busy (or was stopped and continued) from one that went silent.

Each rank writes ``SEQ AGE ACTIVITY`` under its key in the rendezvous store
every ``period_s`` (SEQ counts up; ACTIVITY is what the rank said it is doing,
e.g. ``task F3``, for AGE seconds), and a daemon thread reads its peers' keys.
A peer whose SEQ has not moved for ``timeout_s`` went silent: stopped
(SIGSTOP), killed, or cut off. The beats come from a forked child process
(rrfp/comm/beater.py, which says why): a thread would need the GIL between two
beats, and a forward that holds it in one long C call would silence it; where
no child can be forked, or the child ends or stops beating while the rank
lives, the reading thread beats too.

Store semantics relied on (torch/csrc/distributed/c10d/TCPStore.cpp, torch
2.13): one client's calls are serialized under one mutex (``activeOpLock_``),
so the heartbeat has its own client connection and never queues behind, or
holds up, the process group's store calls; ``set`` sends without waiting for a
reply; ``check`` and ``get`` read the reply with no timeout (only a ``wait``
is bounded, and ``multi_get`` begins with one, which raises once the client's
timeout passes), so a store whose server is stopped blocks the reader. Hence
the verdict (``silent``) is never a store call: it is taken from the times of
the last reads, by whoever asks, and a reader stuck on the store is itself a
finding ("the store stopped answering"), as is one whose calls keep failing. A
failed call is tried again the next round (one call that timed out under load
is no finding), unless the connection closed: the client never reconnects, so
the reading ends there. A store in torchrun's agent whose connection closed
(the agent is gone: the client's read fails at once) is that finding at once,
not after ``timeout_s``: nothing will answer again, and the ranks' own groups,
all alive, tell nothing. Once the reads have been stuck (or failing) for
``stall_s``, a peer's silence counts only up to that round's start: what the
store did not deliver is no evidence against the peer. Without that cap, a
stopped store host was named as a silent peer or as the store depending on
whether this rank's last good read happened to see a new beat.

Cost: per beat, one ``set`` and one ``multi_get`` of every peer's key, so
the store serves 2 x world requests per ``period_s`` (world^2 keys read):
fine for tens of ranks, to be narrowed to the ranks one talks to before
thousands.

Beating is not progress: a peer stuck outside the pipeline, or two ranks waiting on each other,
beat on. ``progress_at`` is when a read last showed a peer at work (an activity of ``WORK``: a
task, writing or reading a checkpoint) or at something new, and a wait, a stage's for a message
or a rank's at a collective (rrfp/comm/collective_wait.py), ends once the job has made no progress
for ``progress_s``.

Times are this process's monotonic clock, and only spans between two
consecutive checks count: when this rank was itself stopped or starved (a gap
between checks over half of ``timeout_s``), every peer gets a fresh
``timeout_s`` (``check``), so a rank that was stopped and continued does not
blame the peers that kept beating while it slept.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

import rrfp.loop.exit_guard  # noqa: F401 - at exit, waits for the reader to leave its store call
from rrfp.comm import beater
from rrfp.comm.job_store import attempt, connect_bound, store_client

log = logging.getLogger("rrfp.comm.heartbeat")

PREFIX = "rrfp/heartbeat"
WORK = ("task ", "writing ", "reading ")  # activities that are progress however long they last


def period_for(timeout_s: float) -> float:
    """How often a rank beats: ten beats per ``timeout_s``, between 20 ms and 1 s."""
    return min(1.0, max(0.02, timeout_s / 10))


@dataclass
class PeerBeat:
    """What this rank last read of a peer's heartbeat."""

    seq: int = -1  # -1: nothing read yet
    activity: str = ""
    activity_s: float = 0.0  # how long the peer had been at it when it wrote the beat
    read_at: float = 0.0  # when that beat was read (monotonic)
    changed_at: float = 0.0  # when SEQ last moved, as seen here (monotonic)


@dataclass(frozen=True)
class Silence:
    """A peer (``rank``; None: the store itself) with no heartbeat for ``seconds``; ``closed``:
    the store's connection closed (its host process is gone), what the store client said."""

    rank: int | None
    seconds: float
    closed: str = ""


# what a store client raises once the store's host process is gone: its socket closed or reset
STORE_CLOSED = ("Connection was likely closed", "Connection reset", "Broken pipe", "refused")


class Heartbeat:
    """This rank's beat and its view of the peers'; ``start``, and ``close`` before the store."""

    def __init__(
        self,
        store,
        rank: int,
        world: int,
        timeout_s: float,
        period_s: float | None = None,
        prefix: str = PREFIX,
        where: str = "the rendezvous store",
        in_agent: bool = False,
        host: int | None = None,
    ) -> None:
        self.store, self.rank, self.world = store, rank, world
        # the store lives in torchrun's agent, no rank: its closed connection is the only word
        # the ranks get of the agent's end (a rank that hosts it is found gone by its peers'
        # groups, whose lines name it)
        self.in_agent = in_agent
        # the rank whose process runs the store's server (None: no rank's, or not known). There
        # a read of it that does not return says that process is starved (or that thread stuck),
        # not that anything else failed, so that rank never names the store. Its peers, reading
        # it from outside, do; and a wait that nothing moves still ends after progress_s, as the
        # reads' progress stops with them
        self.host = host
        self.timeout_s, self.period_s = timeout_s, period_s or period_for(timeout_s)
        self.prefix, self.where = prefix, where
        self.peers = [r for r in range(world) if r != rank]
        now = time.monotonic()
        self.beats = {r: PeerBeat(changed_at=now, read_at=now) for r in self.peers}
        self.last_read = now  # the last round that read every peer's key
        self.round_at = now  # when the thread's current (or last) round of store calls began
        self.stall_s = min(
            3 * self.period_s, timeout_s / 2
        )  # a round this long: the store is stuck
        self.last_check = now
        # the last read that showed the job making progress: a peer in a task, or one whose
        # activity changed (the executor's bound on a wait for peers that beat but never send)
        self.progress_at = now
        self._activity: tuple[str, float] = ("", now)
        self._seq = 0
        # the beating process's count of beats, as this thread last saw it move, and when
        self._child_beats, self._child_beat_at, self._last_round = 0, now, now
        self._child_was_quiet = False
        self._stop = threading.Event()
        self._in_round = False  # the thread is in a round of store calls (else it waits or ended)
        self._thread = threading.Thread(
            target=self._run, name=f"rrfp-heartbeat-{rank}", daemon=True
        )
        self.error: BaseException | None = (
            None  # the store failed the thread (it then stops reading)
        )
        self.closed = ""  # the store's connection closed: what the client said (the verdict, now)
        # the beats' process (None: the thread beats), on a client of the store's own address
        self._beater = (
            beater.Beater(store.host, store.port, self._key(rank), self.period_s, timeout_s)
            if isinstance(store, dist.TCPStore) and beater.supported()
            else None
        )

    @classmethod
    def connect(
        cls, rank: int, world: int, timeout_s: float, connect_s: float | None = None
    ) -> Heartbeat | None:
        """A heartbeat on its own client of this job's store (MASTER_ADDR:MASTER_PORT, as torchrun
        and ``env://`` set them), one key space per torchrun attempt; None without that store.
        ``connect_s``: how long connecting may take (default ``timeout_s``; longer for a store in
        this very process, which cannot be dead: ``connect_bound``)."""
        try:
            bound = connect_bound(max(1.0, connect_s or timeout_s))
            if bound is None:
                raise RuntimeError("this process's store no longer listens")
            store = store_client(bound)
        except (KeyError, ValueError, RuntimeError) as e:
            log.warning(
                "rank %d: no heartbeat (the store cannot be reached: %s); a busy peer then counts "
                "as silent after the process-group timeout",
                rank,
                e,
            )
            return None
        in_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        owner = "torchrun's agent" if in_agent else "rank 0's process"
        return cls(
            store,
            rank,
            world,
            timeout_s,
            prefix=f"{PREFIX}/{attempt()}",
            where=f"the rendezvous store at {store.host}:{store.port} (in {owner})",
            in_agent=in_agent,
            host=None if in_agent else 0,  # env://: rank 0 starts the store's server
        )

    # -- this rank --------------------------------------------------------------

    def doing(self, what: str = "") -> None:
        """What this rank does from now on (``task F3``, ``waiting for rank 2``; "": between
        things). Called from the loop thread, or from the lane's thread at a task's collective
        (rrfp/pipeline/task_collectives.py) while the loop awaits that task; the beat carries it
        to the peers."""
        if what != self._activity[0]:
            self._activity = (what, time.monotonic())
            if (child := self._beater) is not None:
                child.doing(*self._activity)

    @property
    def activity(self) -> str:
        """What this rank said it is doing ("": between things)."""
        return self._activity[0]

    def start(self) -> Heartbeat:
        self._child_beat_at = self._last_round = time.monotonic()
        if self._beater is not None:
            try:
                self._beater.start()
            except OSError as e:  # no process to spare: the thread beats
                log.info("rank %d: heartbeat from a thread (no beating process: %s)", self.rank, e)
                self._beater = None
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop beating: end the beating process, and the thread, which is between rounds or in a
        store call. That call returns within a round trip from a live store and fails at once from
        one whose host is gone, so close waits for it as long as a round may take before the
        heartbeat calls the store stuck (``stall_s``), and no longer: a round already stuck that
        long (a stopped store host) ends with the store or with the process
        (rrfp/loop/exit_guard.py), and close runs on the loop thread and on error paths, which a
        stuck call must not hold. A process that builds runtime after runtime keeps no thread or
        process of any closed one."""
        self._stop.set()
        if (child := self._beater) is not None:
            child.close()
        thread = self._thread
        if thread.ident is None or thread is threading.current_thread():
            return  # never started, or closed from its own thread
        now = time.monotonic()
        thread.join(
            max(0.0, self.round_at + self.stall_s - now) if self._in_round else self.stall_s
        )

    # -- the thread -------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def _run(self) -> None:
        failing = False  # the last round's store call failed: its round_at still stands
        while not self._stop.is_set():
            if not failing:
                self.round_at = time.monotonic()
            self._in_round = True
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 - the verdict comes from the times, not from e
                if self._ends_reading(e, failing):
                    return
                failing = True
            else:
                if failing:
                    log.info("rank %d: the heartbeat reads the store again", self.rank)
                failing = False
            self._in_round = False
            self._stop.wait(self.period_s)

    def _round(self) -> None:
        child = self._beater
        if child is not None and child.ended() and not self._stop.is_set():
            self._take_over_beating(child.exit_code)
        if self._beater is None or self._child_quiet(self._beater):
            self._beat()
        self._read()

    def _ends_reading(self, e: Exception, failing: bool) -> bool:
        """Whether a failed store call ends the reading: yes once the store's connection closed
        (its host is gone, and the client never connects again; in torchrun's agent that is the
        verdict at once); no for any other failure, such as a wait that timed out on a loaded
        machine, which is tried again next round from the same ``round_at``. Either way a store
        that does not answer again is named once ``timeout_s`` has passed since the last read,
        as one that hangs is, and one that answers again is not named at all: one failed call is
        no evidence that the store is gone."""
        self.error = e
        if self._stop.is_set():
            return True
        text = " ".join(str(e).split())
        if any(words in text for words in STORE_CLOSED):
            if self.in_agent:
                self.closed = text.split(". Did ")[0]  # without the client's question
            log.info("rank %d: heartbeat stopped: %s", self.rank, e)
            return True
        if not failing:
            log.info("rank %d: a heartbeat read failed (%s); reading again", self.rank, text)
        return False

    def _take_over_beating(self, code: int | None) -> None:
        """The beating process ended while this rank lives (it lost the store, or was killed on
        its own): the thread beats from now on, so that the peers do not call a working rank
        silent."""
        self._beater = None
        log.warning(
            "rank %d: the heartbeat's beating process ended (exit code %s); the heartbeat "
            "thread beats instead, and falls silent while a long C call holds the GIL",
            self.rank,
            code,
        )

    def _child_quiet(self, child: beater.Beater) -> bool:
        """The beating process lives but has not beaten for three periods (it cannot reach the
        store, or it is stuck, e.g. on a lock another thread of the rank held when it forked): the
        thread beats beside it until it beats again, so that the peers do not call a working rank
        silent. A round after a gap of over half ``timeout_s`` (this rank was itself stopped, or
        its GIL held) restarts the count, as ``check`` does for the peers."""
        now, count = time.monotonic(), child.beats()
        if count != self._child_beats or now - self._last_round > self.timeout_s / 2:
            self._child_beats, self._child_beat_at = count, now
        self._last_round = now
        quiet = now - self._child_beat_at > 3 * self.period_s
        if quiet and not self._child_was_quiet:
            log.warning(
                "rank %d: the heartbeat's beating process has not beaten for %.1f s; the heartbeat "
                "thread beats beside it until it does",
                self.rank,
                now - self._child_beat_at,
            )
        self._child_was_quiet = quiet
        return quiet

    def _beat(self) -> None:
        self._seq += 1
        what, since = self._activity
        self.store.set(self._key(self.rank), f"{self._seq} {time.monotonic() - since:.3f} {what}")

    def _read(self) -> None:
        """Every peer's beat: one ``multi_get`` round trip once each has beaten (it waits for
        missing keys), until then a ``check`` of each key first."""
        peers = self.peers
        if any(
            self.beats[r].seq < 0 for r in peers
        ):  # not started yet: its changed_at stays at our start
            peers = [r for r in peers if self.store.check([self._key(r)])]
        values = self.store.multi_get([self._key(r) for r in peers]) if peers else []
        now = time.monotonic()
        for r, value in zip(peers, values):
            seq, age, what = (value.decode(errors="replace").split(" ", 2) + ["", ""])[:3]
            beat = self.beats[r]
            if int(seq) != beat.seq:
                beat.seq, beat.changed_at = int(seq), now
            restarted = what != beat.activity or float(age or 0) < beat.activity_s
            if what.startswith(WORK) or restarted:
                self.progress_at = now
            beat.activity, beat.activity_s, beat.read_at = what, float(age or 0), now
        self.last_read = now

    # -- the verdict --------------------------------------------------------------

    def check(self, now: float | None = None) -> Silence | None:
        """The peer (or the store, unless this process hosts it) silent for ``timeout_s`` or more,
        the longest-silent first; None if none. Call it every ``period_s`` or so: a longer gap
        since the last call means this rank was itself stopped or starved, and every peer gets a
        fresh ``timeout_s``."""
        now = time.monotonic() if now is None else now
        if now - self.last_check > self.timeout_s / 2:
            for beat in self.beats.values():
                beat.changed_at = max(beat.changed_at, now)
            self.last_read = max(self.last_read, now)
        self.last_check = now
        if self.closed:  # no store to wait for: its host process is gone
            return Silence(None, now - self.last_read, self.closed)
        if now - self.last_read >= self.timeout_s and self.host != self.rank:
            return Silence(None, now - self.last_read)
        stuck = self.round_at > self.last_read and now - self.round_at >= self.stall_s
        seen = self.round_at if stuck else now  # a peer is silent only as far as the store answered
        quiet = max(self.peers, key=lambda r: seen - self.beats[r].changed_at, default=None)
        if quiet is not None and seen - self.beats[quiet].changed_at >= self.timeout_s:
            return Silence(quiet, seen - self.beats[quiet].changed_at)
        return None

    def describe(self, rank: int, now: float | None = None) -> str:
        """A peer's state in words: ``alive, in task F3 for 75 s`` or ``no heartbeat for 3 s``."""
        now = time.monotonic() if now is None else now
        beat = self.beats[rank]
        quiet = now - beat.changed_at
        if beat.seq < 0:
            return f"no heartbeat yet ({quiet:.0f} s)"
        if quiet > 3 * self.period_s:  # three beats missed
            return f"no heartbeat for {quiet:.1f} s"
        if not beat.activity:
            return "alive"
        return (
            f"alive, {'in ' if beat.activity.startswith('task') else ''}{beat.activity} for "
            f"{beat.activity_s + (now - beat.read_at):.0f} s"
        )
