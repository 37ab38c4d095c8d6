"""A stage's training state in a checkpoint, written and read with
``torch.distributed.checkpoint`` (DCP).

Each stage holds a different module, so the state dict is keyed by where it
lives: ``stage{s}.tp{t}`` holds that shard's model and optimizer state (DP
replicas hold the same values under the same keys, and DCP writes one copy; with expert
parallelism, ``stage{s}.tp{t}.ep{e}`` that of the EP group's member ``e``, whose experts differ),
``rank{r}`` holds that rank's RNG states. Every rank writes its own file in
parallel and DCP's coordinator writes ``.metadata`` once all have finished.
The directory protocol around it (partial directory, marker, rename) is
``checkpoint_dir.py``. DCP (and the DTensor machinery under it) is imported when a checkpoint is
written, read or checked, not with this module: a run that saves none does not load it.

rrfp draws no numbers from Python's or numpy's global generators (batches use
a generator seeded by (seed, step, microbatch), emulated durations a
counter-based hash), so the torch generators are the only RNG state there is.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rrfp.core.errors import PipelineError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import CheckpointException

    from rrfp.app.train.checkpoint_storage import Working

log = logging.getLogger("rrfp.app.train.checkpoint_state")


class CheckpointError(PipelineError):
    """A checkpoint that cannot be written or loaded into this stage; the message says why
    (a PipelineError: this rank's own failure, such as a full disk, not a bug)."""


def _idle(what: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def stage_key(stage: int, tp_rank: int, ep_rank: int | None = None) -> str:
    """The key of a stage's state; ``ep_rank``: the member of its EP group (None: no EP)."""
    return f"stage{stage}.tp{tp_rank}" + (f".ep{ep_rank}" if ep_rank is not None else "")


def rng_state(device: torch.device) -> dict:
    """This process's torch generators now (the CPU's, and ``device``'s on CUDA)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _parts(module, opt, stage) -> list[tuple[int, torch.nn.Module, torch.optim.Optimizer]]:
    """(stage, module, optimizer) per stage of the rank: virtual stages pass lists of all three."""
    if isinstance(module, (list, tuple)):
        return list(zip(stage, module, opt, strict=True))
    return [(stage, module, opt)]


def _state(
    module,
    opt,
    rank: int,
    stage,
    tp_rank: int,
    device: torch.device,
    rng: dict | None = None,
    ep_rank: int | None = None,
) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {}
    for s, m, o in _parts(module, opt, stage):
        model_sd, optim_sd = get_state_dict(m, o)  # FQN-keyed; a fresh optimizer's state is created
        state[stage_key(s, tp_rank, ep_rank)] = {"model": model_sd, "optim": optim_sd}
    return {**state, f"rank{rank}": {"rng": rng if rng is not None else rng_state(device)}}


def save_stage(
    path: Path,
    module: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    rank: int,
    stage: int,
    tp_rank: int,
    device: torch.device,
    process_group=None,
    rng: dict | None = None,
    working: Working = _idle,
    ep_rank: int | None = None,
) -> None:
    """Collective over ``process_group`` (every rank calls it); blocking, so the
    caller runs it off the event loop. Returns once every rank's files and the
    metadata are written. ``rng``: the generators to record (``rng_state``) when
    not the current ones, e.g. those of the start of a step a stop abandoned. Virtual
    stages: ``module``, ``opt`` and ``stage`` are lists, one entry per stage of the rank,
    each saved under its own stage key. ``working``: marks this rank's own writes (``Working``)."""
    import torch.distributed.checkpoint as dcp

    from rrfp.app.train.checkpoint_storage import MarkedWriter

    state = _state(module, opt, rank, stage, tp_rank, device, rng, ep_rank)
    try:
        dcp.save(state, storage_writer=MarkedWriter(path, working), process_group=process_group)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {_causes(e)}") from None


def load_stage(
    path: Path,
    module: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    rank: int,
    stage: int,
    tp_rank: int,
    device: torch.device,
    process_group=None,
    working: Working = _idle,
    ep_rank: int | None = None,
) -> None:
    """Collective, blocking: load this stage's model, optimizer and this rank's
    RNG state in place (virtual stages: lists, as ``save_stage``). A failure on any rank raises
    CheckpointError on every rank. ``working``: marks this rank's own reads (``Working``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from rrfp.app.train.checkpoint_storage import MarkedReader

    state = _state(module, opt, rank, stage, tp_rank, device, ep_rank=ep_rank)
    try:
        dcp.load(state, storage_reader=MarkedReader(path, working), process_group=process_group)
    except (
        dcp.CheckpointException
    ) as e:  # a BaseException in torch: turn it into an error the CLI reports
        raise CheckpointError(f"cannot load checkpoint {path}: {_causes(e)}") from None
    for s, m, o in _parts(module, opt, stage):
        part = state[stage_key(s, tp_rank, ep_rank)]
        set_state_dict(m, o, model_state_dict=part["model"], optim_state_dict=part["optim"])
    rng = state[f"rank{rank}"]["rng"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _causes(e: CheckpointException) -> str:
    """Each failed rank's error on one line (DCP pairs each error with its stack), the ranks
    that failed alike together; a full disk's as its words (``disk_errors.py``)."""
    from rrfp.app.train.disk_errors import DiskFull

    said: dict[str, list[int]] = {}
    for r, x in sorted(e.failures.items()):
        x = x[0] if isinstance(x, tuple) else x
        said.setdefault(
            str(x) if isinstance(x, DiskFull) else f"{type(x).__name__}: {x}", []
        ).append(r)
    return "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {words}"
        for words, ranks in said.items()
    )


def written_files(path: Path, group_rank: int) -> dict[str, str]:
    """The files this rank's part of ``save_stage`` wrote into ``path``, by name, each with its
    SHA-256: DCP's writer names a rank's files ``__R_N.distcp`` (R: its rank in the save's group),
    and the coordinator (group rank 0) writes ``.metadata``. What a commit binds to the job."""
    names = sorted(p.name for p in Path(path).glob(f"__{group_rank}_*.distcp"))
    if group_rank == 0:
        names.append(".metadata")
    out = {}
    for name in names:
        with open(Path(path) / name, "rb") as f:
            out[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def check_readable(path: Path, keys: list[str]) -> None:
    """Without any process group: the checkpoint's DCP metadata reads and holds
    the state these ``keys`` (stage_key / rank prefixes) need."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # a missing or truncated .metadata: any error of the unpickling
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from None
    saved = metadata.state_dict_metadata
    missing = [k for k in keys if not any(s.startswith(k + ".") for s in saved)]
    if missing:
        raise CheckpointError(f"checkpoint {path} holds no state for {', '.join(missing)}")
