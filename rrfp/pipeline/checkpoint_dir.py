"""A checkpoint directory on disk: which checkpoints are complete, and the
atomic commit that makes one complete.

    DIR/step-00000010/          complete: the stage files, meta.json and COMMITTED
    DIR/.partial-step-00000012/ being written (or left by a crash): never read
    DIR/.trash-step-00000004/   being deleted (keep-last-K): never read

Every rank writes its files into the partial directory; after a barrier,
rank 0 writes ``meta.json`` and the ``COMMITTED`` marker (each fsynced) and
renames the directory into place, which is one atomic step on a POSIX file
system. A directory without the marker, or with a partial name, is not a
checkpoint. Deleting an old one first renames it out of the complete names,
so a crash mid-delete never leaves a half-deleted "complete" checkpoint.

Plain files, no torch: what a stage puts inside is ``checkpoint.py``'s business.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rrfp.pipeline.checkpoint_dir")

MARKER = "COMMITTED"
META = "meta.json"
_COMPLETE = re.compile(r"step-(\d{8})")
_PARTIAL_PREFIXES = (".partial-", ".trash-")


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: the number of optimizer steps it holds, and where."""

    step: int
    path: Path

    def meta(self) -> dict:
        """Its meta.json: the step and the config that shaped the saved state."""
        return json.loads((self.path / META).read_text())


class CheckpointDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def complete(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first. Anything else in the directory is ignored."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _COMPLETE.fullmatch(p.name)
            if m and p.is_dir() and (p / MARKER).is_file():
                found.append(Checkpoint(int(m.group(1)), p))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def incomplete(self) -> list[Path]:
        """Directories that are not (or no longer) checkpoints: partial writes, unmarked, half-deleted."""
        if not self.root.is_dir():
            return []
        complete = {c.path for c in self.complete()}
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p not in complete
                      and (p.name.startswith(_PARTIAL_PREFIXES) or _COMPLETE.fullmatch(p.name)))

    def final_path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def partial_path(self, step: int) -> Path:
        """Where every rank writes the checkpoint of ``step`` before it is committed."""
        return self.root / f".partial-step-{step:08d}"

    def commit(self, step: int, meta: dict) -> Checkpoint:
        """Rank 0, once every rank has written its part: the marker last, then the rename."""
        partial, final = self.partial_path(step), self.final_path(step)
        _write_synced(partial / META, json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        _write_synced(partial / MARKER, f"step {step}\n")
        _fsync_dir(partial)
        os.rename(partial, final)  # fails, rather than mixing, if a step-N directory is already there
        _fsync_dir(self.root)
        log.info("committed checkpoint %s", final)
        return Checkpoint(step, final)

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the ``keep`` newest complete checkpoints, and every incomplete
        directory. Rank 0 only, after a commit: no rank of this run writes here then."""
        removed = []
        for c in self.complete()[:-keep]:
            trash = self.root / f".trash-{c.path.name}"
            os.rename(c.path, trash)  # no longer a checkpoint, before any of its files goes
            removed.append(c.path)
        _fsync_dir(self.root)
        for p in self.incomplete():
            shutil.rmtree(p, ignore_errors=True)
        if removed:
            log.info("deleted old checkpoints %s", ", ".join(p.name for p in removed))
        return removed


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
