"""A checkpoint directory on disk: which checkpoints are complete, and the
atomic commit that makes one complete.

    DIR/step-00000010/          complete: the stage files, meta.json and COMMITTED
    DIR/.partial-step-00000012/ being written (or left by a crash): never read
    DIR/.trash-step-00000004/   being deleted (keep-last-K): never read
    DIR/rejected-step-00000011/ failed verification at a resume: set aside, kept, never read

Every rank writes its files into the partial directory; after a barrier,
rank 0 writes ``meta.json`` and the ``COMMITTED`` marker (each fsynced) and
renames the directory into place, which is one atomic step on a POSIX file
system. A directory without the marker, or with a partial name, is not a
checkpoint. Deleting an old one first renames it out of the complete names,
so a crash mid-delete never leaves a half-deleted "complete" checkpoint.

The marker is the commit record: the size and SHA-256 of every file of the
checkpoint, the job that wrote it and each file's rank (and a SHA-256 of the
record itself): rank 0 commits only files whose bytes are those its own job's
ranks wrote, so a step mixed with another job's files never gets a record
(``checkpoint_owner.py`` keeps a second job out of the folder). A resume can tell a
checkpoint whose bytes changed after the commit (a flipped bit, a truncated
copy) from a good one before it loads any state (``problem``). Anything in
the way of a commit (an unmarked ``step-N``, a plain file of that name, a
left-over partial directory) is debris: it is moved aside, never an error. A checkpoint that fails
verification (a damaged record, a ``COMMITTED`` that is no file, a changed shard) is renamed to
``rejected-step-N``, out of every name rrfp reads, prunes or clears: the bytes stay for its user to
inspect or repair, and only that user deletes them.

Plain files, no torch: what a stage puts inside is ``checkpoint_state.py``'s business.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from rrfp.app.job.run_outputs import write_synced
from rrfp.app.train.checkpoint_owner import OWNER, NotOurs, read_owner

log = logging.getLogger("rrfp.app.train.checkpoint_dir")

MARKER = "COMMITTED"
META = "meta.json"
_COMPLETE = re.compile(r"step-(\d{8})")
_PARTIAL_PREFIXES = (".partial-", ".trash-")  # debris; never PROBE_PREFIX, a live job's probe
REJECTED_PREFIX = "rejected-"


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: the number of optimizer steps it holds, and where."""

    step: int
    path: Path

    def meta(self) -> dict:
        """Its meta.json: the step and the config that shaped the saved state."""
        return json.loads((self.path / META).read_text())

    def problem(self) -> str | None:
        """None when the checkpoint is the one its folder's name says (the step in its commit record
        and in its meta.json) and every file its commit record lists is there with the recorded size
        and SHA-256; else what is wrong, naming the file. Reads every byte of the checkpoint. A
        folder renamed or copied under another step's name is caught here, before any state
        loads."""
        try:
            step, files = _read_record(self.path / MARKER)
        except ValueError as e:
            return f"its commit record {MARKER} {e}"
        if step != self.step:
            return (
                f"its commit record is of step {step!r}, not of step {self.step} as its folder's "
                "name says (renamed or copied from another checkpoint)"
            )
        for name, want in sorted(files.items()):
            path = self.path / name
            try:
                size = path.stat().st_size
                if size != want["bytes"]:
                    return (
                        f"{name} has {size} bytes, its commit record says {want['bytes']} (cut "
                        "short or grown)"
                    )
                if _sha256(path) != want["sha256"]:
                    return (
                        f"{name} does not match its SHA-256 in the commit record (its bytes "
                        "changed)"
                    )
            except FileNotFoundError:
                return f"{name} is missing"
            except OSError as e:
                return f"{name} cannot be read: {e.strerror or e}"
        try:
            meta = self.meta()
        except (OSError, ValueError):
            return f"its {META} cannot be read as JSON"
        saved = (
            meta.get("step", self.step) if isinstance(meta, dict) else self.step
        )  # else: choose_resume's to name
        if saved != self.step:
            return (
                f"its {META} is of step {saved!r}, not of step {self.step} as its folder's name "
                "says (renamed or copied from another checkpoint)"
            )
        return None


class CheckpointDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def complete(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first: a ``step-N`` folder with a commit record (one that
        is a folder or a link is a damaged record, which ``problem`` names). Anything else in the
        directory is ignored."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _COMPLETE.fullmatch(p.name)
            if m and p.is_dir() and os.path.lexists(p / MARKER):
                found.append(Checkpoint(int(m.group(1)), p))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def incomplete(self) -> list[Path]:
        """What is not (or no longer) a checkpoint under a checkpoint's names: partial writes,
        unmarked or half-deleted directories, plain files named like them. Other files are the
        user's and are left alone."""
        if not self.root.is_dir():
            return []
        complete = {c.path for c in self.complete()}
        return sorted(
            p
            for p in self.root.iterdir()
            if p not in complete
            and (p.name.startswith(_PARTIAL_PREFIXES) or _COMPLETE.fullmatch(p.name))
        )

    def final_path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def partial_path(self, step: int) -> Path:
        """Where every rank writes the checkpoint of ``step`` before it is committed."""
        return self.root / f".partial-step-{step:08d}"

    def commit(
        self, step: int, meta: dict, job: str = "", written: list[dict[str, str]] | None = None
    ) -> Checkpoint:
        """Rank 0, once every rank has written its part: meta.json, then the commit record of
        every file's size and SHA-256 (the marker, last), then the rename. A committed
        checkpoint of the same step is never replaced (FileExistsError); debris there is set
        aside first. ``written``: per rank of ``job``, the files it wrote and their SHA-256
        (``checkpoint_state.written_files``); every file but meta.json must be one of them, with
        those bytes, else NotOurs (another job wrote into the folder) and nothing is committed;
        the record then names the job and each file's rank, binding the step to them."""
        partial, final = self.partial_path(step), self.final_path(step)
        write_synced(partial / META, json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        files = {
            str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(partial.rglob("*"))
            if p.is_file() and p.name != MARKER
        }
        if written is not None:
            _bind(files, written, job, partial)
        write_synced(partial / MARKER, _record_text(step, files, job))
        _fsync_dir(partial)
        if os.path.lexists(final):
            if final.is_dir() and not final.is_symlink() and os.path.lexists(final / MARKER):
                raise FileExistsError(f"{final} is already a committed checkpoint")
            self._set_aside(final)  # an unmarked step-N directory, or a plain file of that name
        os.rename(partial, final)
        _fsync_dir(self.root)
        log.info("committed checkpoint %s", final)
        return Checkpoint(step, final)

    def rejected_path(self, step: int) -> Path:
        """Where a checkpoint of ``step`` that failed verification goes: ``rejected-step-N``, or
        with ``.1``, ``.2`` ... when earlier rejects hold that name."""
        name = f"{REJECTED_PREFIX}{self.final_path(step).name}"
        names = (name + (f".{n}" if n else "") for n in itertools.count())
        return next(self.root / n for n in names if not os.path.lexists(self.root / n))

    def reject(self, checkpoints: list[Checkpoint]) -> list[Path]:
        """Set these checkpoints aside, each renamed to its ``rejected_path`` (rank 0: those that
        failed verification when the run started, before its first save, so none blocks the
        commit of its own step); their files are kept. Returns where each went."""
        moved = []
        for c in checkpoints:
            if c.path.is_dir():
                aside = self.rejected_path(c.step)
                os.rename(c.path, aside)
                moved.append(aside)
        if moved:
            _fsync_dir(self.root)
            log.warning(
                "set aside checkpoints that failed verification: %s",
                ", ".join(f"{c.path.name} as {p.name}" for c, p in zip(checkpoints, moved)),
            )
        return moved

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the ``keep`` newest complete checkpoints, and every incomplete
        entry. Rank 0 only, after a commit: no rank of this run writes here then."""
        removed = []
        for c in self.complete()[:-keep]:
            self._set_aside(c.path)  # no longer a checkpoint, before any of its files goes
            removed.append(c.path)
        _fsync_dir(self.root)
        self.clear_debris()
        if removed:
            log.info("deleted old checkpoints %s", ", ".join(p.name for p in removed))
        return removed

    def clear_debris(self) -> None:
        """Delete every incomplete entry (rank 0, when no rank of this run writes here)."""
        for p in self.incomplete():
            self._remove(p)

    def _set_aside(self, path: Path) -> Path:
        """Rename ``path`` to an unused trash name (renaming never needs the name to be free of
        a directory's contents, and a unique name never collides with earlier trash)."""
        names = (f".trash-{path.name}" + (f".{n}" if n else "") for n in itertools.count())
        trash = next(self.root / name for name in names if not os.path.lexists(self.root / name))
        os.rename(path, trash)
        return trash

    @staticmethod
    def _remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                pass


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _bind(files: dict, written: list[dict[str, str]], job: str, partial: Path) -> None:
    """Add to each file of ``files`` the rank of ``job`` that wrote it; NotOurs for a file no rank
    of it wrote, or whose bytes are not those it wrote."""
    by_name = {name: (rank, sha) for rank, own in enumerate(written) for name, sha in own.items()}
    for name, entry in files.items():
        if name == META:  # rank 0 writes it here, after the others
            entry["rank"] = 0
            continue
        rank, sha = by_name.get(name, (None, None))
        if rank is None or sha != entry["sha256"]:
            whose = (
                "no rank of this job wrote it"
                if rank is None
                else f"not the bytes rank {rank} wrote"
            )
            raise NotOurs(
                f"{partial / name} is {whose}: another job writes into {partial.parent} (its "
                f"{OWNER} record: {_owner_text(partial.parent)}); job {job} commits nothing there"
            )
        entry["rank"] = rank
    missing = sorted(set(by_name) - set(files))
    if missing:
        raise NotOurs(
            f"{partial / missing[0]}, written by rank {by_name[missing[0]][0]} of job {job}, is "
            f"gone: another job writes into {partial.parent} (its {OWNER} record: "
            f"{_owner_text(partial.parent)})"
        )


def _owner_text(root: Path) -> str:
    found = read_owner(root)
    return found[0].describe() if found is not None else "none"


def _record_text(step: int, files: dict, job: str = "") -> str:
    """The commit record: the files (each with the rank of ``job`` that wrote it, when bound), and
    the SHA-256 of their listing (so a damaged record is told apart from a damaged data file)."""
    body = json.dumps(
        {"step": step, "files": files, **({"job": job} if job else {})}, sort_keys=True
    )
    return json.dumps({"record": body, "sha256": hashlib.sha256(body.encode()).hexdigest()}) + "\n"


def _read_record(path: Path) -> tuple[object, dict]:
    """The step a commit record is of, and the files it lists: {name: {"bytes", "sha256"}};
    ValueError saying what is wrong with it otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot be read: {e.strerror or e}") from None
    try:
        outer = json.loads(raw)
    except ValueError:  # bad UTF-8 included
        if raw.startswith(b"step "):
            raise ValueError(
                "holds no checksums (written by an rrfp that did not record them), so the "
                "checkpoint cannot be verified"
            ) from None
        raise ValueError("is not valid JSON (damaged)") from None
    if not (
        isinstance(outer, dict)
        and isinstance(outer.get("record"), str)
        and isinstance(outer.get("sha256"), str)
    ):
        raise ValueError("is not a commit record (damaged)")
    if hashlib.sha256(outer["record"].encode()).hexdigest() != outer["sha256"]:
        raise ValueError("does not match its own SHA-256 (damaged)")
    try:
        body = json.loads(outer["record"])
    except ValueError:
        raise ValueError(
            "holds a sealed body that is not valid JSON (not written by rrfp)"
        ) from None
    files = body.get("files") if isinstance(body, dict) else None
    if (
        not isinstance(files, dict)
        or not files
        or not all(
            isinstance(v, dict)
            and isinstance(v.get("bytes"), int)
            and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise ValueError("lists no files")
    return body.get("step"), files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
