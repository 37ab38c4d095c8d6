"""The fault matrix's rows of one job's identity and one folder's owner.

Two torchrun agents as one job (``--nnodes 2``, a c10d rendezvous on 127.0.0.1, one rank each, each
agent ``python -m rrfp.app.job.launch_agent``, torchrun's agent as `rrfp train --nproc-per-node`
runs it, started from the preloaded forkserver: tests/harness/train_rows.py's ``python_m``; their
ranks are forks of it, as that launcher has them: ``forked_rrfp``), started with the same command
line but for one ``--set`` on node 1: the same job finishes; another model, seed, learning rate,
microbatch count or checkpoint folder is refused before any process group, in one ``rrfp:`` line for
the whole job that names the key and both nodes, every rank exiting 2, and node 0's agent, which
holds the store, too (node 1's agent exits 2, or 1 when node 0's agent and its store left before it
read its rank's exit). The job's waits are set far beyond the test's own timeout, so a refusal that
waited for a timeout would fail the test instead of passing it late.

Two jobs, one folder (each two ranks of ``rrfp train``, tests/harness/train_rows.py): a second job
started while the first writes into its ``checkpoint.dir`` is refused in one line naming the
owner (job id, host, pid); once the first was killed (SIGKILL, its record left behind), a third
job resumes from its checkpoint. Two jobs started at once on an empty folder: one owns it, and
every step it commits verifies and names it; the other is refused. docs/faults.md holds these
rows too (tests/pipeline/test_fault_matrix.py writes it; the rows are in
tests/harness/agent_fault_rows.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness.agent_fault_rows import CASES, FINISHES, ROWS
from harness.distributed import free_port
from harness.train_rows import AsPopen, TrainJob, forked_rrfp, python_m

from rrfp.app.train.checkpoint_dir import MARKER, CheckpointDir
from rrfp.app.train.checkpoint_owner import read_owner

pytestmark = pytest.mark.e2e

LIMIT_S = 240.0  # a row whose agents have not ended by then waits for a timeout: it fails
WAIT_S = 900  # run.timeout_s and the rendezvous's: far beyond LIMIT_S
AT_ONCE = 2  # rows running together (each two agents and two ranks, on two cores)
SETS = [
    "steps=2", "n_microbatches=4", "model.n_layer=2", "model.n_embd=16", "model.block_size=32",
    "data.min_seq_len=8", "data.max_seq_len=32", f"timeout_s={WAIT_S}",
    f"timeouts.process_group_s={WAIT_S}", f"timeouts.store_connect_s={WAIT_S}",
]  # fmt: skip


def _agent(tmp: Path, node: int, port: int, sets: list[str]) -> AsPopen:
    """Node ``node``'s agent, ``python -m rrfp.app.job.launch_agent``, in a session of its own
    (the agent and its rank: one group, killed together at the end)."""
    argv = [
        "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}",
        f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}", "--max-restarts=0",
        *forked_rrfp("train", "--config", "configs/gpt-tiny.toml",
                     *(a for s in sets for a in ("--set", s))),
    ]  # fmt: skip
    return python_m(
        "rrfp.app.job.launch_agent", *argv, out=tmp / f"out{node}", err=tmp / f"err{node}"
    )


def run_agents(tmp: Path, case: str) -> dict:
    """Both agents of the case's job, to their end (at most LIMIT_S): exit codes, every ``rrfp:``
    line either printed, both stdouts."""
    tmp.mkdir(parents=True)
    extra, _ = CASES[case]
    common = [*SETS, f"checkpoint.dir={tmp}/ck"]
    port = free_port()
    agents = [
        _agent(tmp, n, port, [*common, f"log_dir={tmp}/logs{n}"] + (
            [s.format(tmp=tmp) for s in extra] if n == 1 else []))
        for n in (0, 1)
    ]  # fmt: skip
    deadline = time.monotonic() + LIMIT_S
    try:
        for a in agents:
            a.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    err = [(tmp / f"err{n}").read_text(errors="replace") for n in (0, 1)]
    return {
        "codes": [a.returncode for a in agents],
        "lines": [ln for e in err for ln in e.splitlines() if ln.startswith("rrfp:")],
        "out": [(tmp / f"out{n}").read_text(errors="replace") for n in (0, 1)],
        "timed_out": time.monotonic() >= deadline,
        "tails": "\n".join(f"--- agent {n}:\n{e[-2500:]}" for n, e in enumerate(err)),
    }


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every chosen row's job, AT_ONCE at a time, started at once; {case: Future}."""
    root = tmp_path_factory.mktemp("agents")
    chosen = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.originalname == "test_two_agent_row"
    ]
    pool = concurrent.futures.ThreadPoolExecutor(AT_ONCE)
    futures = {c: pool.submit(run_agents, root / c.replace(" ", "-"), c) for c in chosen}
    yield futures
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("api", "case", "outcome"), ROWS)
def test_two_agent_row(api, case, outcome, outcomes):
    got = outcomes[case].result()
    assert not got["timed_out"], got["tails"]
    if outcome == FINISHES:
        assert got["codes"] == [0, 0], got["tails"]
        # the job's rank 0 says so: the worker of whichever agent torchrun's rendezvous made node
        # 0, by the order the agents joined, which the machine's load decides
        assert sum("done: 2 steps" in out for out in got["out"]) == 1, got["out"]
        assert got["lines"] == [], got["tails"]
        return
    _, key = CASES[case]
    # bad input: the store's agent exits as its rank did; the other exits so too, or 1 when the
    # store's agent left before it read its rank's exit (torchrun's agent losing its store)
    assert got["codes"][0] == 2 and got["codes"][1] in (1, 2), got["tails"]
    assert len(got["lines"]) == 1, got["tails"]  # one line for the job, both agents together
    line = got["lines"][0]
    assert line.startswith("rrfp: error: the ranks of this job were started with different")
    assert f"{key}: " in line and "(node 0 (" in line and "(node 1 (" in line, line


def _job(tmp: Path, name: str, *extra: str) -> TrainJob:
    return TrainJob(tmp / name, _argv(tmp, name, *extra)[1:])


def _argv(tmp: Path, name: str, *extra: str) -> list[str]:
    """`train ARGS` of a job writing into ``tmp``/ck, its logs in ``tmp``/``name``."""
    sets = [
        *SETS[:-3],
        "steps=3",  # a stall in step 3 keeps steps 1 and 2 committed; a resume runs step 3
        "timeout_s=30",
        "checkpoint.every=1",
        f"checkpoint.dir={tmp / 'ck'}",
        f"log_dir={tmp / name / 'logs'}",
        *extra,
    ]
    return ["train", "--config", "configs/gpt-tiny.toml", *(a for s in sets for a in ("--set", s))]


@pytest.mark.timeout(600)
def test_a_second_job_on_a_folder_is_refused_and_a_killed_owner_frees_it(tmp_path):
    """Job A trains slowly (its rank 1 sleeps 600 s in step 3's F1 task); job B, started on A's
    folder once A committed step 1 (`rrfp train --nproc-per-node 2`), is refused naming A; A
    killed, job C resumes from A's
    newest checkpoint."""
    first = _job(tmp_path, "a", "fault=slow:rank=1:step=3:task=F1:seconds=600")
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (tmp_path / "ck" / "step-00000001").is_dir():
            first.poll()
            assert not first.ended and time.monotonic() < deadline, first.tails()
            time.sleep(0.1)
        # through torchrun's agent: its store says the refusal once for the job
        second = python_m(
            "rrfp", *_argv(tmp_path, "b", "checkpoint.resume=auto"), "--nproc-per-node", "2",
            out=tmp_path / "b.out", err=tmp_path / "b.err",
        )  # fmt: skip
        try:
            code = second.wait(LIMIT_S)
        finally:
            if second.poll() is None:  # hung: the test fails, nothing of it is left
                os.killpg(second.pid, signal.SIGKILL)
        err = (tmp_path / "b.err").read_text(errors="replace")
        assert code == 2, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("rrfp:")]
        assert len(lines) == 1, err[-3000:]
        pid = first.procs[0].pid
        assert f"checkpoint.dir {tmp_path / 'ck'} is in use by job " in lines[0], lines
        assert f", pid {pid}, started " in lines[0], lines
        assert first.codes() == [None, None], first.tails()  # A trains on, undisturbed
    finally:
        first.kill()  # SIGKILL: its OWNER record stays behind, naming a pid that is gone
    kept = sorted(p.name for p in (tmp_path / "ck").glob("step-*"))
    third = _job(tmp_path, "c", "checkpoint.resume=required").finish(LIMIT_S)
    assert third.codes() == [0, 0], third.tails()
    assert f"after step {int(kept[-1].removeprefix('step-'))}" in third.out(0), third.out(0)


@pytest.mark.timeout(600)
def test_two_jobs_started_at_once_on_one_folder_never_mix(tmp_path):
    """Two jobs (`rrfp train --nproc-per-node 2` each) started together on one empty folder, each
    stalling in step 3: one owns the folder and commits steps 1 and 2, every one of which verifies
    and names that job in its commit record; the other is refused in one line naming it."""
    slow = "fault=slow:rank=1:step=3:task=F1:seconds=600"
    jobs = {
        name: python_m(
            "rrfp",
            *_argv(tmp_path, name, "checkpoint.resume=auto", slow),
            "--nproc-per-node",
            "2",
            out=tmp_path / f"{name}.out",
            err=tmp_path / f"{name}.err",
        )  # fmt: skip
        for name in ("a", "b")
    }
    try:
        deadline = time.monotonic() + LIMIT_S
        while not any(j.poll() is not None for j in jobs.values()):
            assert time.monotonic() < deadline, "neither job was refused"
            time.sleep(0.1)
        (refused,) = [n for n, j in jobs.items() if j.poll() is not None]
        (owning,) = [n for n in jobs if n != refused]
        err = (tmp_path / f"{refused}.err").read_text()
        assert jobs[refused].returncode == 2, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("rrfp:")]
        assert len(lines) == 1 and " is in use by job " in lines[0], err[-3000:]
        owner, _ = read_owner(tmp_path / "ck")
        assert f"job {owner.job} (host {owner.host}, pid {owner.pid}, started " in lines[0]
        while len(CheckpointDir(tmp_path / "ck").complete()) < 2:  # the owner's steps 1 and 2
            assert time.monotonic() < deadline and jobs[owning].poll() is None, (
                tmp_path / f"{owning}.err"
            ).read_text()[-3000:]
            time.sleep(0.1)
        for ck in CheckpointDir(tmp_path / "ck").complete():
            assert ck.problem() is None, ck.problem()
            record = json.loads(json.loads((ck.path / MARKER).read_text())["record"])
            assert record["job"] == owner.job, (record["job"], owner)
    finally:
        for j in jobs.values():
            if j.poll() is None:
                os.killpg(j.pid, signal.SIGKILL)
                j.wait()
