"""A training run's checkpoints: which one it resumes from (decided before any
process group exists, so a mismatch is one error line on every rank), and
saving one when the run asks (every N steps, at the end, on SIGTERM).

Every checkpoint is verified against its commit record (each file's SHA-256)
before anything of it is read: a latest checkpoint that fails is named, and
the run falls back to the newest one that verifies, or stops, as
``checkpoint.on_corrupt`` says. Those it passed over are set aside at the
run's start (rank 0, renamed ``rejected-step-N``, their files kept), so they
neither block its commits nor count as kept.

A checkpoint records the config that shaped its state (``fingerprint``): the
workload, the layout, the microbatch count, the model and data configs. A
different value in any of them is refused: the saved tensors would not fit, or
the batches (a pure function of the data config and the step) would not
continue where they stopped; so is another optimizer (optim.name), whose state would not fit; so
are data files whose bytes changed since the save (their size and SHA-256, file_fingerprint.py,
recorded in meta.json as ``data_files``), which the batches would be drawn from. The
other [optim] keys may change; the config wins. The learning-rate schedule and the evaluation
hold no state of their own: both are functions of the step the checkpoint records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from dataclasses import MISSING, dataclass

import torch
import torch.distributed as dist

from rrfp.app.config.file_fingerprint import fingerprints
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.job.job_agreement import job_id
from rrfp.app.job.run_outputs import PROBE_PREFIX, folder_problem
from rrfp.app.train.checkpoint_dir import Checkpoint, CheckpointDir
from rrfp.app.train.checkpoint_owner import FolderClaim, read_owner, refusal
from rrfp.app.train.checkpoint_state import (
    CheckpointError,
    check_readable,
    load_stage,
    save_stage,
    stage_key,
    written_files,
)
from rrfp.app.train.disk_errors import DISK_ERRNOS, explained
from rrfp.app.train.optimizers import reconfigured
from rrfp.comm.channels import lone_peer, lost_peer_reason, named_collective
from rrfp.comm.collective_wait import working_marker
from rrfp.core.errors import PeerFailure
from rrfp.loop.blocking import in_daemon_thread
from rrfp.pipeline.runtime import PipelineRuntime

log = logging.getLogger("rrfp.app.train.checkpoints")


def fingerprint(cfg: TrainConfig) -> dict:
    """What must be equal for a checkpoint to continue this run, as plain JSON values."""
    lay = cfg.layout
    return json.loads(
        json.dumps(
            {
                "run": {
                    "model": cfg.run.model,
                    "pp": lay.pp,
                    "tp": lay.tp,
                    "dp": lay.dp,
                    "ep": lay.ep,
                    "n_microbatches": cfg.schedule.n_microbatches,
                    "virtual": cfg.parallel.virtual,
                    "placement": cfg.parallel.placement,
                },
                "model": dataclasses.asdict(cfg.model),
                "data": dataclasses.asdict(cfg.data),
                "optim": {"name": cfg.optim.name},  # its state is that optimizer's
            },
            default=str,  # a workload's Path or enum field, as its text
        )
    )


def differences(saved: dict, now: dict) -> list[str]:
    """``section.key: checkpoint A, this run B`` for every key that differs."""
    out = []
    for section in sorted(set(saved) | set(now)):
        a, b = saved.get(section, {}), now.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key, "(absent)") != b.get(key, "(absent)"):
                out.append(
                    f"{_key_name(section, key)}: checkpoint {a.get(key, '(absent)')!r}, "
                    f"this run {b.get(key, '(absent)')!r}"
                )
    return out


# the fingerprint's ``run`` keys that the config holds in another section
_SECTION_OF = {
    **{k: "parallel" for k in ("pp", "tp", "dp", "virtual", "placement")},
    "n_microbatches": "schedule",
}


def _key_name(section: str, key: str) -> str:
    """A fingerprint's key as the config names it."""
    if section == "run":
        section = _SECTION_OF.get(key, section)
    return f"{section}.{key}"


@dataclass(frozen=True)
class Resume:
    """Where a run starts (``start``; None: step 0), and the newer checkpoints it passed
    over because they failed verification, newest first, each with what is wrong (set aside
    as ``rejected-step-N`` at the run's start, never deleted)."""

    start: Checkpoint | None
    rejected: tuple[tuple[Checkpoint, str], ...] = ()

    def fallback_line(self) -> str | None:
        """The one line that names what was passed over, and where the run resumes instead."""
        if not self.rejected:
            return None
        bad = "; ".join(
            f"checkpoint {c.path} failed verification: {why}" for c, why in self.rejected
        )
        aside = ", ".join(
            f"{c.path.name} as {CheckpointDir(c.path.parent).rejected_path(c.step).name}"
            for c, _ in self.rejected
        )
        return (
            f"{bad}; resuming from {self.start.path} instead, the newest that verifies "
            f"(checkpoint.on_corrupt = fallback; set aside at this run's start, kept: {aside})"
        )


def choose_resume(cfg: TrainConfig) -> Resume:
    """Where this run starts. Reads files only (every checkpoint it considers, in full, to
    verify it); raises ConfigError when the run cannot start as configured."""
    run, ck = cfg.run, cfg.checkpoint
    if not ck.dir:
        return Resume(None)
    store = CheckpointDir(ck.dir)
    problem = folder_problem(ck.dir)
    if problem is not None:
        raise ConfigError(f"checkpoint.dir {ck.dir} cannot hold checkpoints: {problem}")
    done = store.complete()
    if ck.resume == "off":
        if done:  # a fresh run would prune them as older than its own
            raise ConfigError(
                f"checkpoint.dir {ck.dir} already holds checkpoints (the latest at step "
                f"{done[-1].step}): continue with --resume (or checkpoint.resume = auto), or "
                "choose another directory"
            )
        return Resume(None)
    if not done:
        if ck.resume == "required":
            partial = len(store.incomplete())
            raise ConfigError(
                f"--resume: no complete checkpoint in {ck.dir}"
                + (f" ({partial} incomplete one(s) ignored)" if partial else "")
            )
        return Resume(None)  # auto: start fresh
    rejected = []
    for latest in reversed(done):
        problem = latest.problem()
        if problem is None:
            break
        rejected.append((latest, problem))
        if ck.on_corrupt == "stop":
            raise ConfigError(
                f"checkpoint {latest.path} failed verification: {problem}; nothing was loaded "
                '(checkpoint.on_corrupt = stop; "fallback" resumes from the newest '
                "checkpoint that verifies)"
            )
    else:
        raise ConfigError(
            f"no checkpoint in {ck.dir} verifies, nothing was loaded: "
            + "; ".join(f"{c.path.name}: {why}" for c, why in rejected)
            + " (move them away to start at step 0)"
        )
    where = f"cannot resume from {latest.path}"
    try:
        meta = latest.meta()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: its meta.json cannot be read: {e}") from None
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("config", {}), dict)
        and all(isinstance(v, dict) for v in meta.get("config", {}).values())
    ):
        raise ConfigError(
            f"{where}: its meta.json is not an rrfp checkpoint's (expected an object whose "
            '"config" is an object of sections)'
        )
    saved = meta.get("config", {})
    diffs = differences(*_comparable(saved, _new_keys_at_default(saved, fingerprint(cfg), cfg)))
    if diffs:
        raise ConfigError(f"{where}: it was saved with a different config: {'; '.join(diffs)}")
    changed = data_changes(meta.get("data_files"), fingerprints({"data": cfg.data}))
    if changed:
        raise ConfigError(
            f"{where}: the data it was trained on changed since it was saved: {'; '.join(changed)} "
            "(resume with the files it was saved with, or start in another checkpoint.dir)"
        )
    if latest.step >= run.steps:
        raise ConfigError(
            f"{where}: it is at step {latest.step} and run.steps = {run.steps}: nothing left "
            "to train (raise run.steps)"
        )
    lay = cfg.layout
    try:
        check_readable(
            latest.path,
            [
                stage_key(s, t, e if lay.ep > 1 else None)
                for s in range(cfg.num_stages)
                for t in range(lay.tp)
                for e in range(lay.ep)
            ]
            + [f"rank{r}" for r in range(lay.world_size)],
        )
    except CheckpointError as e:
        raise ConfigError(f"{where}: {e}") from None
    return Resume(latest, tuple(rejected))


def data_changes(saved: object, now: dict[str, str]) -> list[str]:
    """``data.KEY FILE: checkpoint A, now B`` for every data file whose fingerprint differs from
    the one ``saved`` in a checkpoint (a checkpoint that recorded none: nothing to compare)."""
    if not isinstance(saved, dict):
        return []
    return [
        f"{name}: checkpoint {saved.get(name, '(absent)')}, now {now.get(name, '(absent)')}"
        for name in sorted(set(saved) | set(now))
        if saved.get(name) != now.get(name)
    ]


def _new_keys_at_default(saved: dict, now: dict, cfg: TrainConfig) -> dict:
    """``now`` without the [model] and [data] keys the checkpoint lacks (a workload added them
    since it was saved) that this run leaves at their defaults: the behaviour it was saved with."""
    out = dict(now)
    for name, section in (("model", cfg.model), ("data", cfg.data)):
        if name not in saved or name not in now:
            continue
        defaults = {
            f.name: f.default for f in dataclasses.fields(section) if f.default is not MISSING
        }
        out[name] = {
            k: v
            for k, v in now[name].items()
            if k in saved[name] or k not in defaults or v != defaults[k]
        }
    return out


def _comparable(saved: dict, now: dict) -> tuple[dict, dict]:
    """The saved and the current fingerprint, as far as they mean something: a checkpoint saved
    before run.virtual existed had one stage per rank, and run.placement says nothing about a side
    with one stage per rank, so it is compared only where both have several."""
    saved = {"optim": {"name": "adamw"}, **saved}  # saved before optim.name existed: AdamW's
    if "run" not in saved:
        return saved, now
    # saved before run.ep existed: no expert parallelism
    saved_run, now_run = {"virtual": 1, "ep": 1, **saved["run"]}, now["run"]
    if saved_run["virtual"] == 1 or now_run["virtual"] == 1:
        saved_run, now_run = (
            {k: v for k, v in r.items() if k != "placement"} for r in (saved_run, now_run)
        )
    return {**saved, "run": saved_run}, {**now, "run": now_run}


def resume_point(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint this run starts from, or None to start fresh (``choose_resume``'s start)."""
    return choose_resume(cfg).start


class RunCheckpoints:
    """One rank's side of saving and loading its stages' state during a run: ``modules`` and
    ``opts`` hold one entry per stage of the rank (``rt.stages``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        rt: PipelineRuntime,
        modules: list[torch.nn.Module],
        opts: list[torch.optim.Optimizer],
    ) -> None:
        self.cfg, self.rt = cfg, rt
        one = len(modules) == 1  # the single-stage form: save_stage's own keys and calls
        self.module, self.opt = (modules[0], opts[0]) if one else (list(modules), list(opts))
        self.store = CheckpointDir(cfg.checkpoint.dir)
        self.where = dict(
            rank=rt.rank,
            stage=rt.stage if one else list(rt.stages),
            tp_rank=rt.tp_rank,
            ep_rank=rt.ep_rank,
            device=rt.device,
            process_group=rt.cpu_group,
        )  # DCP's collectives: gloo, the control plane
        # what the data files held when this run started (file_fingerprint.py), in every
        # checkpoint's meta.json: a resume on other bytes is refused
        self.data_files = fingerprints({"data": cfg.data}) if rt.rank == 0 else {}
        self.job = ""  # this job's id (begin), in the folder's OWNER record and commit records
        self.claim: FolderClaim | None = None  # rank 0's hold on the folder, from begin
        # called with the step and the phase (save, commit) as this rank enters it (fault injection)
        self.on_write: list = []

    async def begin(self, resume: Resume) -> None:
        """Collective, at the run's start: every rank decided to resume from the same step,
        and sees a file rank 0 writes into the checkpoint directory (one file system for
        every rank). Then rank 0 sets the checkpoints passed over aside (kept, as
        ``rejected-step-N``) and deletes any debris, so
        nothing of an earlier crash is mixed into, or blocks, this run's commits."""
        rt, world = self.rt, self.rt.layout.world_size
        step = float(resume.start.step if resume.start is not None else -1)
        token = secrets.randbelow(2**50) + 1 if rt.rank == 0 else 0
        job = job_id(self.cfg.waits.store_connect_s) if rt.rank == 0 else 0
        probe = self.store.root / f"{PROBE_PREFIX}{token}"
        if rt.rank == 0:
            probe.write_text(str(token))
        agreed = torch.tensor([float(token), step, -step, float(job)], dtype=torch.float64)
        await rt.all_reduce(
            agreed, dist.ReduceOp.MAX, what="checkpoint: world agreement on the resume step"
        )
        token, high, low = int(agreed[0].item()), agreed[1].item(), -agreed[2].item()
        self.job = f"{int(agreed[3].item()):012x}"
        probe = self.store.root / f"{PROBE_PREFIX}{token}"
        try:
            seen = probe.read_text() == str(token)
        except OSError:
            seen = False
        blind = torch.zeros(world + 1, dtype=torch.float64)  # the last: the folder is taken
        blind[rt.rank] = float(not seen)
        if rt.rank == 0 and seen:
            self.claim = FolderClaim(self.store.root, self.job)
            blind[world] = float(self.claim.claim() is not None)
        await rt.all_reduce(
            blind, what="checkpoint: world check of one shared checkpoint directory"
        )
        if rt.rank == 0:
            probe.unlink(missing_ok=True)
        if blind[world].item():  # every rank reads the same record: the same line
            found = read_owner(self.store.root)
            raise ConfigError(refusal(self.store.root, found[0] if found else None))
        missing = [r for r in range(world) if blind[r].item()]
        if missing:
            raise ConfigError(
                f"checkpoint.dir {self.store.root} is not one file system for every rank: "
                f"rank(s) {', '.join(map(str, missing))} do not see a file rank 0 wrote there "
                "(use a directory every rank shares, such as a shared mount)"
            )
        if high != low:
            raise ConfigError(
                f"the ranks found different checkpoints to resume from in {self.store.root} (steps "
                f"{int(low)} to {int(high)}; -1: none): is it one file system for every rank?"
            )
        if rt.rank == 0:
            self.store.reject([c for c, _ in resume.rejected])
            self.store.clear_debris()

    def release(self) -> None:
        """At the run's end, whatever ended it (rank 0): the folder is no longer this job's."""
        if self.claim is not None:
            self.claim.release()

    def due(self, done: int, stopping: bool) -> bool:
        """Save after ``done`` steps? Every checkpoint_every steps, at the end, and on a stop."""
        every = self.cfg.checkpoint.every
        return stopping or done == self.cfg.run.steps or (every > 0 and done % every == 0)

    async def load(self, ckpt: Checkpoint) -> None:
        opts = self.opt if isinstance(self.opt, list) else [self.opt]
        try:
            with (
                named_collective(
                    f"loading checkpoint {ckpt.path} (DCP's collectives)", self.rt.cpu_group
                ),
                reconfigured(opts, self.cfg.optim),  # the config's hyperparameters, not the saved
            ):
                await in_daemon_thread(
                    load_stage,
                    ckpt.path,
                    self.module,
                    self.opt,
                    **self.where,
                    working=working_marker(),  # its reads are progress to its peers
                )
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        log.info("rank %d resumed from %s (step %d)", self.rt.rank, ckpt.path, ckpt.step)

    async def save(self, done: int, rng: dict | None = None) -> Checkpoint:
        """Collective: every rank writes its part into the partial directory (DCP's save
        returns on any rank only once every rank's files and the metadata are written);
        then rank 0 commits it, and every rank learns that it did (so a line saying
        "saved" is true on every rank); then rank 0 deletes checkpoints beyond
        checkpoint_keep. A peer lost on the way is a PeerFailure whose line says which
        checkpoint stays (the partial one is debris, cleared at the next run's start); a write
        that fails (a full disk) is a CheckpointError that says so, once rank 0 deleted the
        partial folder.
        ``rng``: the generators to record, when not the current ones."""
        for hook in self.on_write:
            hook(done, "save")
        found = read_owner(self.store.root)
        if found is not None and found[0].job != self.job:  # every rank reads it: one line
            raise ConfigError(
                f"step {done}: checkpoint {self.store.final_path(done).name} was not saved: "
                f"{refusal(self.store.root, found[0])}; this job {self.job} lost it "
                f"({self._kept()})"
            )
        try:
            return await self._save(done, rng)
        except PeerFailure as e:
            raise PeerFailure(
                f"rank {self.rt.rank}: step {done}: {self._outcome(done)}: "
                f"{str(e).removeprefix(f'rank {self.rt.rank}: ').removeprefix(f'step {done}: ')}",
                e.peer,
            ) from e
        except CheckpointError as e:
            if not lost_peer_reason(str(e)):
                if self.rt.rank == 0:  # every rank is past its writes: DCP gathered their errors
                    self.store.clear_debris()  # the partial folder, whose space a full disk needs
                raise CheckpointError(f"step {done}: {self._outcome(done)}: {e}") from None
            raise PeerFailure(
                f"rank {self.rt.rank}: step {done}: checkpoint {self.store.final_path(done).name} "
                f"was not saved, {self._kept()}: a peer was lost while writing it"
                f"{lost_peer_reason(str(e))}: {e}",
                lone_peer(self.rt.cpu_group),
            ) from e

    def _outcome(self, done: int) -> str:
        """What became of the checkpoint of ``done`` steps when a peer was lost saving it: rank 0
        may have committed it before the ranks confirmed the commit to each other."""
        name, latest = self.store.final_path(done).name, self.store.latest()
        if latest is not None and latest.step == done:
            return f"checkpoint {name} is committed ({latest.path}), a peer was lost after"
        return f"checkpoint {name} was not saved, {self._kept()}"

    def _kept(self) -> str:
        """Which checkpoint a resume would use now, in words (none, when none was committed)."""
        latest = self.store.latest()
        if latest is None:
            return "and no checkpoint was committed before it (a resume starts at step 0)"
        return f"the newest committed checkpoint stays ({latest.path})"

    async def _save(self, done: int, rng: dict | None) -> Checkpoint:
        with named_collective(
            f"step {done}: writing checkpoint {self.store.partial_path(done)} (DCP's collectives)",
            self.rt.cpu_group,
        ):
            await in_daemon_thread(
                save_stage,
                self.store.partial_path(done),
                self.module,
                self.opt,
                **self.where,
                rng=rng,
                working=working_marker(),  # its writes are progress to its peers
            )
        group = self.rt.cpu_group  # DCP's: its writers are named by their rank in it
        mine = written_files(
            self.store.partial_path(done),
            dist.get_rank(group) if group is not None else self.rt.rank,
        )
        # rank 0: what each rank of this job wrote, which its commit binds to the job
        written = await self.rt.gather_object(mine)
        committed, failure = torch.zeros(1), None
        if self.rt.rank == 0:
            try:
                # the peers wait for it at the commit's all-reduce: its write is progress to them
                with working_marker()(f"writing checkpoint {self.store.final_path(done).name}"):
                    for hook in self.on_write:  # a fault here is one in the write
                        hook(done, "commit")
                    if self.claim is not None:
                        self.claim.check()  # NotOurs: another job took the folder over
                    self.store.commit(
                        done,
                        {
                            "config": fingerprint(self.cfg),
                            "data_files": self.data_files,
                            "world_size": self.rt.layout.world_size,
                            "torch": torch.__version__,
                        },
                        job=self.job,
                        written=written,
                    )
                committed += 1
            except OSError as e:
                failure = e
        else:
            for hook in self.on_write:
                hook(done, "commit")
        await self.rt.all_reduce(
            committed, what=f"step {done}: world all-reduce of the checkpoint commit"
        )
        if not committed.item():
            final = self.store.final_path(done)
            if self.rt.rank == 0:  # the rank that knows the cause says it; the others point at it
                why = (
                    explained(failure, self.store.partial_path(done))
                    if failure is not None and failure.errno in DISK_ERRNOS
                    else failure
                )
                raise CheckpointError(f"rank 0 could not commit checkpoint {final}: {why}")
            raise PeerFailure(
                f"rank {self.rt.rank}: step {done}: rank 0 could not commit it (its line says why)",
                0,
            )
        if self.rt.rank == 0:
            self.store.prune(self.cfg.checkpoint.keep)
        return Checkpoint(done, self.store.final_path(done))
