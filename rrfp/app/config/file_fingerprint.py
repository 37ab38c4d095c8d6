"""What the files a workload's [model] and [data] sections name hold: a fingerprint per file.

The ranks of a job must train on the same bytes, and a resumed run on the bytes its checkpoint
was trained on; a path says neither. A key whose value names an existing file, folder or glob
(``data.tokens``, ``data.text``, ``data.tokenizer``, an HF ``model.path``...) stands for the
files there (a folder: every file under it), each fingerprinted by its size and a SHA-256.

The SHA-256 is of the whole file up to ``FULL_BYTES``: a token file of that size reads in well
under a second. Above it, every rank of every start would read the whole corpus (a 100 GB token
file: minutes per rank), so the hash covers the size, the first and the last MiB and ``SAMPLES``
evenly spaced 64 KiB pieces (about 4 MiB): a file replaced, regenerated, re-tokenized, cut short
or grown changes it; an edit of a few bytes between the samples of a large file does not, and a
fingerprint says which kind it is (``sha256`` or ``sampled sha256``). A fingerprint is kept per
(path, size, mtime, inode) for the life of the process, so a run computes each once.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
from pathlib import Path
from typing import Any

FULL_BYTES = 256 * 2**20  # hashed in full up to this size
EDGE_BYTES = 2**20  # above it: the first and last MiB ...
SAMPLES, SAMPLE_BYTES = 32, 64 * 2**10  # ... and 32 pieces of 64 KiB between them
MAX_FILES = 100_000  # a folder holding more is named as too large to fingerprint
# keys whose files are a cache or a place to write, not what the run trains on
NOT_INPUTS = frozenset({"cache_dir", "out_dir", "output_dir", "log_dir"})


def section_files(section: Any) -> dict[str, list[Path]]:
    """``{key: files}`` for each string or path field of a workload's config dataclass that names
    an existing file, folder (its files, recursively) or glob; files in sorted order."""
    if not dataclasses.is_dataclass(section):
        return {}
    found = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name in NOT_INPUTS or not isinstance(value, (str, Path)) or not str(value):
            continue
        files = _files(str(value))
        if files is not None:
            found[f.name] = files
    return found


def _files(text: str) -> list[Path] | None:
    """The files ``text`` names, or None when it names none (not a path: a name, a word)."""
    path = Path(text).expanduser()
    try:
        if path.is_file():
            return [path]
        if path.is_dir():
            return sorted(p for p in path.rglob("*") if p.is_file())
    except OSError:
        return None
    if glob.has_magic(text):
        matched = sorted(Path(p) for p in glob.glob(os.path.expanduser(text), recursive=True))
        return [p for p in matched if p.is_file()] or None
    return None


def fingerprints(sections: dict[str, Any]) -> dict[str, str]:
    """``{"SECTION.KEY FILE": fingerprint}`` for every file the sections' keys name
    (``{"model": cfg.model, "data": cfg.data}``)."""
    out = {}
    for name, section in sections.items():
        for key, files in section_files(section).items():
            if len(files) > MAX_FILES:
                out[f"{name}.{key} {files[0].parent}"] = f"{len(files)} files (too many to check)"
                continue
            for path in files:
                out[f"{name}.{key} {path}"] = fingerprint(path)
    return out


def fingerprint(path: Path) -> str:
    """``N bytes, sha256 HEX`` (or ``sampled sha256``), or why it cannot be read."""
    try:
        st = path.stat()
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return _fingerprint(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def _fingerprint(path: str, size: int, mtime_ns: int, inode: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    try:
        with open(path, "rb") as f:
            if size <= FULL_BYTES:
                digest.update(f.read())
                kind = "sha256"
            else:
                step = (size - 2 * EDGE_BYTES) // (SAMPLES + 1)
                pieces = [(0, EDGE_BYTES), (size - EDGE_BYTES, EDGE_BYTES)] + [
                    (EDGE_BYTES + step * (i + 1), SAMPLE_BYTES) for i in range(SAMPLES)
                ]
                for offset, length in pieces:
                    f.seek(offset)
                    digest.update(f.read(length))
                kind = "sampled sha256"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return f"{size} bytes, {kind} {digest.hexdigest()[:16]}"
