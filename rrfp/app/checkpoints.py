"""A training run's checkpoints: which one it resumes from (decided before any
process group exists, so a mismatch is one error line on every rank), and
saving one when the run asks (every N steps, at the end, on SIGTERM).

A checkpoint records the config that shaped its state (``fingerprint``): the
workload, the layout, the microbatch count, the model and data configs. A
different value in any of them is refused: the saved tensors would not fit, or
the batches (a pure function of the data config and the step) would not
continue where they stopped. lr and weight decay may change; the config wins.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import torch

from rrfp.app.config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.pipeline.checkpoint import CheckpointError, check_readable, load_stage, save_stage, stage_key
from rrfp.pipeline.checkpoint_dir import Checkpoint, CheckpointDir
from rrfp.pipeline.runtime import PipelineRuntime

log = logging.getLogger("rrfp.app.checkpoints")


def fingerprint(cfg: TrainConfig) -> dict:
    """What must be equal for a checkpoint to continue this run, as plain JSON values."""
    lay = cfg.layout
    return json.loads(json.dumps({
        "run": {"model": cfg.run.model, "pp": lay.pp, "tp": lay.tp, "dp": lay.dp,
                "microbatches": cfg.run.microbatches},
        "model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data)}))


def differences(saved: dict, now: dict) -> list[str]:
    """``section.key: checkpoint A, this run B`` for every key that differs."""
    out = []
    for section in sorted(set(saved) | set(now)):
        a, b = saved.get(section, {}), now.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key, "(absent)") != b.get(key, "(absent)"):
                out.append(f"{section}.{key}: checkpoint {a.get(key, '(absent)')!r}, "
                           f"this run {b.get(key, '(absent)')!r}")
    return out


def resume_point(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint this run starts from, or None to start fresh. Reads files
    only; raises ConfigError when the run cannot start as configured."""
    run = cfg.run
    if not run.checkpoint_dir:
        return None
    store = CheckpointDir(run.checkpoint_dir)
    latest = store.latest()
    if run.resume == "off":
        if latest is not None:  # a fresh run would prune them as older than its own
            raise ConfigError(f"run.checkpoint_dir {run.checkpoint_dir} already holds checkpoints (the latest "
                              f"at step {latest.step}): continue with --resume (or run.resume = auto), or "
                              "choose another directory")
        return None
    if latest is None:
        if run.resume == "required":
            partial = len(store.incomplete())
            raise ConfigError(f"--resume: no complete checkpoint in {run.checkpoint_dir}"
                              + (f" ({partial} incomplete one(s) ignored)" if partial else ""))
        return None  # auto: start fresh
    where = f"cannot resume from {latest.path}"
    try:
        meta = latest.meta()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: its meta.json cannot be read: {e}") from None
    diffs = differences(meta.get("config", {}), fingerprint(cfg))
    if diffs:
        raise ConfigError(f"{where}: it was saved with a different config: {'; '.join(diffs)}")
    if latest.step >= run.steps:
        raise ConfigError(f"{where}: it is at step {latest.step} and run.steps = {run.steps}: nothing left "
                          "to train (raise run.steps)")
    lay = cfg.layout
    try:
        check_readable(latest.path, [stage_key(s, t) for s in range(lay.pp) for t in range(lay.tp)]
                       + [f"rank{r}" for r in range(lay.world_size)])
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None
    return latest


class RunCheckpoints:
    """One rank's side of saving and loading its stage's state during a run."""

    def __init__(self, cfg: TrainConfig, rt: PipelineRuntime, module: torch.nn.Module,
                 opt: torch.optim.Optimizer) -> None:
        self.cfg, self.rt, self.module, self.opt = cfg, rt, module, opt
        self.store = CheckpointDir(cfg.run.checkpoint_dir)
        self.where = dict(rank=rt.rank, stage=rt.stage, tp_rank=rt.tp_rank, device=rt.device,
                          process_group=rt.cpu_group)  # DCP's collectives: gloo, the control plane

    def due(self, done: int, stopping: bool) -> bool:
        """Save after ``done`` steps? Every checkpoint_every steps, at the end, and on a stop."""
        every = self.cfg.run.checkpoint_every
        return stopping or done == self.cfg.run.steps or (every > 0 and done % every == 0)

    async def load(self, ckpt: Checkpoint) -> None:
        try:
            await asyncio.to_thread(load_stage, ckpt.path, self.module, self.opt, **self.where)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        for group in self.opt.param_groups:  # the config's, not the checkpoint's
            group.update(lr=self.cfg.run.lr, weight_decay=self.cfg.run.weight_decay)
        log.info("rank %d resumed from %s (step %d)", self.rt.rank, ckpt.path, ckpt.step)

    async def save(self, done: int) -> Checkpoint:
        """Collective: every rank writes its part into the partial directory (DCP's save
        returns on any rank only once every rank's files and the metadata are written);
        then rank 0 commits it, and every rank learns that it did (so a line saying
        "saved" is true on every rank); then rank 0 deletes checkpoints beyond
        checkpoint_keep."""
        await asyncio.to_thread(save_stage, self.store.partial_path(done), self.module, self.opt, **self.where)
        committed, failure = torch.zeros(1), None
        if self.rt.rank == 0:
            try:
                self.store.commit(done, {"config": fingerprint(self.cfg),
                                         "world_size": self.rt.layout.world_size, "torch": torch.__version__})
                committed += 1
            except OSError as e:
                failure = e
        await self.rt.all_reduce(committed, what=f"step {done}: world all-reduce of the checkpoint commit")
        if not committed.item():
            raise CheckpointError(f"rank 0 could not commit checkpoint {self.store.final_path(done)}"
                                  + (f": {failure}" if failure else ""))
        if self.rt.rank == 0:
            self.store.prune(self.cfg.run.checkpoint_keep)
        return Checkpoint(done, self.store.final_path(done))
