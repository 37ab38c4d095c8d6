"""`make gpu-check`: what one GPU allows of rrfp's CUDA/NCCL path, one line per check:
its figures, FAILED, or SKIPPED and why. At most 8 minutes on one H200.

NCCL refuses two ranks on one device, so the checks are what one device allows:

1. lane        a bf16 GPT block's F, B and W (0.2-10 ms) through the executor on a CUDA
               lane: device idle gaps (p50, p99), idle share, host decision and enqueue time
               against kernel time;
2. poller      how late the loop's poller notices events that finish 0.1-5 ms after they are
               watched, and what a poll round costs with 1, 8 and 32 handles pending;
3. loopback    two stages in one process over the real channel code (NcclChannel) with a
               loopback transport on the device: per-hop latency from a producer's end event
               to the consumer's data, and gradients against a single-process reference;
4. nccl-init   NCCL at world size 1 with NCCL_DEBUG=INFO: communicator inits counted, none
               after start-up;
5. memory      peak allocated and reserved memory of a pp=1 run against the prediction from
               the model, the optimizer and the in-flight budget;
6. train       `rrfp train` pp=1 on CUDA against a single-process reference, and a run resumed
               from a checkpoint against an uninterrupted one, losses compared as exact floats;
7. virtual     `rrfp train` pp=1 with two stages on the one rank (virtual = 2: the CUDA lane runs
               both, the hand-off between them is local) against the same reference;
8. pp=2        over NCCL, on a machine with two GPUs, with one stage per rank and with two in
               the v shape.

It is a script, not part of `make test`: a test that only ever skips proves nothing. What each
check computes also runs in the suite on the fake CUDA/NCCL of tests/harness/fake_cuda.py
(tests/house/test_gpu_check.py). Exit status: non-zero when a check that ran failed.

    .venv/bin/python benchmarks/gpu_check.py [--steps 20] [--only lane,poller]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = str(ROOT / "configs" / "gpt-tiny.toml")
CHECKS = (
    "lane",
    "poller",
    "loopback",
    "nccl-init",
    "memory",
    "train",
    "calibrate",
    "virtual",
    "pp=2",
)
CPU_PART = {  # where each check's device-independent part runs in the suite
    "lane": "tests/house/test_gpu_check.py, on the fake CUDA",
    "poller": "tests/house/test_gpu_check.py, on the fake CUDA",
    "loopback": "tests/house/test_gpu_check.py, on the fake CUDA",
    "nccl-init": "tests/house/test_gpu_check.py (the log count) and "
    "tests/pipeline/test_gpu_path.py (no communicator after start-up, fake NCCL)",
    "memory": "tests/house/test_gpu_check.py (the prediction)",
    "train": "tests/app/train/test_checkpoint.py (a resumed run repeats the losses bit for bit, "
    "gloo)",
    "calibrate": "tests/sim/test_plan_inputs.py (the device a CUDA run calibrates on)",
    "virtual": "tests/house/test_gpu_check.py (the same run on gloo) and "
    "tests/pipeline/test_virtual_pipeline.py",
    "pp=2": "tests/pipeline/test_gpu_path.py (pp=2, and V = 2 in both placements, over the fake "
    "NCCL) and the gloo suite",
}
STARTUP_MARK = "RRFP-GPU-CHECK: start-up done"
results: list[tuple[str, str, str]] = []  # (check, ok | FAILED | SKIPPED, detail)


def report(name: str, status: str, detail: str) -> None:
    results.append((name, status, detail))
    print(f"[{status:>7}] {name}: {detail}", flush=True)


def check(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        report(name, "ok", f"{detail} ({time.perf_counter() - t0:.0f} s)")
    except Exception as e:  # a failed check is reported, and the others still run
        report(name, "FAILED", f"{type(e).__name__}: {e}")


def quantile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


@dataclass
class Device:
    """Where a check runs: the real GPU, or (in the suite) the fake one of
    tests/harness/fake_cuda.py."""

    torch: Any  # what the lane calls torch
    device: Any  # torch.device
    ops: Any  # rrfp.comm.device_ops.CudaOps, or the fake's
    dtype: Any
    new_event: Callable[[], Any]  # a timing event
    place: Callable[[Any], Any]  # a module or tensor, on the device


def cuda_device(dtype=None) -> Device:
    import torch

    from rrfp.comm.device_ops import CudaOps

    device = torch.device("cuda", 0)
    return Device(
        torch,
        device,
        CudaOps(device),
        dtype or torch.bfloat16,
        lambda: torch.cuda.Event(enable_timing=True),
        lambda x: x.to(device),
    )


# ---------------------------------------------------------------- 1. the lane


def _squared_error(out, target):
    return (out.float() - target.float()).pow(2).mean()


def stage_executor(
    module,
    stage: int,
    stages: int,
    lane,
    channels,
    n_microbatches: int,
    *,
    split: bool = True,
    hint: str = "bfw",
    unit_s: float = 0.0,
    loss_fn=_squared_error,
    measure_activations=False,
):
    from rrfp.core.budget import Budget
    from rrfp.core.hints import resolve
    from rrfp.core.policy import Dispatch
    from rrfp.core.variability import Variability
    from rrfp.pipeline.executor import StageExecutor
    from rrfp.pipeline.schedule_settings import ScheduleSettings
    from rrfp.pipeline.worker import StageWorker

    worker = StageWorker(
        module,
        stage,
        stages,
        n_microbatches,
        loss_fn,
        split,
        measure_activations=measure_activations,
    )
    settings = ScheduleSettings(
        n_microbatches,
        Dispatch.READY,
        resolve(hint),
        Budget.parse("2x"),
        split,
        Variability(comm=0.0),
    )
    return StageExecutor(worker, channels, lane, settings, unit_s=unit_s)


async def lane_figures(
    dev: Device,
    *,
    n_embd: int = 1024,
    n_head: int = 16,
    lengths=(128, 512, 1024, 2048, 4096, 8192),
    iterations: int = 3,
    unit_ms: float = 0.0,
) -> dict:
    """F, B and W of one GPT block, microbatches of the given lengths, via the ready executor."""
    import torch

    from rrfp.comm.pipeline_channels import PipelineChannels
    from rrfp.loop import CompletionPoller, CudaComputeLane
    from rrfp.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    block = dev.place(
        Block(GPTConfig(n_embd=n_embd, n_head=n_head, block_size=max(lengths))).to(dev.dtype)
    )
    batches = [
        (
            dev.place(torch.randn(1, t, n_embd, dtype=dev.dtype)),
            dev.place(torch.zeros(1, t, n_embd)),
        )
        for t in lengths
    ]
    async with CompletionPoller() as poller:
        lane = CudaComputeLane(poller, dev.device, unit_ms / 1e3, torch_module=dev.torch)
        ex = stage_executor(
            block, 0, 1, lane, PipelineChannels(0), len(batches), unit_s=unit_ms / 1e3
        )
        for it in range(iterations):
            if it == 1:  # the first iteration pays one-time costs (kernel selection, allocator)
                tasks, gaps, enqueue, decisions = (
                    len(lane.task_s),
                    len(lane.gaps_s),
                    lane.enqueue_s,
                    ex.totals,
                )
            res = await ex.run_iteration(it, batches)
            block.zero_grad(set_to_none=True)
        await lane.drain()
    task_s, gaps_s = lane.task_s[tasks:], lane.gaps_s[gaps:]
    stats = ex.totals
    n_decisions = stats.decisions - decisions.decisions
    kinds = collections.defaultdict(list)
    for task, d in zip(res.order * (iterations - 1), task_s):
        kinds[task.kind.name].append(d)
    return {
        "tasks": len(task_s),
        "gap_p50_us": quantile(gaps_s, 0.5) * 1e6,
        "gap_p99_us": quantile(gaps_s, 0.99) * 1e6,
        "idle_share": sum(gaps_s) / max(1e-12, sum(gaps_s) + sum(task_s)),
        "kernel_ms_per_task": 1e3 * sum(task_s) / len(task_s),
        "enqueue_ms_per_task": 1e3 * (lane.enqueue_s - enqueue) / len(task_s),
        "decision_us": 1e6 * (stats.decision_s - decisions.decision_s) / max(1, n_decisions),
        "kind_ms": {k: (1e3 * min(v), 1e3 * max(v)) for k, v in sorted(kinds.items())},
        "loss": res.loss,
    }


def lane_line(f: dict) -> str:
    kinds = ", ".join(f"{k} {lo:.2f}-{hi:.2f} ms" for k, (lo, hi) in f["kind_ms"].items())
    return (
        f"{f['tasks']} tasks ({kinds}): device idle gaps p50 {f['gap_p50_us']:.0f} us, p99 "
        f"{f['gap_p99_us']:.0f} us, idle share {f['idle_share']:.1%}; host per task: enqueue "
        f"{f['enqueue_ms_per_task']:.2f} ms against {f['kernel_ms_per_task']:.2f} ms of kernels, "
        f"decision {f['decision_us']:.0f} us"
    )


# ---------------------------------------------------------------- 2. the poller


async def poller_figures(
    dev: Device, delays_ms=(0.1, 0.3, 1.0, 3.0, 5.0), pending=(1, 8, 32), repeats: int = 10
) -> dict:
    """Detection delay: host time at which the poller's future is done, minus the event's end
    (enqueue time plus the kernel's device time; the kernel starts at once on an idle stream)."""
    from rrfp.loop import CompletionPoller, CudaComputeLane

    async with CompletionPoller() as poller:
        lane = CudaComputeLane(
            poller, dev.device, 1e-3, torch_module=dev.torch
        )  # calibrates the spin kernel
        cycles_per_s = lane._sleep_cycles_per_s
        cuda = dev.torch.cuda
        stream = cuda.Stream(device=dev.device)

        async def detection(ms: float) -> float:
            with cuda.stream(stream):
                start, end = dev.new_event(), dev.new_event()
                start.record(stream)
                cuda._sleep(int(ms * 1e-3 * cycles_per_s))
                end.record(stream)
            t0 = time.perf_counter()
            await poller.watch(end)
            return time.perf_counter() - (t0 + start.elapsed_time(end) / 1e3)

        delays = {ms: [await detection(ms) for _ in range(repeats)] for ms in delays_ms}
        rounds = {}
        poll_once = poller._poll_once
        for n in pending:
            other = cuda.Stream(device=dev.device)
            with cuda.stream(other):  # n handles that stay pending while we measure
                cuda._sleep(int(0.5 * cycles_per_s))
                long = [dev.new_event() for _ in range(n)]
                for e in long:
                    e.record(other)
            watched = [poller.watch(e) for e in long]
            spent, calls = 0.0, 0

            def timed():
                nonlocal spent, calls
                t = time.perf_counter()
                try:
                    return poll_once()
                finally:
                    spent += time.perf_counter() - t
                    calls += 1

            poller._poll_once = timed
            one_ms = [await detection(1.0) for _ in range(repeats)]
            poller._poll_once = poll_once
            rounds[n] = (1e6 * spent / max(1, calls), quantile(one_ms, 0.5))
            await asyncio.gather(*watched)
    return {
        "delay_us": {
            ms: (1e6 * quantile(v, 0.5), 1e6 * quantile(v, 0.99)) for ms, v in delays.items()
        },
        "round_us": {n: r[0] for n, r in rounds.items()},
        "delay_1ms_pending_us": {n: 1e6 * r[1] for n, r in rounds.items()},
    }


def poller_line(f: dict) -> str:
    delays = ", ".join(
        f"{ms:g} ms: {p50:.0f}/{p99:.0f} us" for ms, (p50, p99) in f["delay_us"].items()
    )
    cost = ", ".join(
        f"{n}: {us:.1f} us/round ({f['delay_1ms_pending_us'][n]:.0f} us late)"
        for n, us in f["round_us"].items()
    )
    return f"detection delay p50/p99 after an event {delays}; with N handles pending {cost}"


# ---------------------------------------------------------------- 3. two stages over a loopback


class LoopbackWork:
    """A loopback send or receive: complete once the copy that matched it has run on the device."""

    def __init__(self) -> None:
        self.done = None  # the event after the copy, once issued

    def is_completed(self) -> bool:
        return self.done is not None and self.done.query()

    def exception(self):
        return None


class _HeldEvent:
    """An event recorded on a held stream: it is recorded for real when the stream is released."""

    def __init__(self) -> None:
        self.event = None

    def query(self) -> bool:
        return self.event is not None and self.event.query()


class LoopbackOps:
    """A channel pair's NCCL calls on one device, for two stages in one process.

    Sends and receives of one group match in posting order, as NCCL's do. A match becomes a
    copy on the receiver's stream, after the sender's stream reached the send; a send completes
    when that copy has run. A receive posted before its send holds its stream: what the
    channel issues on it meanwhile is replayed after the copy, as a NCCL receive kernel would
    hold a stream until the data came. Everything else is the base ops' (CudaOps)."""

    def __init__(self, base, new_event: Callable[[], Any]) -> None:
        self.base, self.new_event = base, new_event
        self._sends: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._recvs: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._held: dict[int, list] = {}  # id(stream) -> operations waiting for a receive's data
        self._current = None
        self.copies: dict[Any, list] = collections.defaultdict(
            list
        )  # group -> done events, in order

    def __getattr__(self, name):
        return getattr(self.base, name)

    def stream(self, stream):
        ops = self

        class _Current:
            def __enter__(self):
                self.before, ops._current = ops._current, stream
                self.inner = ops.base.stream(stream)
                return self.inner.__enter__()

            def __exit__(self, *exc):
                ops._current = self.before
                return self.inner.__exit__(*exc)

        return _Current()

    def _later(self, stream, fn) -> bool:
        """Queue ``fn`` behind a pending receive on ``stream``; False when it is not held."""
        held = self._held.get(id(stream))
        if held is None:
            return False
        held.append(fn)
        return True

    def record_event(self, stream):
        held = _HeldEvent()
        if self._later(stream, lambda: setattr(held, "event", self.base.record_event(stream))):
            return held
        return self.base.record_event(stream)

    def wait_event(self, stream, event) -> None:
        if not self._later(
            stream, lambda: self.base.wait_event(stream, getattr(event, "event", event))
        ):
            self.base.wait_event(stream, getattr(event, "event", event))

    def wait_work(self, work) -> None:
        stream = self._current
        if not self._later(stream, lambda: self.base.wait_event(stream, work.done)):
            self.base.wait_event(stream, work.done)

    def to_host(self, device_tensor, host) -> None:
        stream = self._current
        if not self._later(
            stream, lambda: self._on(stream, lambda: self.base.to_host(device_tensor, host))
        ):
            self.base.to_host(device_tensor, host)

    def _on(self, stream, fn):
        with self.base.stream(stream):
            fn()

    def isend(self, tensor, peer, group):
        sent = self.base.record_event(self._current)  # the sender's stream reached the send
        work = LoopbackWork()
        if self._recvs[group]:
            self._copy(group, tensor, sent, work, *self._recvs[group].popleft())
        else:
            self._sends[group].append((tensor, sent, work))
        return work

    def irecv(self, tensor, peer, group):
        work = LoopbackWork()
        stream = self._current
        if self._sends[group]:
            src, sent, send_work = self._sends[group].popleft()
            self._copy(group, src, sent, send_work, tensor, stream, work)
        else:
            self._recvs[group].append((tensor, stream, work))
            self._held.setdefault(id(stream), [])
        return work

    def _copy(self, group, src, sent, send_work, dst, stream, recv_work) -> None:
        held = self._held.pop(id(stream), None)
        with self.base.stream(stream):
            self.base.wait_event(stream, sent)
            self.base.to_host(src, dst)  # a copy on the current stream; device to device here
            done = self.new_event()
            done.record(stream)
        send_work.done = recv_work.done = done
        self.copies[group].append(done)
        for fn in held or ():
            fn()


async def loopback_figures(
    dev: Device,
    *,
    unit_ms: float = 0.0,
    n_microbatches: int = 4,
    iterations: int = 2,
    n_embd: int = 64,
    n_layer: int = 4,
) -> dict:
    """Stages 0 and 1 of a GPT on one device, over NcclChannel with LoopbackOps."""
    import torch

    from rrfp.comm.nccl_channel import NcclChannel
    from rrfp.comm.pipeline_channels import PipelineChannels
    from rrfp.loop import CompletionPoller, CudaComputeLane
    from rrfp.models.data import DataConfig
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, GPTConfig, loss_fn, make_stage

    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=64)
    data = make_batches(
        DataConfig(seed=3, microbatch_size=2, min_seq_len=8, max_seq_len=48), 0, n_microbatches
    )
    torch.manual_seed(0)
    reference = GPT(cfg)
    (sum(loss_fn(reference(x), y) for x, y in data) / n_microbatches).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    placed = [(dev.place(x), dev.place(y)) for x, y in data]
    ops = LoopbackOps(dev.ops, dev.new_event)
    hops: list[tuple[str, float]] = []
    async with CompletionPoller() as poller:
        lanes = [
            CudaComputeLane(
                poller, dev.device, unit_ms / 1e3, name=f"stage{s}", torch_module=dev.torch
            )
            for s in (0, 1)
        ]

        def channel(name, src, dst, outbound):
            ch = NcclChannel(
                name,
                src if outbound else dst,
                dst if outbound else src,
                name,
                outbound=outbound,
                ops=ops,
                poller=poller,
                compute_stream=lanes[src if outbound else dst].stream,
            )
            if outbound:
                send = ch.send

                async def timed_send(msg):
                    from_producer = msg.ready is not None  # the producing task's own end event
                    if (
                        not from_producer
                    ):  # what the channel would do: the compute stream as it is now
                        msg.ready = dev.new_event()
                        msg.ready.record(ch.compute_stream)
                    ready = msg.ready
                    await send(msg)
                    hops.append(
                        (f"{name} {msg.label()}", ready, ops.copies[name][-1], from_producer)
                    )

                ch.send = timed_send
            return ch

        fwd_out, fwd_in = channel("fwd 0->1", 0, 1, True), channel("fwd 0->1", 0, 1, False)
        bwd_out, bwd_in = channel("bwd 1->0", 1, 0, True), channel("bwd 1->0", 1, 0, False)
        torch.manual_seed(0)
        full = GPT(cfg)  # the reference's weights
        modules = [dev.place(make_stage(full, s, 2)) for s in (0, 1)]
        exs = [
            stage_executor(
                modules[s],
                s,
                2,
                lanes[s],
                PipelineChannels(s, **ends),
                n_microbatches,
                split=False,
                hint="1f1b",
                unit_s=unit_ms / 1e3,
                loss_fn=loss_fn,
            )
            for s, ends in enumerate(
                ({"fwd_out": fwd_out, "bwd_in": bwd_in}, {"fwd_in": fwd_in, "bwd_out": bwd_out})
            )
        ]
        for it in range(iterations):
            for m in modules:
                m.zero_grad(set_to_none=True)
            hops.clear()
            await asyncio.gather(*(ex.run_iteration(it, placed) for ex in exs))
        for lane in lanes:
            await lane.drain()
    err = max(
        (p.grad.float().cpu() - want[n]).abs().max().item()
        for m in modules
        for n, p in m.named_parameters()
    )
    return {
        "grad_err": err,
        "hops_ms": [(label, ready.elapsed_time(done)) for label, ready, done, _ in hops],
        "gated_by_producer": all(from_producer for *_, from_producer in hops),
    }


def loopback_line(f: dict) -> str:
    hops = [ms for _, ms in f["hops_ms"]]
    assert f["gated_by_producer"], "a send was not gated by its producer's end event"
    assert f["grad_err"] < 1e-3, (
        f"gradients differ from the single-process reference by {f['grad_err']:.2e}"
    )
    return (
        f"{len(hops)} hops: producer end -> consumer data p50 {quantile(hops, 0.5):.3f} ms, max "
        f"{max(hops):.3f} ms; gradients vs single-process reference: max |diff| {f['grad_err']:.2e}"
    )


# ---------------------------------------------------------------- 4. NCCL inits

INIT_LINE = re.compile(r"NCCL INFO .*Init COMPLETE")


def nccl_inits(log: str, mark: str = STARTUP_MARK) -> tuple[int, int]:
    """(communicators initialized before ``mark``, after it), from NCCL_DEBUG=INFO output."""
    before, _, after = log.partition(mark)
    if not _:
        raise ValueError("no start-up mark in the output: the run did not get through start-up")
    return len(INIT_LINE.findall(before)), len(INIT_LINE.findall(after))


RUN_MARKED = f"""
import ctypes, os, sys
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.train.training import stage_main
from rrfp.loop import run
from rrfp.pipeline.runtime import PipelineRuntime
start = PipelineRuntime.start
def marked(*a, **k):
    rt = start(*a, **k)
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)  # what NCCL printed so far lands before the mark
    os.write(1, b"{STARTUP_MARK}\\n")
    return rt
PipelineRuntime.start = marked
run(stage_main(TrainConfig.load(sys.argv[1], sys.argv[2:])))
"""


def marked_run(steps: int, backend: str = "nccl") -> str:
    """A pp=1 run's output with NCCL's init lines and the start-up mark (RUN_MARKED)."""
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    return run_rank_zero(
        ["-c", RUN_MARKED, CONFIG, f"steps={steps}", f"backend={backend}", "pp=1"], env
    )


def nccl_init_check(steps: int, out: str | None = None) -> str:
    """Communicators are made at start-up, never after, in ``out`` (default: a new marked run)."""
    at_start, later = nccl_inits(marked_run(steps) if out is None else out)
    assert at_start >= 1, (
        "no NCCL communicator was initialized at start-up (is NCCL_DEBUG honoured?)"
    )
    assert later == 0, f"{later} NCCL communicator(s) initialized after start-up"
    return f"{at_start} communicator init(s) at start-up, {later} after it ({steps} steps)"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_zero(args: list[str], env: dict | None = None, timeout: float = 300) -> str:
    """``python ARGS`` as the only rank of a world of one; its stdout (stderr shown on failure)."""
    env = {
        **(env or os.environ),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    p = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if p.returncode != 0:
        out = (p.stdout + p.stderr).strip()
        print(
            "\n".join(out.splitlines()[-30:]), flush=True
        )  # the whole story, for a one-shot device run
        raise RuntimeError(f"exit {p.returncode}: {out.splitlines()[-1] if out else ''}")
    return p.stdout


# ---------------------------------------------------------------- 5. memory


def predicted_peak_bytes(
    module, inflight: int, activation_bytes: int, optimizer_states: int = 2
) -> int:
    """Weights, their gradients and the optimizer's states (AdamW: two per weight), plus what the
    in-flight budget lets the stage hold: ``inflight`` microbatches of ``activation_bytes`` each."""
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    return weights * (2 + optimizer_states) + inflight * activation_bytes


async def memory_figures(
    dev: Device,
    *,
    n_embd: int = 512,
    n_layer: int = 4,
    n_microbatches: int = 4,
    iterations: int = 3,
) -> dict:
    """A pp=1 GPT stage trained a few steps at the default budget (2x: two microbatches held)."""
    import torch

    from rrfp.comm.pipeline_channels import PipelineChannels
    from rrfp.core.tasks import Kind
    from rrfp.loop import CompletionPoller, CudaComputeLane
    from rrfp.models.data import DataConfig
    from rrfp.models.data import batches as make_batches
    from rrfp.models.gpt import GPT, GPTConfig, loss_fn, make_stage

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=8, block_size=512)
    module = dev.place(make_stage(GPT(cfg), 0, 1))
    data = [
        (dev.place(x), dev.place(y))
        for x, y in make_batches(
            DataConfig(seed=1, microbatch_size=8, min_seq_len=128, max_seq_len=512),
            0,
            n_microbatches,
        )
    ]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    cuda = dev.torch.cuda
    if hasattr(cuda, "reset_peak_memory_stats"):
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
    async with CompletionPoller() as poller:
        lane = CudaComputeLane(poller, dev.device, 0.0, torch_module=dev.torch)
        ex = stage_executor(
            module,
            0,
            1,
            lane,
            PipelineChannels(0),
            n_microbatches,
            split=True,
            loss_fn=loss_fn,
            measure_activations=True,
        )
        measured = [0]

        def after_forward(task) -> None:  # what the worker holds for a microbatch once its F ran
            if task.kind is Kind.F:
                measured.append(ex.workers[0].activation_bytes(task.mb))

        ex.on_task_done.append(after_forward)
        for it in range(iterations):
            await ex.run_iteration(it, data)
            opt.step()
            opt.zero_grad(set_to_none=True)
    inflight, act = ex.limit.count, max(measured)
    out = {
        "predicted": predicted_peak_bytes(module, inflight, act),
        "inflight": inflight,
        "activation": act,
    }
    if hasattr(cuda, "max_memory_allocated"):
        cuda.synchronize()
        out.update(allocated=cuda.max_memory_allocated(), reserved=cuda.max_memory_reserved())
    return out


def memory_line(f: dict) -> str:
    mib = 2**20
    ratio = f["allocated"] / f["predicted"]
    assert ratio < 2.0, (
        f"peak allocated {f['allocated'] / mib:.0f} MiB is {ratio:.2f}x the prediction: a "
        f"budget set from it would let a stage run out of memory"
    )
    return (
        f"peak allocated {f['allocated'] / mib:.0f} MiB, reserved {f['reserved'] / mib:.0f} MiB; "
        f"predicted {f['predicted'] / mib:.0f} MiB (weights, gradients, AdamW states, "
        f"{f['inflight']} microbatches of {f['activation'] / mib:.0f} MiB in flight): "
        f"allocated/predicted {ratio:.2f}"
    )


# ---------------------------------------------------------------- 6. training and resume

RUN_LOSSES = """
import json, sys
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.train.training import stage_main
from rrfp.loop import run
summary = run(stage_main(TrainConfig.load(sys.argv[1], sys.argv[2:])))
print("LOSSES " + json.dumps(summary.losses))
"""


def train_losses(*sets: str, backend: str = "nccl") -> list[float]:
    """`stage_main` at pp=1 (cuda:0, nccl); its losses as exact floats (json round-trips them)."""
    out = run_rank_zero(["-c", RUN_LOSSES, CONFIG, f"backend={backend}", "pp=1", *sets])
    return json.loads(out.rsplit("LOSSES ", 1)[1].splitlines()[0])


def reference_losses(steps: int, device: str = "cuda:0") -> list[float]:
    """The same model, data and optimizer in one process on ``device``."""
    import torch

    from rrfp.app.config.train_config import TrainConfig

    cfg = TrainConfig.load(CONFIG, [f"steps={steps}"], world_size=1)
    wl = cfg.workload
    torch.manual_seed(cfg.run.seed)
    model = wl.build_stage(cfg.model, 0, 1, None).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
    )
    losses = []
    for step in range(steps):
        batch = wl.batches(cfg.data, step, cfg.schedule.n_microbatches)
        loss = sum(wl.loss_fn(model(x.to(device)), y.to(device)) for x, y in batch) / len(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_check(steps: int) -> str:
    got, want = train_losses(f"steps={steps}"), reference_losses(steps)
    assert len(got) == len(want) == steps, f"{len(got)} losses, expected {steps}"
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst < 2e-3, f"losses differ from the single-process reference by up to {worst:.2e}"
    return (
        f"{steps} steps, loss {got[0]:.4f} -> {got[-1]:.4f}, max |diff| vs reference {worst:.1e}; "
        + resume_check()
    )


def resume_check() -> str:
    """Dropout on, so the CUDA RNG state must be saved and restored for the masks to repeat."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    sets = ("model.dropout=0.1",)
    whole = train_losses("steps=6", *sets)
    with tempfile.TemporaryDirectory() as d:
        first = train_losses("steps=3", *sets, f"checkpoint.dir={d}")
        second = train_losses("steps=6", *sets, f"checkpoint.dir={d}", "resume=required")
        keys = dcp.FileSystemReader(f"{d}/step-00000006").read_metadata().state_dict_metadata
    assert any(k.startswith("rank0.rng.cuda") for k in keys), "no CUDA RNG state in the checkpoint"
    assert first + second == whole, f"resumed {first + second} != uninterrupted {whole}"
    return "resumed after 3 of 6 steps with dropout 0.1: losses identical as floats"


def virtual_check(steps: int, backend: str = "nccl", device: str = "cuda:0") -> str:
    """Two stages on the one rank: the same losses as the single-process reference."""
    got, want = (
        train_losses(f"steps={steps}", "virtual=2", backend=backend),
        reference_losses(steps, device),
    )
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert len(got) == steps and worst < 2e-3, f"losses {got} vs reference {want}"
    return f"{steps} steps with two stages on one rank, max |diff| vs reference {worst:.1e}"


def pp2_check(steps: int) -> str:
    want, out = reference_losses(steps), []
    for label, sets in (
        ("one stage per rank", []),
        ("two per rank, v shape", ["virtual=2", "placement=v"]),
    ):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "rrfp",
            "train",
            "--config",
            CONFIG,
            "--set",
            f"steps={steps}",
            "--set",
            "log_every=1",
            "--set",
            "backend=nccl",
            "--set",
            "pp=2",
            *[a for s in sets for a in ("--set", s)],
        ]
        p = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if p.returncode != 0:
            raise RuntimeError(
                f"{label}: exit {p.returncode}: "
                f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
            )
        got = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)][:steps]
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert len(got) == steps and worst < 2e-3, f"{label}: losses {got} vs reference {want}"
        out.append(f"{label} {worst:.1e}")
    return (
        f"{steps} steps over NCCL between two GPUs, max |diff| of the printed losses vs reference: "
        + ", ".join(out)
    )


def calibrate_check() -> str:
    """`rrfp calibrate` of a CUDA run measures on the GPU (each task synchronized), not the CPU."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cost.json")
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "rrfp",
                "calibrate",
                "--config",
                CONFIG,
                "--pp",
                "2",
                "--samples",
                "4",
                "--set",
                "backend=nccl",
                "--out",
                out,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if p.returncode != 0 or "real compute on cuda" not in p.stdout or not os.path.exists(out):
            raise RuntimeError(f"exit {p.returncode}: {(p.stdout + p.stderr)[-800:]}")
        return p.stdout.splitlines()[0]


# ---------------------------------------------------------------- main


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--steps", type=int, default=20)
    a.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated, from {', '.join(CHECKS)}"
    )
    args = a.parse_args()
    only = set(args.only.split(","))
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.cuda.nccl.version() if gpus and hasattr(torch.cuda, "nccl") else None
    print(
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}, GPUs: {gpus}"
        + (f" ({torch.cuda.get_device_name(0)}), NCCL {'.'.join(map(str, nccl))}" if gpus else ""),
        flush=True,
    )
    if gpus == 0:
        for name in CHECKS:
            report(
                name,
                "SKIPPED",
                f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is "
                f"False); its CPU part runs in {CPU_PART[name]}",
            )
        return 0
    from rrfp.loop import run

    wanted = [c for c in CHECKS if c in only]
    for name in wanted:
        if name == "lane":
            check(name, lambda: lane_line(run(lane_figures(cuda_device()))))
        elif name == "poller":
            check(name, lambda: poller_line(run(poller_figures(cuda_device()))))
        elif name == "loopback":
            check(name, lambda: loopback_line(run(loopback_figures(cuda_device(torch.float32)))))
        elif name == "nccl-init":
            check(name, lambda: nccl_init_check(5))
        elif name == "memory":
            check(name, lambda: memory_line(run(memory_figures(cuda_device(torch.float32)))))
        elif name == "train":
            check(name, lambda: train_check(args.steps))
        elif name == "calibrate":
            check(name, calibrate_check)
        elif name == "virtual":
            check(name, lambda: virtual_check(args.steps))
        elif name == "pp=2" and gpus < 2:
            report(
                name,
                "SKIPPED",
                f"needs 2 GPUs, this machine has {gpus} (NCCL refuses two ranks on one GPU)",
            )
        elif name == "pp=2":
            check(name, lambda: pp2_check(args.steps))
    failed = [r for r in results if r[1] == "FAILED"]
    print(
        f"gpu-check: {sum(r[1] == 'ok' for r in results)} ok, {len(failed)} failed, "
        f"{sum(r[1] == 'SKIPPED' for r in results)} skipped"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
