"""The embedding example runs under torchrun: the pipeline trains while the
driver's own coroutine keeps ticking on the same loop."""

import re
import subprocess
from pathlib import Path

import pytest
from launch import TORCHRUN, child_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_embedded_driver_example():
    p = subprocess.run(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            "examples/embedded_driver.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        env=child_env(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], p.stdout
    ticks = [int(x) for x in re.findall(r"heartbeat ticked (\d+) times", p.stdout)]
    assert len(ticks) == 2 and min(ticks) > 20, p.stdout


@pytest.mark.timeout(180)
def test_hf_llama_example():
    pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")
    p = subprocess.run(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            "examples/hf_llama.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        env=child_env(),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, p.stdout
