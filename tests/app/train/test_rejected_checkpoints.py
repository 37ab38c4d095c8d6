"""A checkpoint that fails verification is set aside as ``rejected-step-N`` with every file kept,
never deleted: by its resume (``CheckpointDir.reject``), by keep-last-K (``prune``) or as debris
(``clear_debris``), whether its commit record has a flipped byte or is a folder."""

from __future__ import annotations

from pathlib import Path

from rrfp.app.train.checkpoint_dir import MARKER, CheckpointDir


def _commit(store: CheckpointDir, step: int) -> None:
    store.partial_path(step).mkdir()
    (store.partial_path(step) / "__0_0.distcp").write_text(f"state of step {step}")
    store.commit(step, {"config": {}})


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_flipped_byte_in_the_commit_record_sets_the_whole_step_aside_intact(tmp_path):
    store = CheckpointDir(tmp_path)
    for step in (1, 2):
        _commit(store, step)
    record = store.final_path(2) / MARKER
    data = bytearray(record.read_bytes())
    data[40] ^= 0x40
    record.write_bytes(bytes(data))
    before = _files(store.final_path(2))
    latest = store.complete()[-1]
    assert latest.step == 2 and "(damaged)" in latest.problem(), latest.problem()
    moved = store.reject([latest])
    assert moved == [tmp_path / "rejected-step-00000002"]
    assert _files(moved[0]) == before  # every byte kept, the record's flipped one included
    assert [c.step for c in store.complete()] == [1]


def test_a_commit_record_that_is_a_folder_is_a_rejected_checkpoint_not_debris(tmp_path):
    store = CheckpointDir(tmp_path)
    _commit(store, 1)
    step2 = store.final_path(2)
    step2.mkdir()
    (step2 / "__0_0.distcp").write_text("a shard someone may want back")
    (step2 / MARKER).mkdir()
    assert [c.step for c in store.complete()] == [1, 2]
    assert "cannot be read" in store.complete()[-1].problem()
    store.clear_debris()  # at a run's start and after each commit: it is no debris
    assert (step2 / "__0_0.distcp").read_text() == "a shard someone may want back"
    store.reject([store.complete()[-1]])
    assert (tmp_path / "rejected-step-00000002" / "__0_0.distcp").is_file()
    assert (tmp_path / "rejected-step-00000002" / MARKER).is_dir()


def test_keep_last_k_and_debris_clearing_never_touch_a_rejected_checkpoint(tmp_path):
    store = CheckpointDir(tmp_path)
    _commit(store, 1)
    _commit(store, 2)
    store.reject([store.complete()[-1]])
    _commit(store, 2)  # the same step again, as a resumed run commits it
    store.reject([store.complete()[-1]])  # and rejected again: its own name, the first kept
    for step in (3, 4, 5):
        _commit(store, step)
        store.prune(keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rejected-step-00000002",
        "rejected-step-00000002.1",
        "step-00000005",
    ]
    for name in ("rejected-step-00000002", "rejected-step-00000002.1"):
        assert (tmp_path / name / "__0_0.distcp").read_text() == "state of step 2"
