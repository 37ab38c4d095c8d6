"""Chrome trace (Perfetto) JSON for timelines, simulated or measured, written atomically."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


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
            rank = (
                f" (rank {sp.args['rank']})" if "rank" in sp.args else ""
            )  # virtual stages: a rank holds several
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid,
                    "tid": sp.stage,
                    "args": {"name": f"stage {sp.stage}{rank}"},
                }
            )
        events.append(
            {
                "ph": "X",
                "name": sp.name,
                "cat": sp.name[:1],
                "pid": pid,
                "tid": sp.stage,
                "ts": sp.start * 1e6,
                "dur": max(0.0, sp.end - sp.start) * 1e6,
                "args": sp.args,
            }
        )
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_atomic(path: str | Path, text: str | bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: never half-written. The file gets the
    mode any new file gets (0666 less the umask), as ``open`` would give it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1))
