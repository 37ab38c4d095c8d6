"""A stage's checkpoint written and read in one process (DCP without a process group): the state
comes back, and the rank's ``working`` marker names the checkpoint while DCP writes and reads its
files, which is what its heartbeat tells the peers waiting in DCP's collectives."""

import contextlib

import pytest
import torch

from rrfp.app.train.checkpoint_state import check_readable, load_stage, save_stage, stage_key


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_saved_stage_loads_back_and_its_writes_and_reads_are_marked(tmp_path):
    marks: list[str] = []

    def working(what: str):
        marks.append(what)
        return contextlib.nullcontext()

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    path = tmp_path / "step-00000001"
    where = dict(rank=0, stage=0, tp_rank=0, device=torch.device("cpu"))
    save_stage(path, module, opt, **where, working=working)
    assert marks and set(marks) == {"writing checkpoint step-00000001"}
    check_readable(path, [stage_key(0, 0), "rank0"])

    marks.clear()
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    load_stage(path, module, opt, **where, working=working)
    assert marks and set(marks) == {"reading checkpoint step-00000001"}
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, saved[k])
