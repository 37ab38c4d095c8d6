"""Tests of rrfp.loop.host_memory: once a CPU lane exists, a thread that runs the same tasks again
(the lane's, in a malloc arena of its own) reuses their memory instead of faulting its pages in
afresh each iteration.

malloc's thresholds are the process's: each case runs in a process of its own, a child of the
preloaded forkserver (tests/harness/forked_python.py, torch imported but no test run in it), so
that what other tests did to them does not count."""

from __future__ import annotations

import json
import sys

import pytest
from harness import ROOT
from harness.forked_python import run_python
from harness.launch import child_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc"),
]

# three iterations of the vlm's two stages (F, the loss, B per microbatch) in a thread: the page
# faults of each iteration, the later ones' being those a kept heap avoids
ITERATIONS = """
import json, resource, sys, threading, torch
from rrfp.app.config.train_config import TrainConfig
from rrfp.loop import ComputeLane
if sys.argv[1] == "lane":
    ComputeLane(0.0).close()
torch.set_num_threads(1)
cfg = TrainConfig.load(sys.argv[2], ["model.n_layer=2", "parallel.pp=2"], world_size=2)
wl = cfg.workload
stages = wl.build_stages(cfg.model, [0, 1], 2, 0)
batches = wl.batches(cfg.data, 0, 2)
faults = []
def run():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for x, y in batches:
            wl.loss_fn(stages[1](stages[0](x)), y).backward()
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    res = run_python(
        ["-c", ITERATIONS, mode, str(ROOT / "configs" / "vlm-tiny.toml")],
        env=child_env(PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_a_lane_keeps_freed_memory_for_the_next_iteration():
    faults = _faults("lane")
    # the first iteration faults its pages in (and the second some, as the heap settles); the
    # third reuses them, where malloc's defaults fault a third of the first's again
    assert faults[2] < faults[0] / 20, faults
