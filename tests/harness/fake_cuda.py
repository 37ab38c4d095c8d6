"""A fake of the CUDA and NCCL that rrfp's GPU path uses, faithful in what can make it fail.

Ranks are threads of one test process, each with its own event loop; tensors stay on
the CPU; the device clock is the wall clock. What it models, from the real sources
(docs/gpu.md, "The fake CUDA/NCCL"):

- Streams run their items in order. A kernel (``torch.cuda._sleep``) holds its stream for
  its duration and starts no earlier than it was enqueued; an event completes when its
  stream reaches it, so an event recorded after a later task completes after that task.
- Every NCCL operation runs on its communicator's one stream, behind what the issuing
  stream held when it was issued (ProcessGroupNCCL's ``syncStream``). On a
  communicator the i-th send from a to b matches b's i-th receive from a (NCCL ignores
  tags); a send completes only once its receive is posted, and holds its stream until then.
- Communicators. A group created with ``device_id`` gets its communicator in ``new_group``
  (``eager_connect_single_device``). Otherwise the first operation creates it, and the
  calling thread blocks until every member has called too (``ncclCommInitRank``). A bare
  ``isend``/``irecv`` uses the group's communicator only on torch >= 2.9 and an eager group
  (``pointToPoint``: ``if (eagerInit_)``); before, it creates a two-rank communicator keyed
  by the pair ("For single P2P, preserve the old two-rank behavior"), blocking likewise.
  ``batch_isend_irecv`` always uses the group's communicator.
- Connections. NCCL connects a pair at their first point-to-point on a communicator: the
  first send from a to b blocks a's thread until b makes its first receive from a there,
  and the other way round (``ncclTransportP2pSetup``'s bootstrap exchange). The first
  collective on a communicator blocks until every member calls one (runtime connect).
- ``new_group`` is collective over the world: each rank's k-th call meets the others'.

A thread blocked longer than ``hang_s`` raises ``FakeHang``: a deadlock of the real thing
becomes a test failure here. Every communicator creation and every host synchronization
is recorded with the phase of its rank ("startup" until ``started(rank)``, then "run").
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
import types
from dataclasses import dataclass

import torch

from rrfp.comm.device_ops import CudaOps
from rrfp.comm.nccl_channel import NcclChannel
from rrfp.comm.nccl_groups import require_eager
from rrfp.loop.completions import CompletionPoller


class FakeHang(RuntimeError):
    """A thread waited longer than the world's ``hang_s`` for a peer: the real thing would hang."""


def now() -> float:
    return time.perf_counter()


@dataclass
class Init:
    rank: int
    key: tuple
    phase: str


@dataclass
class Kernel:
    rank: int
    start: float
    end: float
    phase: str


# ---------------------------------------------------------------- device side


class FakeEvent:
    def __init__(self, world: FakeWorld, enable_timing: bool = False) -> None:
        self.world = world
        self.rank: int | None = None  # of the stream it was recorded on
        self.done_at: float | None = None

    def record(self, stream) -> None:
        with self.world.lock:
            stream.items.append(("record", self, now()))
        self.rank = stream.rank

    def query(self) -> bool:
        self.world.advance()
        return self.done_at is not None

    def synchronize(self) -> None:
        self.world.host_sync(self.rank, "event.synchronize")
        self.world.wait_until(self.query, "an event to complete", self.rank)

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.done_at - self.done_at) * 1e3


class FakeStream:
    def __init__(self, world: FakeWorld, rank: int, name: str) -> None:
        self.world, self.rank, self.name = world, rank, name
        self.items: collections.deque = collections.deque()
        self.t = now()  # when the last item run finished
        self.waited: list = []  # every event and Work this stream was made to wait for

    def wait_event(self, event) -> None:
        with self.world.lock:
            self.items.append(("wait", event, now()))
            self.waited.append(event)

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent(self.world)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        event = FakeEvent(self.world)
        event.record(self)
        self.world.host_sync(self.rank, f"stream {self.name}.synchronize")
        self.world.wait_until(event.query, f"stream {self.name} to drain", self.rank)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class Op:
    """One NCCL operation on a communicator: a send, a receive or a collective."""

    def __init__(
        self,
        comm: Comm,
        kind: str,
        rank: int,
        tensor: torch.Tensor,
        peer: int | None = None,
        reduce: str = "sum",
    ) -> None:
        self.comm, self.kind, self.rank, self.tensor, self.peer, self.reduce = (
            comm,
            kind,
            rank,
            tensor,
            peer,
            reduce,
        )
        self.issued_at = now()
        self.posted_at: float | None = None  # reached the head of its stream: the NCCL kernel runs
        self.done_at: float | None = None
        self.error: BaseException | None = None
        self.partners: list[Op] = []


class FakeWork:
    def __init__(self, world: FakeWorld, ops: list[Op]) -> None:
        self.world, self.ops = world, ops

    def is_completed(self) -> bool:
        self.world.advance()
        return all(op.done_at is not None for op in self.ops) or self.exception() is not None

    def exception(self):
        return next((op.error for op in self.ops if op.error is not None), None)

    @property
    def done_at(self) -> float | None:
        times = [op.done_at for op in self.ops]
        return None if None in times else max(times, default=now())

    def wait(self) -> None:
        """As NCCL's: the current stream waits for the work; the host does not."""
        self.world.current[self.ops[0].rank].wait_event(self)

    def get_future(self):
        future = concurrent.futures.Future()  # NCCL completes it at enqueue time
        future.set_result(None)
        return future


class Comm:
    """A communicator: its members, one stream per member, and the ops waiting to match."""

    def __init__(self, world: FakeWorld, key: tuple, members: tuple[int, ...]) -> None:
        self.world, self.key, self.members = world, key, members
        self.streams = {r: FakeStream(world, r, f"nccl{key}@{r}") for r in members}
        self.p2p: dict[tuple, list[list[Op]]] = collections.defaultdict(
            lambda: [[], []]
        )  # (src, dst) -> sends, recvs
        self.collectives: dict[int, list[Op]] = collections.defaultdict(list)
        self.coll_count = collections.Counter()
        self.connected: set = set()  # (src, dst) pairs and "coll"
        self.created_by: set[int] = set()

    def __repr__(self) -> str:
        return f"communicator {self.key}"


# ---------------------------------------------------------------- torch.distributed side


class FakeGroup:
    def __init__(self, index: int, ranks: tuple[int, ...], backend: str, device_id) -> None:
        self.index, self.ranks, self.backend = index, ranks, backend
        self.bound_device_id = device_id
        self.comm: Comm | None = None  # the group's own NCCL communicator, once created
        self.supports_splitting = True

    def _get_backend(self, device):
        return self

    def rank_of(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def __repr__(self) -> str:
        return f"<FakeGroup {self.index} {self.backend} {list(self.ranks)}>"


class P2POp:
    def __init__(self, op, tensor, peer, group=None, tag: int = 0) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class _GlooWork:
    """A gloo collective: done once every member has called it (no device involved)."""

    def __init__(self, world, entry) -> None:
        self.world, self.entry = world, entry

    def is_completed(self) -> bool:
        return self.entry["done"]

    def wait(self) -> None:
        self.world.wait_until(self.is_completed, "a gloo collective", -1)

    def exception(self):
        return None

    def get_future(self):
        future = concurrent.futures.Future()
        self.entry["futures"].append(future)
        if self.entry["done"]:
            future.set_result(None)
        return future


class FakeDist:
    """The torch.distributed functions rrfp calls, as rank ``rank`` (None: the calling thread's)."""

    ReduceOp = types.SimpleNamespace(SUM="sum", MIN="min", MAX="max")
    P2POp = P2POp

    def __init__(self, world: FakeWorld, rank: int | None = None) -> None:
        self.world, self._bound = world, rank

    def _me(self) -> int:
        return self._bound if self._bound is not None else self.world.local.rank

    # -- membership
    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        rank = self._me()
        return rank if group is None else group.rank_of(rank)

    def get_world_size(self, group=None) -> int:
        return self.world.size if group is None else len(group.ranks)

    def get_process_group_ranks(self, group) -> list[int]:
        return list(group.ranks)

    def new_group(
        self,
        ranks=None,
        timeout=None,
        backend=None,
        pg_options=None,
        use_local_synchronization=False,
        group_desc=None,
        device_id=None,
    ):
        return self.world.new_group(self._me(), ranks, backend, device_id)

    # -- point-to-point
    def isend(self, tensor, dst=None, group=None, tag=0):
        return self.world.p2p(self._me(), "send", tensor, dst, group)

    def irecv(self, tensor, src=None, group=None, tag=0):
        return self.world.p2p(self._me(), "recv", tensor, src, group)

    def batch_isend_irecv(self, p2p_op_list):
        rank = self._me()
        works = []
        with self.world.batch(rank):
            for p in p2p_op_list:
                works.append(p.op(p.tensor, p.peer, p.group, p.tag))
        return [FakeWork(self.world, [op for w in works for op in w.ops])]

    # -- collectives
    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        return self.world.all_reduce(self._me(), tensor, op, group, async_op)

    def barrier(self, group=None, async_op=False):
        return self.world.all_reduce(self._me(), torch.zeros(1), "sum", group, async_op)


# ---------------------------------------------------------------- the world


class FakeWorld:
    """Everything the fake ranks share. ``torch_version`` picks the P2P semantics it follows."""

    def __init__(
        self,
        size: int,
        *,
        torch_version: tuple[int, int] = (2, 8),
        hang_s: float = 3.0,
        cycles_per_s: float = 1e10,
    ) -> None:
        self.size, self.torch_version, self.hang_s, self.cycles_per_s = (
            size,
            torch_version,
            hang_s,
            cycles_per_s,
        )
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.local = threading.local()  # the calling thread's rank, for FakeDist(world) without one
        self.phase = {r: "startup" for r in range(size)}
        self.inits: list[Init] = []
        self.host_syncs: list[tuple[int, str, str]] = []
        self.kernels: list[Kernel] = []
        self.sends: list[Op] = []  # every NCCL send, in issue order
        self.streams: list[FakeStream] = []
        self.current = {r: self._stream(r, f"default@{r}") for r in range(size)}
        self._batching = collections.Counter()
        self.groups: list[FakeGroup] = []
        self._group_calls = collections.Counter()
        self.comms: dict[tuple, Comm] = {}
        self._meeting: dict[tuple, set] = collections.defaultdict(set)
        self._gloo: dict[tuple, dict] = {}
        self._gloo_count = collections.Counter()
        self._issued = collections.Counter()
        self.failures: dict[
            tuple[int, str, int], BaseException
        ] = {}  # (rank, kind, n-th op of it): its error
        self.dist = FakeDist(self)  # for module-level patches: the calling thread's rank

    def enter(self, rank: int) -> None:
        """Bind the calling thread to ``rank`` (for ``self.dist``)."""
        self.local.rank = rank

    def started(self, rank: int) -> None:
        """From now on, a communicator made or a host sync on ``rank`` is a finding."""
        self.phase[rank] = "run"

    def after_startup(self, records) -> list:
        return [r for r in records if (r.phase if hasattr(r, "phase") else r[1]) == "run"]

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        before, self.current[stream.rank] = self.current[stream.rank], stream
        try:
            yield
        finally:
            self.current[stream.rank] = before

    @contextlib.contextmanager
    def batch(self, rank: int):
        self._batching[rank] += 1
        try:
            yield
        finally:
            self._batching[rank] -= 1

    def host_sync(self, rank: int, what: str) -> None:
        self.host_syncs.append((rank, self.phase.get(rank, "?"), what))

    def _stream(self, rank: int, name: str) -> FakeStream:
        s = FakeStream(self, rank, name)
        self.streams.append(s)
        return s

    def new_stream(self, rank: int) -> FakeStream:
        return self._stream(rank, f"s{len(self.streams)}@{rank}")

    def kernel(self, rank: int, seconds: float) -> None:
        stream = self.current[rank]
        with self.lock:
            stream.items.append(("kernel", seconds, now()))

    def wait_until(self, ready, what: str, rank: int) -> None:
        """Block this thread until ``ready()``; longer than ``hang_s`` is a FakeHang."""
        deadline = now() + self.hang_s
        while not ready():
            if now() > deadline:
                raise FakeHang(f"rank {rank} waited {self.hang_s:g} s for {what}")
            time.sleep(0.0002)

    def _meet(self, rank: int, key, members, what: str) -> None:
        """Block until every one of ``members`` has called with ``key``."""
        with self.cond:
            arrived = self._meeting[key]
            arrived.add(rank)
            self.cond.notify_all()
            deadline = now() + self.hang_s
            while not arrived >= set(members):
                left = deadline - now()
                if left <= 0:
                    missing = sorted(set(members) - arrived)
                    raise FakeHang(
                        f"rank {rank} blocked {self.hang_s:g} s {what}, waiting for rank(s) "
                        f"{missing} to do the same (phase {self.phase[rank]})"
                    )
                self.cond.wait(left)

    # -- groups and communicators
    def new_group(self, rank: int, ranks, backend, device_id) -> FakeGroup:
        k = self._group_calls[rank]
        self._group_calls[rank] += 1
        ranks = tuple(range(self.size)) if ranks is None else tuple(sorted(ranks))
        backend = backend or "nccl"
        with self.lock:
            if k == len(self.groups):
                self.groups.append(FakeGroup(k, ranks, backend, device_id))
            group = self.groups[k]
            if (group.ranks, group.backend) != (ranks, backend):
                raise AssertionError(
                    f"rank {rank}: new_group call {k} asks for {backend} {list(ranks)}, another "
                    f"rank's for {group.backend} {list(group.ranks)}: not one global order"
                )
        self._meet(rank, ("new_group", k), range(self.size), f"in new_group call {k}")
        if (
            backend == "nccl"
            and device_id is not None
            and group.supports_splitting
            and rank in ranks
        ):
            self._communicator(rank, ("group", k), ranks)  # eager_connect_single_device
        return group

    def _communicator(self, rank: int, key: tuple, members: tuple[int, ...]) -> Comm:
        """The communicator ``key``; created now if this rank has none yet, and then the
        thread blocks until every member creates it too (ncclCommInitRank is collective)."""
        with self.lock:
            comm = self.comms.get(key)
            if comm is not None and rank in comm.created_by:
                return comm
        self._meet(rank, key, members, f"creating NCCL communicator {key}")
        with self.lock:
            comm = self.comms.setdefault(key, Comm(self, key, members))
            comm.created_by.add(rank)
            self.inits.append(Init(rank, key, self.phase[rank]))
            return comm

    def p2p(
        self, rank: int, kind: str, tensor: torch.Tensor, peer: int, group: FakeGroup
    ) -> FakeWork:
        assert group.backend == "nccl", f"{kind} on a {group.backend} group"
        batched = self._batching[rank] > 0
        if batched or (self.torch_version >= (2, 9) and group.bound_device_id is not None):
            comm = self._communicator(rank, ("group", group.index), group.ranks)
        else:  # a bare P2P op in lazy mode, or before torch 2.9: a two-rank communicator of its own
            lo, hi = sorted((rank, peer))
            comm = self._communicator(rank, ("pair", group.index, lo, hi), (lo, hi))
        src, dst = (rank, peer) if kind == "send" else (peer, rank)
        if (
            src,
            dst,
            rank,
        ) not in comm.connected:  # the pair's first P2P here: NCCL connects it, blocking
            self._meet(
                rank,
                (comm.key, src, dst),
                (src, dst),
                f"connecting {src}->{dst} on NCCL {comm.key}",
            )
            comm.connected.add((src, dst, rank))
        return self._enqueue(rank, comm, Op(comm, kind, rank, tensor, peer))

    def all_reduce(self, rank: int, tensor, reduce, group, async_op):
        group = group or self.groups[0]
        if group.backend == "gloo":
            return self._gloo_all_reduce(rank, tensor, reduce, group, async_op)
        comm = self._communicator(rank, ("group", group.index), group.ranks)
        if (
            "coll",
            rank,
        ) not in comm.connected:  # runtime connect: the first collective meets every member
            self._meet(
                rank,
                (comm.key, "coll"),
                comm.members,
                f"connecting NCCL {comm.key} for collectives",
            )
            comm.connected.add(("coll", rank))
        work = self._enqueue(rank, comm, Op(comm, "coll", rank, tensor, reduce=reduce))
        if not async_op:  # CPU code reads the result at once: the fake must produce it now
            self.wait_until(work.is_completed, f"all_reduce on {comm}", rank)
            return None
        return work

    def _gloo_all_reduce(self, rank: int, tensor, reduce, group, async_op):
        with self.lock:
            n = self._gloo_count[(group.index, rank)]
            self._gloo_count[(group.index, rank)] += 1
            entry = self._gloo.setdefault(
                (group.index, n), {"tensors": {}, "done": False, "futures": []}
            )
            entry["tensors"][rank] = tensor
            if len(entry["tensors"]) == len(group.ranks):
                _reduce(list(entry["tensors"].values()), reduce)
                entry["done"] = True
                for f in entry["futures"]:
                    f.set_result(None)
        work = _GlooWork(self, entry)
        if not async_op:
            work.wait()
            return None
        return work

    def _enqueue(self, rank: int, comm: Comm, op: Op) -> FakeWork:
        """As ProcessGroupNCCL: the comm stream waits for the issuing stream, then runs the op."""
        issuing, nccl = self.current[rank], comm.streams[rank]
        op.gated_by = (
            issuing.waited[-1] if issuing.waited else None
        )  # the last event its stream waited for
        n = self._issued[(rank, op.kind)]
        self._issued[(rank, op.kind)] += 1
        op.error = self.failures.get((rank, op.kind, n))  # e.g. the peer's process is gone
        gate = FakeEvent(self)
        gate.record(issuing)
        op.gate = gate  # the issuing stream as it was when the op was issued
        with self.lock:
            nccl.wait_event(gate)
            if op.kind == "coll":
                n = comm.coll_count[rank]
                comm.coll_count[rank] += 1
                comm.collectives[n].append(op)
                op.partners = comm.collectives[n]
            else:
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                sends, recvs = comm.p2p[(src, dst)]
                mine = sends if op.kind == "send" else recvs
                op.seq = len(mine)
                mine.append(op)
                if op.kind == "send":
                    self.sends.append(op)
            nccl.items.append(("nccl", op, now()))
        return FakeWork(self, [op])

    # -- running the device
    def advance(self) -> None:
        """Run every stream as far as the clock allows, until nothing moves."""
        with self.lock:
            t = now()
            moved = True
            while moved:
                moved = False
                for s in self.streams + [
                    st for c in self.comms.values() for st in c.streams.values()
                ]:
                    while s.items and self._step(s, t):
                        moved = True

    def _step(self, s: FakeStream, t: float) -> bool:
        what, item, enqueued = s.items[0]
        start = max(s.t, enqueued)
        if what == "kernel":
            end = start + item
            if end > t:
                return False
            self.kernels.append(Kernel(s.rank, start, end, self.phase[s.rank]))
            s.t = end
        elif what == "wait":
            done = item.done_at
            if done is None:
                return False
            s.t = max(start, done)
        elif what == "record":
            item.done_at = start
            s.t = start
        elif what == "call":
            item()
            s.t = start
        elif what == "nccl":
            if item.posted_at is None:
                item.posted_at = start
            done = item.posted_at if item.error is not None else self._match(item)
            if done is None:
                return False
            s.t = done
        s.items.popleft()
        return True

    def _match(self, op: Op) -> float | None:
        """When ``op`` completes, once its partners have all been posted; moves the data then."""
        if op.done_at is not None:
            return op.done_at
        comm = op.comm
        if op.kind == "coll":
            group = op.partners
            if len(group) < len(comm.members) or any(p.posted_at is None for p in group):
                return None
            _reduce([p.tensor for p in group], op.reduce)
            done = max(p.posted_at for p in group)
            for p in group:
                p.done_at = done
            return done
        src, dst = (op.rank, op.peer) if op.kind == "send" else (op.peer, op.rank)
        sends, recvs = comm.p2p[(src, dst)]
        other = recvs if op.kind == "send" else sends
        if len(other) <= op.seq or other[op.seq].posted_at is None:
            return None
        send, recv = (op, other[op.seq]) if op.kind == "send" else (other[op.seq], op)
        if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
            err = RuntimeError(
                f"NCCL {comm.key}: send of {send.tensor.dtype}{list(send.tensor.shape)} met a "
                f"receive of {recv.tensor.dtype}{list(recv.tensor.shape)}"
            )
            send.error = recv.error = err
        else:
            recv.tensor.copy_(send.tensor)
        done = max(send.posted_at, recv.posted_at)
        send.done_at = recv.done_at = done
        return done

    # -- per-rank views
    def dist_for(self, rank: int) -> FakeDist:
        return FakeDist(self, rank)

    def torch_for(self, rank: int):
        """What CudaComputeLane uses of torch, on ``rank``'s fake device."""
        world = self
        cuda = types.SimpleNamespace(
            is_available=lambda: True,
            Stream=lambda device=None: world.new_stream(rank),
            Event=lambda enable_timing=False: FakeEvent(world, enable_timing),
            device=lambda d: contextlib.nullcontext(),
            stream=world.use_stream,
            current_stream=lambda device=None: world.current[rank],
            _sleep=lambda cycles: world.kernel(rank, cycles / world.cycles_per_s),
        )
        return types.SimpleNamespace(cuda=cuda, device=torch.device)


def _reduce(tensors: list[torch.Tensor], how: str) -> None:
    stacked = torch.stack([t.detach().clone() for t in tensors])
    result = {"sum": stacked.sum(0), "min": stacked.min(0).values, "max": stacked.max(0).values}[
        how
    ]
    for t in tensors:
        t.copy_(result)


class FakeCudaOps(CudaOps):
    """CudaOps on ``rank``'s fake device: the CUDA calls are faked here; the NCCL calls
    (``isend``, ``irecv``: how CudaOps issues them) are CudaOps' own, against FakeDist."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        super().__init__("cuda:0", dist_module=world.dist_for(rank))
        self.world, self.rank = world, rank

    def new_stream(self):
        return self.world.new_stream(self.rank)

    def stream(self, stream):
        return self.world.use_stream(stream)

    def record_event(self, stream):
        event = FakeEvent(self.world)
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor, stream) -> None:
        pass

    def pinned(self, host):
        return host.clone()

    def to_device(self, host):
        return host.clone()

    def to_host(self, device_tensor, host) -> None:
        stream = self.world.current[self.rank]
        with self.world.lock:
            stream.items.append(("call", lambda: host.copy_(device_tensor), now()))

    def empty(self, shape, dtype):
        return torch.full(tuple(shape), 7, dtype=dtype)  # garbage until something fills it


def run_ranks_in_threads(world: FakeWorld, main, timeout: float = 60.0) -> dict[int, object]:
    """Run ``await main(rank)`` on its own event loop in one thread per rank; {rank: result}.
    The first rank that raised re-raises here (a FakeHang: the real thing would hang)."""
    results, errors = {}, {}

    def body(rank: int) -> None:
        world.enter(rank)
        try:
            results[rank] = asyncio.run(main(rank))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors[rank] = e

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fake-rank-{r}", daemon=True)
        for r in range(world.size)
    ]
    for t in threads:
        t.start()
    deadline = now() + timeout
    for t in threads:
        t.join(max(0.0, deadline - now()))
    if errors:
        hangs = {r: h for r, e in errors.items() if (h := _hang_in(e)) is not None}
        if hangs:
            rank, hang = min(hangs.items())
            raise hang from errors[rank]
        raise min(errors.items())[1]
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        raise AssertionError(f"{alive} still running after {timeout} s")
    return results


def _hang_in(e: BaseException | None) -> FakeHang | None:
    """The FakeHang that ``e`` is, contains or was caused by, if any."""
    while e is not None:
        if isinstance(e, FakeHang):
            return e
        if isinstance(e, BaseExceptionGroup):
            return next((h for x in e.exceptions if (h := _hang_in(x)) is not None), None)
        e = e.__cause__ or e.__context__
    return None


def restore_late_sends(monkeypatch) -> None:
    """Mutation: rebuild the send timing from before the fix. The lane hands no producer event, so
    the channel records its gate when the send coroutine runs, and the executor does not yield
    after a task, so that coroutine runs only once the next task has been enqueued."""
    import rrfp.pipeline.executor as executor_module
    from rrfp.loop.lane import CudaComputeLane

    monkeypatch.setattr(CudaComputeLane, "last_task_done", property(lambda self: None))
    real_sleep = asyncio.sleep

    async def sleep_without_yield(delay, result=None):
        if delay > 0:
            return await real_sleep(delay, result)

    without_yield = types.SimpleNamespace(
        **{k: getattr(asyncio, k) for k in dir(asyncio) if not k.startswith("__")}
    )
    without_yield.sleep = sleep_without_yield
    monkeypatch.setattr(executor_module, "asyncio", without_yield)


def connected_pair(world: FakeWorld | None = None, deadline_s: float | None = None):
    """(tx on rank 0, rx on rank 1, world, poller): a channel 0 -> 1 made and warmed as at start."""
    world = world or FakeWorld(2)
    poller = CompletionPoller(spin_rounds=4, backoff_s=1e-4, max_backoff_s=1e-3)
    ends = {}

    def start(rank: int) -> None:
        dist = world.dist_for(rank)
        group = dist.new_group([0, 1], backend="nccl", device_id=DEVICE)
        require_eager(group, DEVICE, "channel fwd 0->1", rank)
        ch = NcclChannel(
            "fwd 0->1",
            rank,
            1 - rank,
            group,
            outbound=rank == 0,
            ops=FakeCudaOps(world, rank),
            poller=poller,
            compute_stream=world.new_stream(rank),
            deadline_s=deadline_s,
        )
        ch.warm_up()
        ends[rank] = ch

    threads = [threading.Thread(target=start, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert set(ends) == {0, 1}, "start-up did not finish"
    return ends[0], ends[1], world, poller


DEVICE = torch.device("cuda", 0)
