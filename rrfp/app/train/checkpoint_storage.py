"""DCP's file writer and reader, marking what the rank does while it writes or reads its files.

Between those writes and reads the rank waits in DCP's collectives; its heartbeat says
``writing checkpoint NAME`` / ``reading checkpoint NAME`` meanwhile, so the peers waiting for it
see a long write as progress (rrfp/comm/collective_wait.py). A write that a full disk or a file
size limit stops is raised as a ``DiskFull`` saying so (``disk_errors.py``), on the rank that
wrote, before DCP sends the failure to the others. Subclasses of DCP's classes, so this
module imports ``torch.distributed.checkpoint``: ``checkpoint_state.py`` imports it only when a
checkpoint is written or read, and a run that saves none never loads DCP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp

from rrfp.app.train.disk_errors import disk_errors

# what a rank does meanwhile (``writing checkpoint ...``), as its heartbeat tells the peers
Working = Callable[[str], contextlib.AbstractContextManager]


class MarkedWriter(dcp.FileSystemWriter):
    """DCP's file writer, saying ``writing checkpoint NAME`` while it writes this rank's files and
    (the coordinator) the metadata: between those, the rank waits in DCP's collectives."""

    def __init__(self, path: Path, working: Working) -> None:
        super().__init__(path)
        self._what, self._working = f"writing checkpoint {Path(path).name}", working
        self._folder = Path(path)

    def write_data(self, plan, planner):
        with self._working(self._what), disk_errors(self._folder):
            return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        with self._working(self._what), disk_errors(self._folder):
            super().finish(metadata, results)


class MarkedReader(dcp.FileSystemReader):
    """DCP's file reader, saying ``reading checkpoint NAME`` while it reads this rank's part."""

    def __init__(self, path: Path, working: Working) -> None:
        super().__init__(path)
        self._what, self._working = f"reading checkpoint {Path(path).name}", working

    def read_data(self, plan, planner):
        with self._working(self._what):
            return super().read_data(plan, planner)
