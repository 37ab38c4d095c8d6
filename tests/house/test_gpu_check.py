"""The CPU part of every `make gpu-check` check (benchmarks/gpu_check.py): the same code, on the
fake CUDA/NCCL of tests/harness/fake_cuda.py, where device time is emulated by the lane. On a CPU
machine the script itself reports every check as skipped, with the reason. The interpreters the
script starts (``python -c`` runs, the script itself) are children of the test session's preloaded
forkserver (tests/harness/forked_python.py): the same output and exit code, without importing torch
afresh for each; what the script's runs print is the point, not an interpreter's start."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest
import torch
from harness import ROOT
from harness.fake_cuda import FakeCudaOps, FakeEvent, FakeWorld, restore_late_sends
from harness.forked_python import forked_subprocess_run, run_python

from rrfp.loop import CompletionPoller, CudaComputeLane, run


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _script()


def fake_device():
    # 1e9 cycles/s: the lane's calibration probes are 20 ms, longer than a host stall on a loaded
    # machine, so a probe enqueued behind another is timed on the device alone
    world = FakeWorld(1, cycles_per_s=1e9)
    world.enter(0)
    return gpu_check.Device(
        world.torch_for(0),
        torch.device("cuda", 0),
        FakeCudaOps(world, 0),
        torch.float32,
        lambda: FakeEvent(world, True),
        lambda x: x,
    ), world


@pytest.mark.timeout(60)
def test_lane_figures_on_the_fake_device():
    dev, world = fake_device()
    f = run(
        gpu_check.lane_figures(
            dev, n_embd=32, n_head=4, lengths=(8, 16, 32), iterations=3, unit_ms=5.0
        )
    )
    print(gpu_check.lane_line(f))
    # lower bounds only: the host of this shared machine stalls at times, and the device then idles
    assert f["tasks"] == 2 * 3 * 3 and set(f["kind_ms"]) == {"F", "B", "W"}
    assert all(lo >= 4.99 for lo, hi in f["kind_ms"].values()), (
        "each task holds the lane 5 ms at least"
    )
    assert 0 <= f["idle_share"] < 1 and f["gap_p50_us"] <= f["gap_p99_us"]
    assert f["enqueue_ms_per_task"] > 0 and f["kernel_ms_per_task"] >= 4.99 and f["decision_us"] > 0


@pytest.mark.timeout(60)
def test_a_host_stall_while_the_lane_calibrates_does_not_shorten_emulated_time():
    """The lane measures torch.cuda._sleep's clock once, at start-up. The host stalls 30 ms between
    the first probe's start event and its kernel (the device idle meanwhile, as a loaded host
    leaves it): the calibration still finds the device's clock, so each emulated task holds
    the lane as long as asked. The probes are 20 ms, so a later probe is enqueued while the
    device still runs the one before."""
    world = FakeWorld(1, cycles_per_s=1e9)
    world.enter(0)
    fake = world.torch_for(0)
    enqueue, sleeps = fake.cuda._sleep, []

    def stalled(cycles):
        sleeps.append(cycles)
        if len(sleeps) == 2:  # after the warm-up: the first probe
            time.sleep(0.03)
        enqueue(cycles)

    fake.cuda._sleep = stalled

    async def calibrated() -> float:
        async with CompletionPoller() as poller:
            lane = CudaComputeLane(poller, torch.device("cuda", 0), 0.005, torch_module=fake)
            return lane._sleep_cycles_per_s

    assert run(calibrated()) == pytest.approx(world.cycles_per_s, rel=0.01)
    assert len(sleeps) > 2, "the calibration probed once: a stall there sets every emulated time"


@pytest.mark.timeout(60)
def test_poller_figures_on_the_fake_device():
    dev, world = fake_device()
    f = run(gpu_check.poller_figures(dev, delays_ms=(0.1, 1.0, 5.0), pending=(1, 8, 32), repeats=5))
    print(gpu_check.poller_line(f))
    assert set(f["delay_us"]) == {0.1, 1.0, 5.0} and set(f["round_us"]) == {1, 8, 32}
    # liveness, not speed (speed is gpu-check's figure on a device): the poller noticed every event,
    # long before a lost wake-up would show; a loaded CI machine may deschedule it for milliseconds
    assert all(0 <= p50 < 500_000 for p50, _ in f["delay_us"].values()), f["delay_us"]
    assert all(us > 0 for us in f["round_us"].values())


@pytest.mark.timeout(60)
def test_two_stages_over_the_loopback_match_the_reference_and_send_on_time(monkeypatch):
    """The loopback check on the fake: gradients, and every hop timed from its producer's own end
    event; with the send timing from before the fix no hop is (its gate is "the stream now")."""
    small = dict(unit_ms=10.0, n_embd=16, n_layer=2)
    f = run(gpu_check.loopback_figures(fake_device()[0], **small))
    print(gpu_check.loopback_line(f))
    assert f["grad_err"] < 1e-5 and len(f["hops_ms"]) == 8 and f["gated_by_producer"]
    assert all(ms >= 0 for _, ms in f["hops_ms"])
    restore_late_sends(monkeypatch)
    late = run(gpu_check.loopback_figures(fake_device()[0], **small))
    assert late["grad_err"] < 1e-5 and not late["gated_by_producer"]
    with pytest.raises(AssertionError, match="not gated by its producer"):
        gpu_check.loopback_line(late)


def test_nccl_inits_are_counted_before_and_after_startup():
    log = "\n".join(
        [
            "h:1:1 [0] NCCL INFO Bootstrap : Using eth0",
            "h:1:1 [0] NCCL INFO ncclCommInitRankConfig comm 0x1 rank 0 nranks 1 cudaDev 0 - Init "
            "COMPLETE",
            "h:1:1 [0] NCCL INFO ncclCommSplit comm 0x2 rank 0 nranks 1 cudaDev 0 - Init COMPLETE",
            gpu_check.STARTUP_MARK,
            "step    1/5  loss 5.5",
            "h:1:1 [0] NCCL INFO ncclCommInitRank comm 0x3 rank 0 nranks 2 cudaDev 0 - Init "
            "COMPLETE",
        ]
    )
    assert gpu_check.nccl_inits(log) == (2, 1)
    with pytest.raises(ValueError, match="start-up"):
        gpu_check.nccl_inits(log.replace(gpu_check.STARTUP_MARK, ""))


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_runs_the_gpu_checks_start_work_on_gloo(monkeypatch):
    """nccl-init's marked run and train's exact losses, here on gloo: the start-up mark is in the
    output (and no NCCL init around it), and the losses come back as floats, the same twice."""
    monkeypatch.setattr(subprocess, "run", forked_subprocess_run(subprocess.run))
    marked = gpu_check.marked_run(2, backend="gloo")
    assert gpu_check.STARTUP_MARK in marked and gpu_check.nccl_inits(marked) == (0, 0)
    with pytest.raises(AssertionError, match="no NCCL communicator was initialized at start-up"):
        gpu_check.nccl_init_check(2, marked)
    first, again = (gpu_check.train_losses("steps=2", backend="gloo") for _ in range(2))
    assert len(first) == 2 and all(isinstance(x, float) for x in first) and first == again
    # the virtual check, on gloo and the CPU: two stages on the one rank give the one-process losses
    assert gpu_check.virtual_check(2, backend="gloo", device="cpu").startswith(
        "2 steps with two stages on one rank"
    )


@pytest.mark.timeout(60)
def test_memory_prediction_counts_weights_optimizer_and_the_budget():
    dev, world = fake_device()
    f = run(gpu_check.memory_figures(dev, n_embd=32, n_layer=2, n_microbatches=4, iterations=1))
    from rrfp.models.gpt import GPT, GPTConfig

    weights = sum(
        p.numel() * 4
        for p in GPT(GPTConfig(n_layer=2, n_embd=32, n_head=8, block_size=512)).parameters()
    )
    assert f["inflight"] == 2, "pp=1 under the default 2x budget holds two microbatches"
    assert f["activation"] > 0 and f["predicted"] == 4 * weights + 2 * f["activation"]


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_gpu_check_on_a_cpu_machine_skips_every_check_and_says_why():
    p = run_python(["benchmarks/gpu_check.py"], cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    assert [ln.split("]")[1].split(":")[0].strip() for ln in lines] == list(gpu_check.CHECKS)
    assert all(
        ln.startswith("[SKIPPED]") and "no CUDA device" in ln and "tests/" in ln for ln in lines
    ), lines


@pytest.mark.timeout(60)
def test_cuda_lane_holds_a_slow_tasks_seconds_without_emulated_time():
    """The slow fault's hold_s on the CUDA lane: a spin kernel even when unit_s = 0 (the spin is
    calibrated on first use), so the stream is busy that long; abandon() is there and recalls
    nothing."""
    from rrfp.loop import CompletionPoller, CudaComputeLane

    dev, world = fake_device()

    async def go():
        async with CompletionPoller() as poller:
            lane = CudaComputeLane(poller, dev.device, 0.0, torch_module=dev.torch)
            await lane.run(lambda: None, hold_s=0.2)
            lane.abandon()
            await lane.drain()
            return lane.task_s

    task_s = run(go())
    assert len(task_s) == 1 and task_s[0] >= 0.19, task_s
