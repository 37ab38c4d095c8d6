"""torch's schedule CSV (``_dump_csv`` / ``_load_csv``, "compute_only") read as an rrfp hint.

torch writes one row per rank, one cell per action: ``<stage><type><microbatch>``
with type F (forward), B (full backward), I (input gradient) or W (weight
gradient), or an empty cell for an idle slot (torch 2.13,
torch/distributed/pipelining/schedules.py, ``_Action.from_str``). rrfp takes the
row of a stage as that stage's priority order: F -> F, B -> B (whole backward),
I -> B and W -> W (split backward). A schedule torch lowered with its
communication ("compute_comms": SEND_F, RECV_B, ...) or with FSDP actions
(UNSHARD, RESHARD, REDUCE_GRAD) has nothing rrfp could follow, and is refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path

from rrfp.core.hints import Hint, HintError, csv_rows
from rrfp.core.tasks import Kind, Task

_ACTION = re.compile(r"(\d+)([A-Z_]+)(\d*)")
_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.B, "W": Kind.W}


def read_torch_csv(path: str | Path) -> tuple[Hint, bool]:
    """The hint that torch's CSV at ``path`` describes, and whether its backward is split (I/W)."""
    path = Path(path)
    per_stage: dict[int, list[Task]] = {}
    types: set[str] = set()
    for rank, row in enumerate(csv_rows(path, "torch schedule CSV")):
        for cell in (c.strip() for c in row):
            if not cell:
                continue  # an idle slot
            m = _ACTION.fullmatch(cell)
            if m is None or m.group(2) not in _KINDS or not m.group(3):
                what = (
                    "an action rrfp runs itself (communication or FSDP)" if m else "not an action"
                )
                raise HintError(
                    f"torch schedule CSV {path}, row {rank}: {cell!r} is {what}; only "
                    f"compute_only schedules of F, B, I and W with a microbatch index are read"
                )
            types.add(m.group(2))
            per_stage.setdefault(int(m.group(1)), []).append(
                Task(_KINDS[m.group(2)], int(m.group(3)))
            )
    if not per_stage:
        raise HintError(f"torch schedule CSV {path}: no actions")
    if "B" in types and types & {"I", "W"}:
        raise HintError(
            f"torch schedule CSV {path}: mixes full backwards (B) with split ones (I, W); "
            f"rrfp runs one kind per schedule"
        )
    split = bool(types & {"I", "W"})

    def order(S: int, s: int, M: int, split_now: bool) -> list[Task]:
        if s not in per_stage:
            raise HintError(f"torch schedule CSV {path}: no actions for stage {s} of {S}")
        if split_now != split:
            raise HintError(
                f"torch schedule CSV {path}: its backward is {'split' if split else 'whole'}, "
                f"the executor's is {'split' if split_now else 'whole'}"
            )
        return per_stage[s]

    return Hint(f"torch-csv:{path.name}", order), split
