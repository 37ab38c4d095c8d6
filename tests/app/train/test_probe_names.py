"""A job starting beside another on one checkpoint folder writes a probe there and reads it back
(the folder is one file system for every rank); the other job's debris sweep at its own start
must not take that probe away in between, or the job is refused as if its ranks saw different
file systems instead of being told the folder is in use."""

from __future__ import annotations

from rrfp.app.job.run_outputs import PROBE_PREFIX, folder_problem
from rrfp.app.train.checkpoint_dir import CheckpointDir


def test_a_probe_is_not_debris(tmp_path):
    store = CheckpointDir(tmp_path)
    probe = tmp_path / f"{PROBE_PREFIX}12345"
    probe.write_text("12345")
    store.partial_path(3).mkdir()  # debris of a crash
    store.clear_debris()
    assert probe.read_text() == "12345"
    assert not store.partial_path(3).exists()


def test_the_folder_check_leaves_nothing(tmp_path):
    assert folder_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
