"""The embedding example runs under torchrun: the pipeline trains while the
driver's own coroutine keeps ticking on the same loop."""

import re
import subprocess

import pytest
from harness import ROOT
from harness.launch import TORCHRUN, child_env

pytestmark = pytest.mark.e2e


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


def readme_workload() -> str:
    """The python block of the README's "Your own model" section."""
    section = (ROOT / "README.md").read_text().split("## Your own model", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block in the README's 'Your own model' section"
    return block.group(1)


def test_readme_shows_examples_my_model_as_it_is():
    """The README's Workload is the example file's code, so running the file runs what it shows."""
    source = (ROOT / "examples/my_model.py").read_text()
    assert readme_workload().strip() in source
    assert len(readme_workload().splitlines()) <= 50


@pytest.mark.timeout(240)
def test_my_model_example_trains_under_rrfp_train():
    """The README's command for one's own model, on 2 gloo ranks: it trains, and the loss falls."""
    p = subprocess.run(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            "-m",
            "rrfp",
            "train",
            "--config",
            "examples/my_model.toml",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        env=child_env(),
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+/20 +loss (\d+\.\d+)", p.stdout)]
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0], p.stdout[-3000:]
