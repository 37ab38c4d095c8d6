"""The files a run writes only at its end (``output.trace``, ``.sizes``, ``.routing``), its
checkpoint folder, and what the other commands write when they finish (``--json``, ``--out``):
checked at the start, so a path that cannot be written costs one line (exit 2), not hours of
training or minutes of work."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from rrfp.app.errors import ConfigError, UsageError

if TYPE_CHECKING:  # the other commands check outputs without loading a run's config
    from rrfp.app.config.sections import OutputSection

END_FILES = ("trace", "sizes", "routing")  # output.* keys naming a file rank 0 writes at the end


def write_synced(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it, as a commit record or a folder probe needs."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# a probe's name (a file written and read back to check a folder): outside the checkpoint folder's
# debris prefixes (rrfp/app/train/checkpoint_dir.py), so that a job starting beside another on one
# folder never sweeps the other's probe away between its write and its read
PROBE_PREFIX = ".probe-"


def folder_problem(folder: str | Path) -> str | None:
    """Why ``folder`` (made if missing) cannot hold a file, or None: it is made, and a file is
    written in it, synced, and deleted. Every rank probes under its own name."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe = Path(folder) / f"{PROBE_PREFIX}{os.getpid()}-{socket.gethostname()}"
        write_synced(probe, "probe\n")
        probe.unlink()
    except FileExistsError as e:  # mkdir of a path that is a plain file
        return f"{e.filename} is a file, not a folder"
    except OSError as e:
        if e.filename and Path(e.filename).parent == Path(
            folder
        ):  # the folder is there; a file in it is not
            return f"cannot create a file in {folder}: {e.strerror or e}"
        return f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
    return None


def check_end_files(output: OutputSection) -> None:
    """ConfigError when ``output.trace`` or ``output.sizes`` names a folder, or a file in a folder
    that cannot be made or written, or when the folder ``output.dir``'s run folders go in cannot
    be (rank 0 makes the run's folder at the start)."""
    if output.dir:
        parent = Path(output.dir.format(model="m", time="t")).parent
        problem = folder_problem(parent)
        if problem is not None:
            raise ConfigError(f"output.dir = {output.dir} cannot be made: {problem}")
    for key in END_FILES:
        path = getattr(output, key)
        if not path:
            continue
        if Path(path).is_dir():
            raise ConfigError(
                f"output.{key} = {path} is a folder: give the path of the file to write"
            )
        problem = folder_problem(Path(path).parent)
        if problem is not None:
            raise ConfigError(
                f"output.{key} = {path} cannot be written: {problem} (checked at the start: "
                f"it is written when the run ends)"
            )


def check_output(what: str, path, folder: bool = False) -> None:
    """UsageError when a command could not write ``path`` (a file, or a ``folder`` of files) at its
    end; ``what`` names the flag that gave it (``--json``, ``--out``)."""
    problem = folder_problem(Path(path) if folder else Path(path).parent)
    if problem is not None:
        raise UsageError(f"{what} {path}: cannot write there: {problem}")
