"""The sections of a run's config, one dataclass each, every key with its doc line. Values are
parsed into their types once, when the file loads (``Section.parse``); a section checks its own
keys when built, and TrainConfig checks what spans sections."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rrfp.app.config.fields import Section, did_you_mean, setting
from rrfp.app.errors import ConfigError
from rrfp.app.faults import Fault
from rrfp.core.budget import DEFAULT_BUDGET, Budget
from rrfp.core.cost import CostModel
from rrfp.core.hints import (
    BUILTIN,
    DEFAULT_HINT,
    VIRTUAL_ONLY,
    Hint,
    HintError,
    default_split,
    resolve,
)
from rrfp.core.placement import VirtualLayout
from rrfp.core.policy import DEFAULT_DISPATCH, Dispatch
from rrfp.core.variability import PRESETS, Variability
from rrfp.pipeline.schedule_settings import AUTO_UNSPLIT, DEFAULT_WEIGHT_SPLIT, WEIGHT_SPLITS
from rrfp.pipeline.timeouts import DEFAULT_TIMEOUT_S, Timeouts

RESUME_MODES = ("off", "auto", "required")
AUTOCAST_MODES = ("off", "bfloat16", "float16")
ON_CORRUPT_CHECKPOINT = ("fallback", "stop")
ON_NONFINITE = ("stop", "skip")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")
ACTIVATION_CHECKPOINTING = ("off", "layers")
COUNT = (1, 65536)
ONE = (1, False, ">= 1")
STEPS = (1, 10**9)


@dataclass(frozen=True)
class RunSection(Section):
    NAME = "run"
    DOC = "What runs, for how long, and the one timeout every wait derives from."

    model: str = setting(
        "gpt",
        "the workload: a built-in name (rrfp/models/<name>.py), a module importable from the "
        "directory the command runs in (mypkg.model, mypkg.model:attr), or a .py file "
        "(path/to/model.py[:attr], a relative path from that directory too)",
    )
    steps: int = setting(50, "optimizer steps to run", bounds=STEPS, least=ONE)
    seed: int = setting(
        0, "seed of the model's initial weights and the data", bounds=(0, 2**63 - 1)
    )
    timeout_s: float = setting(
        DEFAULT_TIMEOUT_S,
        "how long any wait may last; each of [timeouts] defaults from it (at least 1 s: what a "
        "rendezvous's sockets need to connect at all)",
        bounds=(1, 604_800),
        least=(0, True, "> 0"),
    )


@dataclass(frozen=True)
class ParallelSection(Section):
    NAME = "parallel"
    DOC = "How the ranks are laid out: pipeline, tensor and data parallel, and virtual stages."

    pp: int = setting(
        0,
        "pipeline ranks; 0: world size / (tp * dp)",
        bounds=(0, 65536),
        least=(0, False, ">= 1 (or 0 for world size / (tp*dp))"),
    )
    tp: int = setting(1, "tensor-parallel ranks per stage", bounds=COUNT, least=ONE)
    dp: int = setting(1, "data-parallel replicas of the pipeline", bounds=COUNT, least=ONE)
    dp_shard: int = setting(
        1,
        "data-parallel replicas of the pipeline whose stages are FSDP2-sharded over them "
        "(fully_shard: parameters, gradients and optimizer state split between the replicas); "
        "instead of dp",
        bounds=COUNT,
        least=ONE,
    )
    ep: int = setting(
        1,
        "expert-parallel replicas: the MoE layers' experts sharded over blocks of ep adjacent "
        "data-parallel replicas (ep divides dp or dp_shard), tokens sent to their experts by "
        "all-to-all",
        bounds=COUNT,
        least=ONE,
    )
    virtual: int = setting(
        1,
        "stages per pipeline rank: the model is split into pp x virtual stages",
        bounds=(1, 64),
        least=ONE,
    )
    placement: str = setting(
        "interleaved",
        "with virtual > 1, which stages a rank holds: interleaved (r, r+pp, ...) or v "
        "(r and 2pp-1-r)",
        choices=("interleaved", "v"),
    )

    @property
    def replicas(self) -> int:
        """The data-parallel degree of the layout: dp, or dp_shard (one of them is 1)."""
        return self.dp * self.dp_shard

    def check(self) -> None:
        if self.dp > 1 and self.dp_shard > 1:
            raise ConfigError(
                f"parallel.dp = {self.dp} and parallel.dp_shard = {self.dp_shard}: choose one "
                "(replicated or FSDP-sharded stages; both at once, HSDP, is not supported)"
            )
        if self.dp_shard > 1 and self.tp > 1:
            raise ConfigError(
                f"parallel.dp_shard = {self.dp_shard} with parallel.tp = {self.tp}: FSDP-sharded "
                "stages with tensor parallelism are not supported"
            )
        if self.ep > 1 and (self.tp > 1 or self.replicas % self.ep):
            raise ConfigError(
                f"parallel.ep = {self.ep} needs parallel.dp or parallel.dp_shard a multiple of it "
                f"(dp = {self.dp}, dp_shard = {self.dp_shard}), without tp: the experts are "
                "sharded over the data-parallel replicas"
            )
        try:
            VirtualLayout(1, self.virtual, self.placement)
        except ValueError as e:
            raise ConfigError(
                f"parallel.virtual = {self.virtual}, parallel.placement = {self.placement!r}: {e}"
            ) from None


def _hint(name: str) -> Hint:
    try:
        return resolve(name)
    except HintError as e:
        raise HintError(
            f"{e}{did_you_mean(name.lower(), [*BUILTIN, *VIRTUAL_ONLY, 'plan'])}"
        ) from None


def _stage_numbers(value: list | str) -> tuple[int, ...] | str:
    """A TOML list of stage numbers, or "auto"; their range is checked against the layout
    (TrainConfig)."""
    if isinstance(value, str):
        if value != AUTO_UNSPLIT:
            raise ValueError(f'{value!r} is neither a list of stage numbers nor "{AUTO_UNSPLIT}"')
        return value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{value!r} is not a list of stage numbers")
    return tuple(value)


@dataclass(frozen=True)
class ScheduleSection(Section):
    NAME = "schedule"
    DOC = (
        "What each rank runs in which order: the microbatches, the dispatch, the hint, the budget."
    )

    n_microbatches: int = setting(
        8, "microbatches per step, per data-parallel replica", bounds=COUNT, least=ONE
    )
    dispatch: Dispatch = setting(
        DEFAULT_DISPATCH,
        "ready (the best-priority ready task) or fixed (the hint's order, waiting for each task)",
        toml=(str,),
        parse=Dispatch.parse,
    )
    hint: Hint = setting(
        factory=lambda: resolve(DEFAULT_HINT),
        doc="the priority order: bfw, bf, 1f1b, zbh1, gpipe, plan, zbv, a .csv hint file or "
        "module:function",
        toml=(str,),
        parse=lambda name: _hint(name),
        shown=f'"{DEFAULT_HINT}"',
    )
    budget: Budget = setting(
        factory=lambda: Budget.parse(DEFAULT_BUDGET),
        doc='activations in flight per stage: N microbatches, "Nx" (N x 1F1B\'s), or bytes '
        'like "512MiB"',
        toml=(str, int),
        parse=Budget.parse,
        shown=f'"{DEFAULT_BUDGET}"',
    )
    split: bool | None = setting(
        None,
        "run B and W apart; unset: the hint's default (split for zbh1 and bfw)",
        toml=(bool,),
        shown="(the hint's)",
    )

    weight_split: str = setting(
        DEFAULT_WEIGHT_SPLIT,
        "how a split backward leaves the weight gradients to W: autograd (restarts autograd in W, "
        "any module), functions (linear, layer norm, RMS norm, embedding and products with a "
        "parameter queue their own W; the rest as autograd), or auto (functions, or autograd with "
        "parallel.tp, dp_shard or ep above 1)",
        choices=WEIGHT_SPLITS,
    )
    unsplit_stages: tuple[int, ...] | str = setting(
        (),
        "with a split backward, the stages (negative: from the last) whose B runs the whole "
        "backward and W nothing: the split costs a stage more compute than its unsplit backward, "
        "which pays only where it fills a bubble (not on the stage that limits the pipeline, "
        'often the last); "auto": the stages whose unsplit backward shortens the iteration '
        "predicted from emulation.cost (rrfp calibrate measures both ways); real compute only",
        toml=(list, str),
        parse=_stage_numbers,
    )
    overlap: bool = setting(
        False,
        "with ready dispatch, a split backward and parallel.ep > 1 on CPU: while a MoE task waits "
        "at its all-to-all, the rank computes a ready W beside it",
    )

    @property
    def split_backward(self) -> bool:
        """Whether B and W run apart: ``split``, or the hint's default where it is unset."""
        return default_split(self.hint.name, self.split)


@dataclass(frozen=True)
class OptimSection(Section):
    NAME = "optim"
    DOC = (
        "The optimizer (one per stage), its weight decay groups, the learning-rate schedule, "
        "clipping, and what a NaN/Inf step does."
    )

    name: str = setting(
        "adamw", "adamw, or sgd (with momentum; no second-moment state)", choices=OPTIMIZERS
    )
    lr: float = setting(1e-3, "the peak learning rate", bounds=(0, 100), least=(0, True, "> 0"))
    warmup_steps: int = setting(
        0, "steps over which lr rises linearly from 0 (0: none)", bounds=(0, 10**9)
    )
    schedule: str = setting(
        "constant",
        "after the warmup: constant, or cosine or linear decay to min_lr at decay_steps",
        choices=LR_SCHEDULES,
    )
    min_lr: float = setting(0.0, "where the cosine or linear decay ends", bounds=(0, 100))
    decay_steps: int = setting(
        0,
        "the step at which the decay reaches min_lr, warmup included; 0: run.steps",
        bounds=(0, 10**9),
    )
    weight_decay: float = setting(
        0.0, "decoupled (adamw) or L2 (sgd) weight decay, on the decayed group", bounds=(0, 100)
    )
    decay_all: bool = setting(
        False,
        "decay every parameter; false: only those of 2+ dims outside embeddings (no norms, "
        "biases or embeddings)",
    )
    beta1: float = setting(0.9, "adamw's first-moment decay", bounds=(0, 1))
    beta2: float = setting(0.999, "adamw's second-moment decay", bounds=(0, 1))
    momentum: float = setting(0.9, "sgd's momentum (0: plain SGD)", bounds=(0, 0.999999))
    clip_grad_norm: float = setting(
        0.0,
        "clip the whole model's gradient norm to this before each step; 0: off",
        least=(0, False, ">= 0 (0: no clipping)"),
    )
    on_nonfinite: str = setting(
        "stop",
        "NaN/Inf in the loss or gradients: stop the run, or skip the step on every rank",
        choices=ON_NONFINITE,
    )

    def check(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(
                f"optim.min_lr = {self.min_lr:g} is above optim.lr = {self.lr:g}: the decay "
                "would raise the learning rate"
            )
        if self.beta1 >= 1 or self.beta2 >= 1:
            raise ConfigError(
                f"optim.beta1 = {self.beta1:g}, optim.beta2 = {self.beta2:g}: each must be < 1"
            )


@dataclass(frozen=True)
class ComputeSection(Section):
    NAME = "compute"
    DOC = "Where a rank computes: the backend, the device, threads and autocast."

    backend: str = setting(
        "auto",
        "auto, gloo (CPU) or nccl (CUDA); auto: nccl where CUDA has a GPU for every rank of the "
        "node (and compute.device is not cpu), else gloo; the start-up summary says which",
        choices=("auto", "gloo", "nccl"),
    )
    device: str = setting(
        "auto", "auto, cpu or cuda; auto: cuda when backend = nccl", choices=("auto", "cpu", "cuda")
    )
    threads: int = setting(
        1,
        "torch intra-op threads per rank (the rrfp command loads torch with OMP_NUM_THREADS=1 "
        "unless the shell sets it)",
        bounds=(1, 1024),
        least=ONE,
    )
    autocast: str = setting(
        "off",
        "torch.autocast around every task; parameters and the optimizer stay float32 "
        "(float16 has no loss scaling here)",
        choices=AUTOCAST_MODES,
    )
    activation_checkpointing: str = setting(
        "off",
        "layers: recompute each transformer block's forward in the backward "
        "(torch.utils.checkpoint), keeping only its input",
        choices=ACTIVATION_CHECKPOINTING,
    )

    def check(self) -> None:
        if self.device == "cpu" and self.backend == "nccl":
            raise ConfigError(
                "compute.backend = nccl carries CUDA tensors only: set compute.device = cuda "
                "(or auto), or compute.backend = gloo"
            )
        if self.device == "cuda" and self.backend == "gloo":
            raise ConfigError(
                "compute.device = cuda needs compute.backend = nccl: rrfp's gloo channels carry "
                "CPU tensors only"
            )

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``, once ``auto`` is decided (a backend still ``auto``: for one rank
        here, as ``chosen`` decides it)."""
        return "cuda" if self.chosen(1)[0] == "nccl" else "cpu"

    def chosen(self, local_ranks: int) -> tuple[str, str]:
        """(backend, why): ``backend`` as given, or what ``auto`` picks for ``local_ranks`` ranks
        on this node: nccl where CUDA has a GPU for each, else gloo."""
        if self.backend != "auto":
            return self.backend, f"compute.backend = {self.backend}"
        if self.device != "auto":
            backend = "nccl" if self.device == "cuda" else "gloo"
            return backend, f"auto: compute.device = {self.device}"
        import torch

        if not torch.cuda.is_available():
            return "gloo", "auto: no CUDA"
        gpus = torch.cuda.device_count()
        if gpus < local_ranks:
            return "gloo", f"auto: {gpus} GPU(s) for {local_ranks} ranks on this node"
        return "nccl", f"auto: CUDA, {gpus} GPU(s) for {local_ranks} rank(s) on this node"


@dataclass(frozen=True)
class CheckpointSection(Section):
    NAME = "checkpoint"
    DOC = "Where checkpoints go, how often, how many stay, and how a run resumes."

    dir: str = setting("", 'where checkpoints go; "": none (also none on SIGTERM)')
    every: int = setting(
        0,
        "save every N steps (and at the end, and on a stop); 0: only those two",
        bounds=(0, 10**9),
    )
    keep: int = setting(
        2,
        "complete checkpoints kept; older ones go once a newer one is committed",
        bounds=(1, 10**6),
    )
    resume: str = setting(
        "off",
        "off, auto (the latest checkpoint, if any) or required (rrfp train --resume)",
        choices=RESUME_MODES,
    )
    on_corrupt: str = setting(
        "fallback",
        "a latest checkpoint that fails verification: resume from the newest that verifies "
        "(fallback), or stop (exit 2)",
        choices=ON_CORRUPT_CHECKPOINT,
    )

    def check(self) -> None:
        if not self.dir and (self.every or self.resume != "off"):
            what = (
                "--resume"
                if self.resume == "required"
                else f"checkpoint.resume = {self.resume}"
                if self.resume != "off"
                else f"checkpoint.every = {self.every}"
            )
            raise ConfigError(f"{what} needs checkpoint.dir")


@dataclass(frozen=True)
class OutputSection(Section):
    NAME = "output"
    DOC = (
        "What a run writes besides checkpoints: progress lines, metrics, the trace, sizes, "
        "failure logs."
    )

    log_every: int = setting(1, "rank 0 prints a step line every N steps", bounds=STEPS, least=ONE)
    trace: str = setting("", 'merged Chrome trace written by rank 0 at the end; "": none')
    sizes: str = setting(
        "", "rank 0 writes every step's microbatch features and step time here, for rrfp sim"
    )
    routing: str = setting(
        "",
        "rank 0 writes every MoE layer's tokens per expert here, a JSON line per step, stage, "
        'microbatch and layer, for rrfp sim --routing; "": none',
    )
    log_dir: str = setting("runs/logs", "a failing rank writes its traceback to LOG_DIR/rank-N.log")
    dir: str = setting(
        "runs/{model}-{time}",
        "the run's folder, new for each run (a -N suffix when taken): rank 0 writes metrics.jsonl "
        'there, a line per step, and TensorBoard events with tensorboard installed; "": none',
    )
    peak_tflops: float = setting(
        0.0,
        "a rank's peak for MFU, in TFLOPS; 0: by device (a known GPU's dense peak at the run's "
        "precision; on CPU an assumed 0.1 per thread, indicative only)",
        bounds=(0, 1e6),
    )

    def check(self) -> None:
        try:
            self.dir.format(model="m", time="t")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"output.dir = {self.dir!r}: only {{model}} and {{time}} are filled in ({e!r})"
            ) from None


@dataclass(frozen=True)
class EvalSection(Section):
    NAME = "eval"
    DOC = "Evaluation on held-out data: a forward-only pipeline iteration every N steps."

    every: int = setting(
        0, "evaluate after every N steps and after the last; 0: never", bounds=(0, 10**9)
    )
    batches: int = setting(
        2,
        "held-out iterations per evaluation, each of schedule.n_microbatches microbatches per "
        "replica; the same ones every time",
        bounds=(1, 65536),
        least=ONE,
    )


def _load_cost(path: str) -> CostModel | None:
    if not path:
        return None
    try:
        return CostModel.from_json(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"emulation.cost: cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"emulation.cost: {path} is not a cost model from rrfp calibrate: {e}"
        ) from None


@dataclass(frozen=True)
class EmulationSection(Section):
    NAME = "emulation"
    DOC = "Emulated device time: tasks sleep on a lane instead of (or besides) computing."

    preset: str = setting("none", "variability model of emulated task times", choices=PRESETS)
    unit_ms: float = setting(
        0.0,
        "emulated time of one average forward, in ms; 0: real time",
        bounds=(0, 600_000),
        least=(0, False, ">= 0 (0: no emulated time)"),
    )
    cost: CostModel | None = setting(
        None,
        "a cost model file (rrfp calibrate): emulated times from each microbatch's data",
        toml=(str,),
        parse=_load_cost,
        shown='""',
    )

    @property
    def variability(self) -> Variability:
        return Variability.preset(self.preset)

    def as_toml(self) -> dict:
        out = super().as_toml()
        out.pop("cost", None)  # a file's contents, not its name: a dump cannot write it back
        return out


def _fault(spec: str) -> Fault | None:
    return Fault.parse(spec) if spec.strip() else None


@dataclass(frozen=True)
class DebugSection(Section):
    NAME = "debug"
    DOC = "Testing aids."

    fault: Fault | None = setting(
        doc='make a rank fail, e.g. "kill:step=3:stage=1:task=B2" (rrfp/app/faults.py); '
        "default: $RRFP_FAULT",
        toml=(str,),
        parse=_fault,
        factory=lambda: _env_fault(),
        shown='$RRFP_FAULT or ""',
    )


def _env_fault() -> Fault | None:
    try:
        return _fault(os.environ.get("RRFP_FAULT", ""))
    except ValueError as e:
        raise ConfigError(f"debug.fault (RRFP_FAULT): {e}") from None


DERIVED = "0: derived from run.timeout_s"


@dataclass(frozen=True)
class TimeoutsSection(Section):
    NAME = "timeouts"
    DOC = "Each wait apart; 0 (the default) derives it from run.timeout_s."

    store_connect_s: float = setting(
        0.0, f"connecting to the rendezvous store; {DERIVED}", bounds=(0, 604_800)
    )
    process_group_s: float = setting(
        0.0,
        f"gloo's process groups: start-up, and collectives without a heartbeat; {DERIVED}",
        bounds=(0, 604_800),
    )
    nccl_watchdog_s: float = setting(
        0.0,
        "NCCL's watchdog, a backstop behind rrfp's own deadline; 0: 2 x run.timeout_s + 30",
        bounds=(0, 2 * 604_800),
    )
    heartbeat_s: float = setting(
        0.0,
        f"how long a peer may stay silent (no heartbeat) before it is named (gloo); {DERIVED}",
        bounds=(0, 604_800),
    )
    peer_wait_s: float = setting(
        0.0,
        f"how long a stage waits on a peer's message before it names it; {DERIVED}",
        bounds=(0, 604_800),
    )
    cuda_deadline_s: float = setting(
        0.0, f"how long a rank waits for its own GPU's work (CUDA); {DERIVED}", bounds=(0, 604_800)
    )
    progress_s: float = setting(
        0.0,
        "with a heartbeat, how long a stage waits on a peer that beats but makes no progress, "
        "or a rank at a collective on one that never reaches it (no rank runs a task or writes "
        "a checkpoint: a deadlock, a rank stuck outside the pipeline); 0: 10 x run.timeout_s",
        bounds=(0, 604_800),
    )
    task_s: float = setting(
        0.0,
        "the floor of a task's own bound: a task (its compute, a collective inside it, a kernel) "
        "that runs longer than this and than 10 x the longest task of its kind so far on its "
        "stage (3 x this before one has finished) is named as stuck; 0: 2 x timeouts.progress_s",
        bounds=(0, 604_800),
    )

    def resolve(self, timeout_s: float) -> Timeouts:
        return Timeouts.derive(timeout_s, **{k: getattr(self, k) for k in self.keys()})


SECTIONS: tuple[type[Section], ...] = (
    RunSection,
    ParallelSection,
    ScheduleSection,
    OptimSection,
    ComputeSection,
    CheckpointSection,
    OutputSection,
    EvalSection,
    EmulationSection,
    TimeoutsSection,
    DebugSection,
)
