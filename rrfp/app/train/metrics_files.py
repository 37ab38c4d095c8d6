"""Where a run's metrics go: its own folder, a JSON line per step, and TensorBoard events when the
``tensorboard`` package is installed.

Each run gets a new folder (a name taken by an earlier run gets a ``-2``, ``-3``... suffix), so no
run's file is ever written over; each line is flushed as written, so a run that crashes keeps
every step it logged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def model_slug(model: str) -> str:
    """``run.model`` as one file-name part: a file path without its ``.py``, its separators and
    an attribute's made dashes (``path/to/net.py:small`` -> ``path-to-net-small``)."""
    return model.replace(".py:", ":").removesuffix(".py").replace(":", "-").replace("/", "-")


def run_folder(template: str, model: str, now: float | None = None) -> Path:
    """A new folder from ``template`` (``{model}`` and ``{time}``, UTC, filled in), made here."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    base = Path(template.format(model=model_slug(model), time=stamp))
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: 10000 runs already have this folder's name")


def _plain(value: Any) -> Any:
    """A JSON value: NaN and infinities (a skipped step's loss) as null, which JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonLines:
    """A file of one JSON object per line, created here (never an existing one), each line
    flushed as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 - open for the run

    def write(self, record: dict[str, Any]) -> None:
        """``record`` as one line; fields that are None (not measured this run) are left out."""
        line = {k: _plain(v) for k, v in record.items() if v is not None}
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardEvents:
    """Scalars as TensorBoard event files (torch.utils.tensorboard), flushed every step."""

    def __init__(self, writer) -> None:
        self._writer = writer

    @classmethod
    def open(cls, folder: str | Path) -> TensorBoardEvents | None:
        """Events in ``folder``, or None (logged once) without the ``tensorboard`` package."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log.info("TensorBoard events off: the tensorboard package is not installed")
            return None
        return cls(SummaryWriter(log_dir=str(folder)))

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        for name, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
