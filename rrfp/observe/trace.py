"""Chrome trace (Perfetto) JSON for timelines, simulated or measured, written atomically into a
folder a run probes at its start."""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True, slots=True)
class Span:
    process: str  # e.g. "ready bfw" or "rank 2"
    stage: int
    name: str  # task, e.g. "F3"
    start: float  # seconds
    end: float
    args: dict = field(default_factory=dict)


def chrome_trace(spans: Iterable[Span]) -> dict:
    """One process per ``Span.process``, one thread row per stage (named with its rank when a span
    carries ``args["rank"]``)."""
    events: list[dict] = []
    pids: dict[str, int] = {}
    rows: set[tuple[int, int]] = set()
    for sp in spans:
        pid = pids.setdefault(sp.process, len(pids))
        if (pid, sp.stage) not in rows:
            rows.add((pid, sp.stage))
            rank = f" (rank {sp.args['rank']})" if "rank" in sp.args else ""  # virtual stages: a rank holds several
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": sp.stage,
                           "args": {"name": f"stage {sp.stage}{rank}"}})
        events.append({"ph": "X", "name": sp.name, "cat": sp.name[:1], "pid": pid, "tid": sp.stage,
                       "ts": sp.start * 1e6, "dur": max(0.0, sp.end - sp.start) * 1e6, "args": sp.args})
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def probe_folder(folder: str | Path, who: str) -> None:
    """Make ``folder`` and write a file in it, synced, then delete it: at a run's start, so a folder
    that cannot hold what the run writes (a checkpoint, its trace at the end) fails there. ``who``
    makes the file's name unique among the ranks probing at once. OSError when it cannot."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".partial-probe-{who}"
    with open(probe, "w") as f:
        f.write("probe\n")
        f.flush()
        os.fsync(f.fileno())
    probe.unlink()


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: never half-written. The file gets the
    mode any new file gets (0666 less the umask), as ``open`` would give it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        with open(tmp, "xb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _temporary(path: Path) -> Path:
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1))
