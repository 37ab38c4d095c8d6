"""The embedding paths that once ended in SIGABRT ("terminate called ...") end with one line or
the script's own exception and the script's own exit code: a script that uses
``PipelineRuntime.start()`` without ``async with`` and returns normally, two concurrent
``run_iteration`` calls (the second refused in one line), and an iteration cancelled on every
rank followed by a new one (refused in one line: the cancelled one's messages may still be in
flight). Two ranks started as torchrun would start them, each a script of its own: a fresh
interpreter, whose exit is the point, and whose imports show what a script pays (an iteration
without an optimizer loads no torch._dynamo). The two refusals come from one script, each in a
runtime of its own: the concurrent one's exception caught and its line printed, the other's
left to end the script, whose exit then follows both."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from harness import ROOT
from harness.distributed import script_ranks
from harness.train_rows import python_m

pytestmark = pytest.mark.e2e


SCRIPT = """
import asyncio, os, sys, time, traceback
import torch
import rrfp

case = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(rank)


class Slow(torch.nn.Linear):
    slow = case == "forever"  # an iteration lasts long enough to be cut midway

    def forward(self, x):
        if Slow.slow:
            time.sleep(0.2)
        return super().forward(x)


module = Slow(8, 8)
g = torch.Generator().manual_seed(1)
batches = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(2)]


def loss(out, y):
    return ((out - y) ** 2).mean()


async def unclosed():
    rt = rrfp.PipelineRuntime.start(pp=2, timeout_s=20)
    ex = rt.stage_executor(module, loss, n_microbatches=2)
    await ex.run_iteration(0, batches)


async def concurrent():
    async with rrfp.PipelineRuntime.start(pp=2, timeout_s=20) as rt:
        ex = rt.stage_executor(module, loss, n_microbatches=2)
        first = asyncio.ensure_future(ex.run_iteration(0, batches))
        await asyncio.sleep(0)
        try:
            await ex.run_iteration(1, batches)
        finally:
            await first


async def cancelled():
    Slow.slow = True
    async with rrfp.PipelineRuntime.start(pp=2, timeout_s=20) as rt:
        ex = rt.stage_executor(module, loss, n_microbatches=2)
        await ex.run_iteration(0, batches)
        it = asyncio.ensure_future(ex.run_iteration(1, batches))
        await asyncio.sleep(0.3)
        it.cancel()
        try:
            await it
        except asyncio.CancelledError:
            print(f"rank {rank}: cancelled", flush=True)
        await ex.run_iteration(2, batches)


async def forever():
    async with rrfp.PipelineRuntime.start(pp=2, timeout_s=20) as rt:
        ex = rt.stage_executor(module, loss, n_microbatches=2)
        for it in range(100000):
            await ex.run_iteration(it, batches)
            if it == 0:
                print(f"rank {rank}: iterating", flush=True)


async def refused():  # both refusals: the concurrent one caught and told, the other ends the script
    try:
        await concurrent()
    except Exception as e:
        lines = "".join(traceback.format_exception_only(e)).strip().splitlines()
        print(f"rank {rank}: concurrent refused in {len(lines)} line(s): {lines[-1]}", flush=True)
    await cancelled()


cases = {"unclosed": unclosed, "refused": refused, "forever": forever}
rrfp.run(cases[case]())
print(f"rank {rank}: returned", flush=True)
print(f"rank {rank}: loaded {sorted(m for m in sys.modules if m.startswith('torch._dynamo'))}")
"""


def _pair(script: Path, case: str) -> list[tuple[int, str, str]]:
    return script_ranks(script, case)


def _no_abort(got) -> None:
    for code, _, err in got:
        assert "terminate called" not in err and code not in (-6, 134), (code, err[-3000:])


@pytest.fixture(scope="module")
def unclosed(tmp_path_factory) -> list[tuple[int, str, str]]:
    """Both ranks of the script that leaves its runtime open after one iteration and returns."""
    script = tmp_path_factory.mktemp("unclosed") / "embed.py"
    script.write_text(SCRIPT)
    return _pair(script, "unclosed")


@pytest.mark.timeout(180)
def test_a_runtime_left_open_by_a_script_that_returns_exits_0(unclosed):
    _no_abort(unclosed)
    for rank, (code, out, err) in enumerate(unclosed):
        assert code == 0 and f"rank {rank}: returned" in out, (code, err[-3000:])


@pytest.mark.timeout(180)
def test_an_iteration_without_an_optimizer_loads_no_dynamo(unclosed):
    """A script's pipeline costs the imports it uses: torch._dynamo (about 2 CPU-s a process)
    comes with a torch optimizer, not with an iteration's FLOP count."""
    for rank, (code, out, err) in enumerate(unclosed):
        assert f"rank {rank}: loaded []" in out, (code, out[-3000:], err[-3000:])


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[tuple[int, str, str]]:
    """Both ranks of the script that is refused twice: a second concurrent iteration (caught, its
    line printed), then an iteration after a cancelled one, which ends the script."""
    script = tmp_path_factory.mktemp("refused") / "embed.py"
    script.write_text(SCRIPT)
    return _pair(script, "refused")


@pytest.mark.timeout(180)
def test_a_second_concurrent_iteration_is_refused_in_one_line(refused):
    _no_abort(refused)
    for rank, (code, out, err) in enumerate(refused):
        told = f"rank {rank}: concurrent refused in 1 line(s): "
        line = next((ln for ln in out.splitlines() if ln.startswith(told)), "")
        assert "run_iteration(1) while iteration 0 runs" in line, (code, out, err[-3000:])


@pytest.mark.timeout(180)
def test_an_iteration_after_a_cancelled_one_is_refused_in_one_line(refused):
    _no_abort(refused)
    for rank, (code, out, err) in enumerate(refused):
        assert f"rank {rank}: cancelled" in out, (code, err[-3000:])
        assert code == 1, (code, err[-3000:])
        last = err.strip().splitlines()[-1]
        assert "run_iteration(2) after iteration 1 was cancelled" in last, err[-3000:]


@pytest.mark.timeout(120)
def test_ctrl_c_to_torchrun_ends_every_rank_without_an_abort(tmp_path):
    """The terminal's Ctrl-C reaches torchrun's agent alone, which sends SIGINT to every rank:
    each ends on its KeyboardInterrupt, mid-iteration, as a script does, without an abort. The
    agent starts from the preloaded forkserver (tests/harness/train_rows.py), in a session of its
    own; its ranks are fresh interpreters, whose teardown is the point."""
    script = tmp_path / "embed.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "out", tmp_path / "err"
    agent = python_m(
        "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "forever",
        out=out, err=err, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        while out.read_text().count("iterating") < 2:
            assert agent.poll() is None and time.monotonic() - t0 < 60, err.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(agent.pid, signal.SIGINT)
        agent.wait(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    text = err.read_text()
    assert "terminate called" not in text and "SIGABRT" not in text, text[-3000:]
    codes = [int(c) for c in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", text, re.M)]
    assert all(c not in (-6, 134) for c in codes), text[-3000:]
