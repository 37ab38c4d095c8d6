"""One stage's pipeline iteration: receivers, senders and the arbiter, all owned
by one TaskGroup. ``ready`` and ``fixed`` differ only in the policy call."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .budget import Budget
from .comm.message import Message
from .errors import PeerTimeout, ProtocolError
from .hints import Hint
from .instrument import Instrument
from .policy import Executor, Limit, StageState, choose
from .stage import StageWorker
from .tasks import Kind, Task, last_backward
from .variability import Variability

log = logging.getLogger("rrfp.executor")


@dataclass(frozen=True)
class ExecutorSettings:
    executor: Executor
    hint: Hint
    budget: Budget
    split: bool
    num_microbatches: int
    variability: Variability = field(default_factory=Variability)
    seed: int = 0
    peer_timeout_s: float = 60.0


@dataclass
class IterationResult:
    iteration: int
    losses: dict[int, float]  # last stage only
    wall_s: float
    busy_s: float
    peak_inflight: int
    decisions: int
    decision_s: float  # time spent in the policy
    order: list[Task]  # tasks in the order this stage ran them
    tokens: int

    @property
    def bubble(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def loss(self) -> float | None:
        return sum(self.losses.values()) / len(self.losses) if self.losses else None


class StageExecutor:
    """Runs one stage of the pipeline, one iteration per ``run_iteration`` call.

    ``channels`` has ``fwd_in``, ``fwd_out``, ``bwd_in``, ``bwd_out`` (None at the
    ends); ``lane`` has ``async run(fn, *args, units=)``.
    """

    def __init__(self, worker: StageWorker, channels, lane, settings: ExecutorSettings, rank: int = 0,
                 instrument: Instrument | None = None, unit_s: float = 0.0, agreement=None) -> None:
        self.worker, self.channels, self.lane, self.settings = worker, channels, lane, settings
        # TP agreement (tp > 1, ready executor only): the fixed order needs none.
        self.agreement = agreement if settings.executor is Executor.READY else None
        self.rank, self.instrument, self.unit_s = rank, instrument, unit_s  # None: observe nothing
        S, s, M = worker.num_stages, worker.stage, settings.num_microbatches
        self.S, self.s, self.M = S, s, M
        self.order = settings.hint.order(S, s, M, settings.split)
        self.rank_of = settings.hint.rank(S, s, M, settings.split)
        self.limit = Limit(count=settings.budget.microbatches(S, s), bytes=settings.budget.bytes)
        self._bytes_per_token = 0.0
        self.totals = {"iterations": 0, "decisions": 0, "decision_s": 0.0, "peak_inflight": 0,
                       "busy_s": 0.0, "wall_s": 0.0}

    def statistics(self) -> dict:
        """Snapshot across iterations so far."""
        t = dict(self.totals)
        t["decision_us"] = 1e6 * t["decision_s"] / t["decisions"] if t["decisions"] else 0.0
        t["bubble"] = max(0.0, 1.0 - t["busy_s"] / t["wall_s"]) if t["wall_s"] > 0 else 0.0
        return t

    async def run_iteration(self, iteration: int, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                            ) -> IterationResult:
        """Run every task of this stage for one iteration. Gradients accumulate
        in the stage's parameters (mean over microbatches); the caller steps."""
        if len(batches) != self.M:
            raise ValueError(f"stage {self.s}: got {len(batches)} microbatches, configured for {self.M}")
        run = _Iteration(self, iteration, batches)
        return await run.execute()


class _Iteration:
    """State of one iteration on one stage."""

    def __init__(self, ex: StageExecutor, iteration: int, batches) -> None:
        self.ex, self.it, self.batches = ex, iteration, batches
        self.ready: set[Task] = set()
        self.state = StageState()
        self.changed = asyncio.Event()
        self.acts: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.f_done: set[int] = set()
        self.sizes: dict[int, int] = {}
        self.ran: list[Task] = []
        self.losses: dict[int, float] = {}
        self.busy = 0.0
        self.decisions = 0
        self.decision_s = 0.0
        self.arrived: dict[Kind, int] = {Kind.F: 0, Kind.B: 0}
        self.out_queues: dict[str, asyncio.Queue] = {}
        if ex.s == 0:
            self.ready.update(Task(Kind.F, m) for m in range(ex.M))

    @property
    def version(self) -> int:
        """Grows with every arrival: tells the arbiter whether anything came in."""
        return self.arrived[Kind.F] + self.arrived[Kind.B]

    def size_of(self, mb: int) -> int:
        return int(self.batches[mb][0].numel() * self.ex._bytes_per_token)

    async def execute(self) -> IterationResult:
        ex, ch = self.ex, self.ex.channels
        ex.worker.reset()
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for name, channel in (("fwd_in", ch.fwd_in), ("bwd_in", ch.bwd_in)):
                if channel is not None:
                    tg.create_task(self._receive(channel, Kind.F if name == "fwd_in" else Kind.B),
                                   name=f"rrfp-recv-{name}")
            for name, channel in (("fwd_out", ch.fwd_out), ("bwd_out", ch.bwd_out)):
                if channel is not None:
                    q: asyncio.Queue = asyncio.Queue()
                    self.out_queues[name] = q
                    tg.create_task(self._send(channel, q), name=f"rrfp-send-{name}")
            await self._arbitrate()
        wall = time.perf_counter() - t0
        tot = ex.totals
        tot["iterations"] += 1
        tot["decisions"] += self.decisions
        tot["decision_s"] += self.decision_s
        tot["peak_inflight"] = max(tot["peak_inflight"], self.state.peak_inflight)
        tot["busy_s"] += self.busy
        tot["wall_s"] += wall
        tokens = sum(int(b[1].numel()) for b in self.batches)
        return IterationResult(self.it, self.losses, wall, self.busy, self.state.peak_inflight,
                               self.decisions, self.decision_s, self.ran, tokens)

    # -- the arbiter ---------------------------------------------------------

    async def _arbitrate(self) -> None:
        ex, st = self.ex, self.settings
        size_of = self.size_of if ex.limit.bytes is not None else None
        while len(self.ran) < len(ex.order):
            c0 = time.perf_counter()
            version = self.version
            if ex.agreement is None:
                task = choose(st.executor, self.ready, ex.rank_of, ex.order, self.state, ex.limit, size_of)
            else:
                everywhere, somewhere = await ex.agreement.agree(self.ready)
                task = choose(st.executor, everywhere, ex.rank_of, ex.order, self.state, ex.limit, size_of)
            self.decision_s += time.perf_counter() - c0
            self.decisions += 1
            if task is None:
                if ex.agreement is not None and (self.version != version or
                                                 (self.ready >= somewhere and somewhere != everywhere)):
                    continue  # something arrived meanwhile, or only a peer lags: agree again now
                await self._wait_for_change(version)
                continue
            self.ready.discard(task)
            self.state.next_index += 1
            await self._run(task)

    @property
    def settings(self) -> ExecutorSettings:
        return self.ex.settings

    async def _wait_for_change(self, version: int) -> None:
        self.changed.clear()
        if self.version != version:
            return
        start = time.time()
        try:
            async with asyncio.timeout(self.settings.peer_timeout_s):
                await self.changed.wait()
        except TimeoutError:
            raise PeerTimeout(f"rank {self.ex.rank} stage {self.ex.s}: iteration {self.it}: nothing arrived for "
                              f"{self.settings.peer_timeout_s:g} s while waiting for {self._waiting_for()}") from None
        if self.ex.instrument is not None:
            self.ex.instrument.wait(self.ex.s, self.it, start, time.time(), self._waiting_for())

    def _waiting_for(self) -> str:
        ex, ch = self.ex, self.ex.channels
        if self.settings.executor is Executor.FIXED:
            nxt = ex.order[self.state.next_index]
            src = ch.fwd_in if nxt.kind is Kind.F else ch.bwd_in
            return f"{nxt}" + (f" on channel {src.name} (peer rank {src.peer})" if src is not None else "")
        parts = []
        for kind, channel in ((Kind.F, ch.fwd_in), (Kind.B, ch.bwd_in)):
            if channel is not None and self.arrived[kind] < ex.M:
                parts.append(f"{kind.name}{self.arrived[kind]} on channel {channel.name} (peer rank {channel.peer})")
        return " or ".join(parts) or "a local task"

    async def _run(self, task: Task) -> None:
        ex, st, w, mb = self.ex, self.settings, self.ex.worker, task.mb
        units = st.variability.duration(st.seed, self.it, ex.s, mb, task.kind, st.split) if ex.unit_s else 0.0
        start = time.time()
        c0 = time.perf_counter()
        if task.kind is Kind.F:
            size = self.size_of(mb)
            self.sizes[mb] = size
            self.state.admit(size)
            x = self.batches[mb][0] if ex.s == 0 else self.acts.pop(mb)
            targets = self.batches[mb][1] if ex.s == ex.S - 1 else None
            out = await ex.lane.run(w.forward, mb, x, targets, units=units)
            self.f_done.add(mb)
            if ex.limit.bytes is not None:
                measured = w.activation_bytes(mb) / max(1, self.batches[mb][0].numel())
                ex._bytes_per_token = max(ex._bytes_per_token, measured)
            if ex.s == ex.S - 1:
                self.losses[mb] = out
                self.ready.add(Task(Kind.B, mb))
            else:
                self._post("fwd_out", Message(self.it, mb, int(Kind.F), [out]))
        elif task.kind is Kind.B:
            grad = None if ex.s == ex.S - 1 else self.grads.pop(mb)
            grad_in = await ex.lane.run(w.backward, mb, grad, units=units)
            if ex.s > 0:
                self._post("bwd_out", Message(self.it, mb, int(Kind.B), [grad_in]))
            if st.split:
                self.ready.add(Task(Kind.W, mb))
        else:
            await ex.lane.run(w.weight, mb, units=units)
        if task.kind is last_backward(st.split):
            self.state.release(self.sizes.pop(mb))
        self.busy += time.perf_counter() - c0
        self.ran.append(task)
        if ex.instrument is not None:
            ex.instrument.task(ex.s, self.it, task, start, time.time())

    # -- communication -------------------------------------------------------

    def _post(self, name: str, msg: Message) -> None:
        latency = self.settings.variability.latency(self.settings.seed, self.it, self.ex.s, msg.microbatch,
                                                    msg.kind) * self.ex.unit_s
        self.out_queues[name].put_nowait((time.perf_counter() + latency, msg))

    async def _send(self, channel, queue: asyncio.Queue) -> None:
        for _ in range(self.ex.M):
            due, msg = await queue.get()
            delay = due - time.perf_counter()
            if delay > 0:  # emulated link latency
                await asyncio.sleep(delay)
            await channel.send(msg)

    async def _receive(self, channel, kind: Kind) -> None:
        for _ in range(self.ex.M):
            msg = await channel.recv()
            mb = msg.microbatch
            where = f"rank {self.ex.rank} stage {self.ex.s}: channel {channel.name} (peer rank {channel.peer})"
            if msg.iteration != self.it or msg.kind != int(kind) or not 0 <= mb < self.ex.M or len(msg.tensors) != 1:
                raise ProtocolError(f"{where}: expected a {kind.name} message of iteration {self.it}, got "
                                    f"iteration {msg.iteration} kind {msg.kind} microbatch {mb} "
                                    f"with {len(msg.tensors)} tensor(s)")
            inbox = self.acts if kind is Kind.F else self.grads
            if mb in inbox or (kind is Kind.F and mb in self.f_done):
                raise ProtocolError(f"{where}: microbatch {mb} arrived twice in iteration {self.it}")
            inbox[mb] = msg.tensors[0]
            self.arrived[kind] += 1
            if kind is Kind.F:
                self.ready.add(Task(Kind.F, mb))
            elif mb in self.f_done:
                self.ready.add(Task(Kind.B, mb))
            self.changed.set()
