"""The examples run as their commands say, on 2 ranks with torchrun's variables (torchrun
--nproc-per-node 2 examples/X.py; rrfp train for my_model.toml): the embedding example's pipeline
trains while the driver's own coroutine keeps ticking on the same loop, the HF and own-model
examples train. The ranks are children of the preloaded forkserver (tests/harness/train_rows.py)
running the script as ``python SCRIPT`` would; the launcher and bare torchrun on a user's model
are tests/app/job/test_own_model_launch.py's."""

import re

import pytest
from harness import ROOT
from harness.train_rows import TrainJob

pytestmark = pytest.mark.e2e


def example(tmp, name: str) -> str:
    """Both ranks' stdout (as torchrun's, rank 0's first) of examples/NAME run as a script."""
    job = TrainJob(tmp, [], script=ROOT / "examples" / name).finish(170)
    assert job.codes() == [0, 0], job.tails()
    return job.out(0) + job.out(1)


@pytest.mark.timeout(180)
def test_embedded_driver_example(tmp_path):
    out = example(tmp_path, "embedded_driver.py")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0], out
    ticks = [int(x) for x in re.findall(r"heartbeat ticked (\d+) times", out)]
    assert len(ticks) == 2 and min(ticks) > 20, out


@pytest.mark.timeout(180)
def test_hf_llama_example(tmp_path):
    pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")
    out = example(tmp_path, "hf_llama.py")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, out


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
def test_my_model_example_trains_under_rrfp_train(tmp_path):
    """The README's command for one's own model, on 2 gloo ranks: it trains, and the loss falls."""
    job = TrainJob(tmp_path, ["--config", "examples/my_model.toml"]).finish(220)
    assert job.codes() == [0, 0], job.tails()
    out = job.out(0)
    losses = [float(x) for x in re.findall(r"step +\d+/20 +loss (\d+\.\d+)", out)]
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0], out[-3000:]
