"""One job owns a checkpoint folder at a time: a second job is refused naming the owner, a
crashed owner's record is stale (its pid gone, or not renewed for a lease from another host), the
same job (a torchrun restart) takes its folder back; a commit binds every file to the rank of the
job that wrote it, so a step mixed with another job's files is never committed."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time

import pytest
import torch.distributed as dist

from rrfp.app.job.job_agreement import job_id
from rrfp.app.train.checkpoint_dir import MARKER, CheckpointDir
from rrfp.app.train.checkpoint_owner import (
    LEASE_S,
    OWNER,
    FolderClaim,
    NotOurs,
    Owner,
    _process_start,
    read_owner,
    refusal,
)


def _record(root, owner: Owner, age_s: float = 0.0) -> None:
    (root / OWNER).write_text(json.dumps(dataclasses.asdict(owner)))
    then = time.time() - age_s
    os.utime(root / OWNER, (then, then))


def _parent_pid_record(job: str) -> Owner:
    """A claim by the test runner's parent process: alive on this host, not this process."""
    ppid = os.getppid()
    return dataclasses.replace(Owner.this(job), pid=ppid, pid_start=_process_start(ppid))


def test_a_second_job_is_refused_naming_the_owner(tmp_path):
    first = FolderClaim(tmp_path, "aaaaaaaaaaaa")
    assert first.claim() is None
    _record(tmp_path, _parent_pid_record("aaaaaaaaaaaa"))  # as another process claimed it
    other = FolderClaim(tmp_path, "bbbbbbbbbbbb").claim()
    assert other is not None and other.job == "aaaaaaaaaaaa"
    line = refusal(tmp_path, other)
    assert f"in use by job aaaaaaaaaaaa (host {socket.gethostname()}, pid {os.getppid()}" in line
    assert "\n" not in line
    first.release()
    assert not (tmp_path / OWNER).exists()
    assert FolderClaim(tmp_path, "bbbbbbbbbbbb").claim() is None  # free after the first ended


def test_the_same_job_takes_its_folder_back(tmp_path):
    """A torchrun restart: the same job id, another process."""
    _record(tmp_path, dataclasses.replace(Owner.this("cccccccccccc"), pid=1, pid_start="0"))
    assert FolderClaim(tmp_path, "cccccccccccc").claim() is None
    assert read_owner(tmp_path)[0].pid == os.getpid()


def test_an_earlier_run_of_this_process_is_over(tmp_path):
    """An embedding script that ran stage_main before, and failed: its claim is not alive."""
    _record(tmp_path, Owner.this("999999999999"))
    assert FolderClaim(tmp_path, "888888888888").claim() is None


def test_a_dead_or_reused_pid_on_this_host_is_stale(tmp_path):
    parent = _parent_pid_record("dddddddddddd")
    _record(tmp_path, dataclasses.replace(parent, pid_start="1"))  # a live pid, another start
    assert FolderClaim(tmp_path, "eeeeeeeeeeee").claim() is None
    assert read_owner(tmp_path)[0].job == "eeeeeeeeeeee"
    _record(tmp_path, dataclasses.replace(parent, pid=2**22 + 1))  # above pid_max: no such pid
    assert FolderClaim(tmp_path, "eeeeeeeeeeee").claim() is None
    assert read_owner(tmp_path)[0].job == "eeeeeeeeeeee"


def test_another_hosts_record_holds_for_its_lease(tmp_path):
    far = dataclasses.replace(Owner.this("ffffffffffff"), host="elsewhere.example", pid=1)
    _record(tmp_path, far, age_s=LEASE_S / 2)
    assert FolderClaim(tmp_path, "111111111111").claim() == far
    _record(tmp_path, far, age_s=2 * LEASE_S)  # not renewed: gone
    assert FolderClaim(tmp_path, "111111111111").claim() is None


def test_a_folder_taken_over_is_noticed_before_the_commit(tmp_path):
    mine = FolderClaim(tmp_path, "222222222222")
    assert mine.claim() is None
    _record(tmp_path, dataclasses.replace(Owner.this("333333333333"), host="elsewhere.example"))
    with pytest.raises(NotOurs, match="owned by another job 333333333333"):
        mine.check()
    mine.release()
    assert read_owner(tmp_path)[0].job == "333333333333"  # not ours to remove


def _partial(store: CheckpointDir, step: int, files: dict[str, bytes]) -> None:
    partial = store.partial_path(step)
    partial.mkdir(parents=True)
    for name, data in files.items():
        (partial / name).write_bytes(data)


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_a_commit_binds_each_file_to_its_rank_and_job(tmp_path):
    store = CheckpointDir(tmp_path)
    _partial(store, 1, {"__0_0.distcp": b"zero", ".metadata": b"m", "__1_0.distcp": b"one"})
    written = [
        {"__0_0.distcp": _sha(b"zero"), ".metadata": _sha(b"m")},
        {"__1_0.distcp": _sha(b"one")},
    ]
    ck = store.commit(1, {"config": {}}, job="444444444444", written=written)
    assert ck.problem() is None
    record = json.loads(json.loads((ck.path / MARKER).read_text())["record"])
    assert record["job"] == "444444444444"
    assert record["files"]["__1_0.distcp"]["rank"] == 1


@pytest.mark.parametrize(
    "on_disk, why",
    [
        ({"__1_0.distcp": b"another job's"}, "not the bytes rank 1 wrote"),
        ({"__2_0.distcp": b"a third rank"}, "no rank of this job wrote it"),
    ],
)
def test_a_step_mixed_with_another_jobs_file_is_not_committed(tmp_path, on_disk, why):
    store = CheckpointDir(tmp_path)
    _partial(store, 1, {"__0_0.distcp": b"zero", ".metadata": b"m", "__1_0.distcp": b"one"})
    for name, data in on_disk.items():
        (store.partial_path(1) / name).write_bytes(data)
    written = [
        {"__0_0.distcp": _sha(b"zero"), ".metadata": _sha(b"m")},
        {"__1_0.distcp": _sha(b"one")},
    ]
    with pytest.raises(NotOurs, match=why):
        store.commit(1, {"config": {}}, job="555555555555", written=written)
    assert store.complete() == []


def test_a_job_keeps_one_id_across_its_attempts(monkeypatch):
    """torchrun's agent keeps one store for every attempt: the first id put there stays."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    first = job_id(10.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert job_id(10.0) == first
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert job_id(10.0) != first  # no torchrun: each start is a job of its own
