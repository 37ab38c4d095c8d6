"""torch's schedule CSV (``_dump_csv`` / ``_load_csv``, "compute_only") read as an rrfp hint.

torch writes one row per rank of the pipeline, one cell per action: ``<stage><type><microbatch>``
with type F (forward), B (full backward), I (input gradient) or W (weight gradient), or an empty
cell for an idle slot (torch 2.13, torch/distributed/pipelining/schedules.py, ``_Action.from_str``).
A row holds every action of the rank, over all the stages it holds: one stage with
``Schedule1F1B``, two with ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` or
``ScheduleZBVZeroBubble`` (the schedules torch dumps and loads CSVs for). rrfp takes row r as rank
r's priority order over its stages' tasks: F -> F, B -> B (whole backward), I -> B and W -> W
(split backward), the idle slots dropped. Row r must hold exactly the stages rrfp places on rank
r (interleaved r, r + S, ...; v r, 2S - 1 - r), and each stage's tasks every microbatch's once.

Not taken, each refused in one line naming the cell: communication and FSDP actions (SEND_F,
RECV_B, UNSHARD, REDUCE_GRAD, ...: torch's "compute_comms" format, the default of ``_dump_csv`` on
multi-stage schedules; rrfp does its own communication), DualPipeV's overlapped pairs
(OVERLAP_F_B), other action types, and a schedule that mixes whole backwards (B) with split ones
(I, W): rrfp runs one kind per schedule.
"""

from __future__ import annotations

import re
from pathlib import Path

from rrfp.core.hints import Hint, HintError, csv_rows
from rrfp.core.placement import VirtualLayout
from rrfp.core.tasks import Kind, Task

_ACTION = re.compile(r"(\d+)([A-Z_]+)(\d*)")
_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.B, "W": Kind.W}
# torch's actions that rrfp does itself (its channels, FSDP hooks): what compute_comms adds
_RUNS_ITSELF = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}


def _refusal(cell: str) -> str:
    """Why ``cell`` is no action rrfp follows."""
    m = _ACTION.fullmatch(cell)
    if "OVERLAP_F_B" in cell:
        return (
            "an overlapped forward and backward (DualPipeV's OVERLAP_F_B), which rrfp does not take"
        )
    if m is None:
        return "not an action"
    if m.group(2) in _RUNS_ITSELF:
        return (
            "an action rrfp runs itself (communication or FSDP: torch's compute_comms format; "
            "dump with _dump_csv(path, format='compute_only'))"
        )
    if m.group(2) in _KINDS:
        return "an action without a microbatch index"
    return f"an unknown action type {m.group(2)!r}"


def read_torch_csv(path: str | Path) -> tuple[Hint, bool]:
    """The hint that torch's CSV at ``path`` describes, and whether its backward is split (I/W)."""
    path = Path(path)
    rows: list[list[tuple[int, Task]]] = []  # per rank: its (stage, task) pairs in torch's order
    types: set[str] = set()
    for rank, row in enumerate(csv_rows(path, "torch schedule CSV")):
        pairs = []
        for cell in (c.strip() for c in row):
            if not cell:
                continue  # an idle slot
            m = _ACTION.fullmatch(cell)
            if m is None or m.group(2) not in _KINDS or not m.group(3):
                raise HintError(
                    f"torch schedule CSV {path}, row {rank}: {cell!r} is {_refusal(cell)}; only "
                    f"compute_only schedules of F, B, I and W with a microbatch index are read"
                )
            types.add(m.group(2))
            pairs.append((int(m.group(1)), Task(_KINDS[m.group(2)], int(m.group(3)))))
        rows.append(pairs)
    per_stage: dict[int, list[Task]] = {}
    for pairs in rows:
        for s, t in pairs:
            per_stage.setdefault(s, []).append(t)
    if not per_stage:
        raise HintError(f"torch schedule CSV {path}: no actions")
    if "B" in types and types & {"I", "W"}:
        raise HintError(
            f"torch schedule CSV {path}: mixes full backwards (B) with split ones (I, W); "
            f"rrfp runs one kind per schedule"
        )
    split = bool(types & {"I", "W"})
    stages = sorted(per_stage)
    n_microbatches = 1 + max(t.mb for tasks in per_stage.values() for t in tasks)

    def check(S: int, M: int, split_now: bool) -> None:
        if stages != list(range(S)):
            raise HintError(
                f"torch schedule CSV {path}: it has actions for stages "
                f"{', '.join(map(str, stages))}, the pipeline has stages 0 to {S - 1}"
            )
        if split_now != split:
            raise HintError(
                f"torch schedule CSV {path}: its backward is {'split' if split else 'whole'}, "
                f"the executor's is {'split' if split_now else 'whole'}"
            )
        if n_microbatches != M:
            raise HintError(
                f"torch schedule CSV {path}: written for {n_microbatches} microbatches, the "
                f"schedule has {M}"
            )

    def order(S: int, s: int, M: int, split_now: bool) -> list[Task]:
        check(S, M, split_now)
        return per_stage[s]

    def rank_order(layout: VirtualLayout, rank: int, M: int, split_now: bool):
        check(layout.num_stages, M, split_now)
        if len(rows) != layout.ranks:
            raise HintError(
                f"torch schedule CSV {path}: {len(rows)} rows (one per rank), the pipeline has "
                f"{layout.ranks} ranks"
            )
        held = sorted({s for s, _ in rows[rank]})
        if held != sorted(layout.stages_of(rank)):
            raise HintError(
                f"torch schedule CSV {path}, row {rank}: actions for stages "
                f"{', '.join(map(str, held))}, but rank {rank} holds stages "
                f"{', '.join(map(str, layout.stages_of(rank)))} ({layout.placement} placement)"
            )
        return rows[rank]

    return Hint(f"torch-csv:{path.name}", order, rank_fn=rank_order), split
