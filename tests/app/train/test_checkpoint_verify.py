"""Verified checkpoints: a byte flipped in any file of the latest checkpoint (a
model shard, an optimizer shard, DCP's .metadata, meta.json, the commit record)
is found before anything is loaded and named; the run falls back to the newest
checkpoint that verifies and repeats an uninterrupted run's losses, or exits 2
(checkpoint.on_corrupt = stop). The checkpoints passed over are set aside as
rejected-step-N (kept), the good one it resumed from is kept, and debris never
blocks a commit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness.checkpoint_run import _config, one_error_line, rrfp_alone
from harness.distributed import run_ranks

from rrfp.app.train.checkpoint_dir import MARKER, META, CheckpointDir

# a step saved, the latest saved after it, and one more step run from the fallback: what is found,
# named and set aside, and the losses it repeats, do not depend on how many steps there are
SAVED_AT, LATEST, STEPS = 1, 2, 3


def _largest(path: Path, part: str) -> tuple[str, int]:
    """(file, offset) of the middle of the largest ``part`` ("model"/"optim.state") DCP tensor."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    info = max((v for k, v in storage.items() if f".{part}." in k.fqn), key=lambda v: v.length)
    return info.relative_path, info.offset + info.length // 2


def flip(ckpt: Path, kind: str) -> str:
    """Flip one byte of ``kind``'s file in checkpoint ``ckpt``; return that file's name."""
    name, offset = {
        "model shard": lambda: _largest(ckpt, "model"),
        "optimizer shard": lambda: _largest(ckpt, "optim.state"),
        ".metadata": lambda: (".metadata", 100),
        "meta.json": lambda: (META, 10),
        "commit record": lambda: (MARKER, 40),
    }[kind]()
    data = bytearray((ckpt / name).read_bytes())
    data[offset] ^= 0x40
    (ckpt / name).write_bytes(bytes(data))
    return name


KINDS = ["model shard", "optimizer shard", ".metadata", "meta.json", "commit record"]


def _resume_after_corruption(rank, world, root):
    """One process group: an uninterrupted run; a run that saves steps 2 and 4; then, per kind
    of file, a copy whose step LATEST has a flipped byte, resumed to STEPS (fallback)."""
    import datetime
    import filecmp

    import torch.distributed as dist

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoints import choose_resume
    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    root = Path(root)
    pristine = root / "pristine"
    out = {"whole": run(stage_main(_config(STEPS, "ready"))).losses}
    run(
        stage_main(
            _config(LATEST, "ready", checkpoint_dir=str(pristine), checkpoint_every=SAVED_AT)
        )
    )
    dist.barrier()
    for kind in KINDS:
        ckdir = root / kind.replace(" ", "-")
        if rank == 0:
            shutil.copytree(pristine, ckdir)
            out.setdefault("flipped", {})[kind] = flip(ckdir / f"step-{LATEST:08d}", kind)
        dist.barrier()
        cfg = _config(STEPS, "ready", checkpoint_dir=str(ckdir), resume="auto")
        assert isinstance(cfg, TrainConfig)
        resume = choose_resume(cfg)
        summary = run(stage_main(cfg, resume=resume))
        dist.barrier()
        good = f"step-{SAVED_AT:08d}"
        out[kind] = dict(
            start=resume.start.step,
            rejected=[(c.step, why) for c, why in resume.rejected],
            line=resume.fallback_line(),
            first_step=summary.first_step,
            losses=summary.losses,
            after=sorted(p.name for p in ckdir.iterdir()),
            good_untouched=(ckdir / good).is_dir()
            and not filecmp.dircmp(pristine / good, ckdir / good).diff_files,
        )
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    return root, run_ranks(_resume_after_corruption, 2, str(root), timeout=170)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_that_verifies(corrupted):
    _, results = corrupted
    whole = results[0]["whole"]
    assert len(whole) == STEPS
    for rank, out in results.items():
        for kind in KINDS:
            r, where = out[kind], f"rank {rank}, {kind}"
            name = results[0]["flipped"][kind]
            assert r["start"] == SAVED_AT and r["first_step"] == SAVED_AT, (
                f"{where}: resumed from {r['start']}"
            )
            assert len(r["rejected"]) == 1 and r["rejected"][0][0] == LATEST, (
                f"{where}: {r['rejected']}"
            )
            assert name in r["rejected"][0][1], (
                f"{where}: {name} not named in {r['rejected'][0][1]!r}"
            )
            assert (
                f"step-{LATEST:08d} failed verification" in r["line"]
                and "resuming from" in r["line"]
            ), r["line"]
            assert "\n" not in r["line"]
            # never continued from the corrupt state: the losses after SAVED_AT are an uninterrupted
            # run's
            assert r["losses"] == whole[SAVED_AT:], f"{where}: {r['losses']} != {whole[SAVED_AT:]}"
            # the corrupt LATEST set aside, the good SAVED_AT kept as it was, STEPS committed
            assert r["after"] == [
                f"rejected-step-{LATEST:08d}",
                f"step-{SAVED_AT:08d}",
                f"step-{STEPS:08d}",
            ], f"{where}: {r['after']}"
            assert r["good_untouched"], where


@pytest.mark.multirank
def test_stop_mode_exits_2_naming_the_file(corrupted, tmp_path):
    root, _ = corrupted
    from harness.checkpoint_run import resume_error

    for kind in KINDS:
        ckdir = tmp_path / kind.replace(" ", "-")
        shutil.copytree(root / "pristine", ckdir)
        name = flip(ckdir / f"step-{LATEST:08d}", kind)
        message = resume_error(ckdir, f"steps={STEPS}", "resume=auto", "checkpoint.on_corrupt=stop")
        assert f"checkpoint {ckdir / f'step-{LATEST:08d}'} failed verification: " in message, (
            message
        )
        assert name in message and "nothing was loaded" in message and "\n" not in message, message
        assert sorted(p.name for p in ckdir.iterdir()) == [
            f"step-{SAVED_AT:08d}",
            f"step-{LATEST:08d}",
        ], "a refusal deleted files"
    # through the command: exit 2 and one line, before any process group (a rendezvous nobody
    # serves)
    res = rrfp_alone(
        "--set",
        f"steps={STEPS}",
        "--set",
        f"checkpoint.dir={tmp_path / 'model-shard'}",
        "--set",
        "checkpoint.on_corrupt=stop",
        "--resume",
    )
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    one_error_line(res.stderr, "failed verification", "does not match its SHA-256")
    # no checkpoint that verifies: exit 2 in either mode, every problem named
    both = tmp_path / "both"
    shutil.copytree(root / "pristine", both)
    flip(both / f"step-{LATEST:08d}", "meta.json")
    (both / f"step-{SAVED_AT:08d}" / "__0_0.distcp").write_bytes(b"cut")
    message = resume_error(both, f"steps={STEPS}", "resume=auto")
    assert "no checkpoint in" in message and "verifies, nothing was loaded" in message, message
    assert (
        f"step-{LATEST:08d}: meta.json does not match" in message
        and f"step-{SAVED_AT:08d}: __0_0.distcp has 3 bytes" in message
    )


def test_debris_never_blocks_a_commit(tmp_path):
    store = CheckpointDir(tmp_path)

    def write(step: int) -> None:
        store.partial_path(step).mkdir()
        (store.partial_path(step) / "__0_0.distcp").write_text(f"data {step}")

    (tmp_path / "notes.txt").write_text("the user's")  # not ours: left alone
    # in the way of a commit: a plain file named like a checkpoint, an unmarked step directory with
    # files
    store.final_path(1).write_text("a plain file named like a checkpoint")
    (tmp_path / ".trash-step-00000001").write_text("earlier trash, in the way of a new one")
    write(1)
    assert store.commit(1, {"config": {}}).problem() is None
    store.final_path(2).mkdir()
    (store.final_path(2) / "__0_0.distcp").write_text("an unmarked step directory with files")
    write(2)
    assert store.commit(2, {"config": {}}).problem() is None
    # left by a crash where the next writes go: cleared at the run's start (RunCheckpoints.begin)
    store.partial_path(3).write_text("a plain file where a partial directory goes")
    store.partial_path(4).mkdir()
    (store.partial_path(4) / "__7_0.distcp").write_text("a stale file of a crashed write")
    store.clear_debris()
    for step in (3, 4):
        write(step)
        assert store.commit(step, {"config": {}}).problem() is None
        store.prune(keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "step-00000003",
        "step-00000004",
    ]
    assert not (store.final_path(4) / "__7_0.distcp").exists(), (
        "a stale file was mixed into a checkpoint"
    )
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def test_prune_keeps_the_newest_and_reject_takes_only_what_it_is_given(tmp_path):
    store = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        store.partial_path(step).mkdir()
        (store.partial_path(step) / "f").write_text(str(step))
        store.commit(step, {"config": {}})
    store.reject([store.complete()[1]])
    assert [c.step for c in store.complete()] == [1, 3]
    store.prune(keep=1)
    assert [c.step for c in store.complete()] == [3]
    with pytest.raises(FileExistsError):  # a committed checkpoint is never replaced
        store.partial_path(3).mkdir()
        store.commit(3, {"config": {}})


def test_a_commit_record_without_checksums_is_not_trusted(tmp_path):
    store = CheckpointDir(tmp_path)
    store.partial_path(1).mkdir()
    (store.partial_path(1) / "f").write_text("x")
    c = store.commit(1, {"config": {}})
    (c.path / MARKER).write_text("step 1\n")  # what rrfp wrote before it recorded checksums
    assert "holds no checksums" in c.problem()
    (c.path / MARKER).write_bytes(b"\xff\xfe")
    assert "is not valid JSON" in c.problem()
    (c.path / MARKER).unlink()
    assert store.complete() == []  # no marker: not a checkpoint at all


def _two_commits(root: Path) -> CheckpointDir:
    root.mkdir(exist_ok=True)
    store = CheckpointDir(root)
    for step in (4, 7):
        store.partial_path(step).mkdir()
        (store.partial_path(step) / "__0_0.distcp").write_text(f"state of step {step}")
        store.commit(step, {"config": {}})
    return store


def test_a_checkpoint_under_another_steps_name_is_caught_before_any_state_loads(tmp_path):
    """Copied as a later step, or two swapped by name: the step its record and meta.json hold is not
    its folder's, and it is treated as corrupt (passed over for the newest that is what its name
    says)."""
    store = _two_commits(tmp_path / "copied")
    shutil.rmtree(store.final_path(7))
    shutil.copytree(store.final_path(4), store.final_path(7))
    assert store.final_path(7).is_dir() and [c.step for c in store.complete()] == [4, 7]
    assert (
        "commit record is of step 4, not of step 7 as its folder's name says"
        in store.complete()[1].problem()
    )
    assert store.complete()[0].problem() is None
    swapped = _two_commits(tmp_path / "swapped")
    swapped.final_path(4).rename(tmp_path / "swapped" / "x")
    swapped.final_path(7).rename(swapped.final_path(4))
    (tmp_path / "swapped" / "x").rename(swapped.final_path(7))
    problems = [c.problem() for c in swapped.complete()]
    assert (
        "is of step 7, not of step 4" in problems[0]
        and "is of step 4, not of step 7" in problems[1]
    ), problems


def test_a_record_sealed_over_a_body_that_lists_no_files_is_named(tmp_path):
    """A seal matching its body, where the body is no object of files: one reason, no TypeError."""
    import hashlib
    import json

    store = _two_commits(tmp_path)
    c = store.complete()[0]
    for body, why in [
        ("[]", "lists no files"),
        ('{"step": 4}', "lists no files"),
        ('{"step": 4, "files": []}', "lists no files"),
        ("not json", "not valid JSON"),
    ]:
        (c.path / MARKER).write_text(
            json.dumps({"record": body, "sha256": hashlib.sha256(body.encode()).hexdigest()})
        )
        assert why in c.problem(), (body, c.problem())


@pytest.mark.multirank
def test_a_renamed_checkpoint_is_passed_over_at_resume(corrupted, tmp_path):
    """Through the resume plan of a real run's checkpoints: step LATEST copied in as the step after
    it is rejected and the run falls back to LATEST; SAVED_AT and LATEST swapped by name verify
    nowhere: one line, nothing loaded."""
    from harness.checkpoint_run import SMALL, resume_error

    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoints import choose_resume

    root, _ = corrupted
    copied = tmp_path / "copied"
    shutil.copytree(root / "pristine", copied)
    shutil.copytree(copied / f"step-{LATEST:08d}", copied / f"step-{LATEST + 1:08d}")
    cfg = TrainConfig.load(
        SMALL[1],
        [s for s in SMALL[2:] if s != "--set"]
        + [f"checkpoint.dir={copied}", f"steps={STEPS}", "resume=auto"],
        world_size=2,
    )
    plan = choose_resume(cfg)
    assert plan.start.step == LATEST and [c.step for c, _ in plan.rejected] == [LATEST + 1], plan
    assert "renamed or copied from another checkpoint" in plan.fallback_line(), plan.fallback_line()
    swapped = tmp_path / "swapped"
    shutil.copytree(root / "pristine", swapped)
    (swapped / f"step-{SAVED_AT:08d}").rename(swapped / "x")
    (swapped / f"step-{LATEST:08d}").rename(swapped / f"step-{SAVED_AT:08d}")
    (swapped / "x").rename(swapped / f"step-{LATEST:08d}")
    message = resume_error(swapped, f"steps={STEPS}", "resume=auto")
    assert "verifies, nothing was loaded" in message and "\n" not in message, message
    assert f"not of step {LATEST} as its folder's name says" in message, message
    assert f"not of step {SAVED_AT} as" in message, message
