"""rrfp.titan against torchtitan's own pipelining, on torchtitan's llama3 debug model, 2 gloo ranks:
the same config through ``--module llama3`` (torch's schedule) and ``--module rrfp.titan``
(ScheduleReady) trains 3 steps to the same losses, gradient norms and parameters, for a schedule
with one stage per rank (1F1B), two interleaved (Interleaved1F1B) and two in a V (ZBVZeroBubble);
and rrfp.titan's first-step gradients equal the whole model's in one process. The same at 1F1B
for torchtitan's mixture of experts (``qwen3_moe_debug``, shrunk to fit the machine's memory).

What is torchtitan's here: the config (ConfigManager), the model and its initialisation, the split
and placement and parallelize function (the spec's pipelining function), the loss, the optimizer,
the learning-rate schedule, the gradient clipping, and, on the rrfp side, the training step itself
(``Trainer.pp_forward_backward_step``, on a Trainer whose other parts are left unbuilt). What the
test changes, because torchtitan needs CUDA for it (docs/torchtitan.md): the device mesh is built on
CPU (torchtitan picks "cuda" when torch has no accelerator, torchtitan/tools/utils.py), and the
attention is torchtitan's ScaledDotProductAttention (causal, one document per sequence) instead of
FlexAttention, whose backward torch does not run on CPU. torch 2.13's schedules cannot take
torchtitan's step call (pre-split microbatches are torch 2.14's), so torch's side steps them with
``_step_microbatches``, which is what that call does in torch 2.14; the test also shows the call
failing on torch's schedule."""

from __future__ import annotations

import pytest
import torch
from harness.distributed import run_ranks

pytestmark = pytest.mark.multirank

STEPS, M, SEQ = 3, 4, 32
DEBUG, MOE = "llama3_debugmodel", "qwen3_moe_debug"
MODULES = {DEBUG: "llama3", MOE: "qwen3"}  # torchtitan's module of each config
# torchtitan's MoE debug model is 8 layers of 64 experts (about 300M parameters, a rank of the
# test over 12 GB with its optimizer): the test builds it with 4 layers of 8 experts, top-2, so
# each process stays far under 2 GB; the layers are torchtitan's own, from its registry's builder
MOE_LAYERS, MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN = 4, 8, 2, 256
LOSS_TOL, NORM_TOL, PARAM_TOL, GRAD_TOL = 1e-5, 1e-5, 1e-5, 1e-7


def _config(module: str, schedule: str, ac: bool, chunked: bool = True, name: str = DEBUG):
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.attention import ScaledDotProductAttention

    args = [
        *("--module", module, "--config", name),
        *("--parallelism.pipeline_parallel_degree", "2"),
        *("--parallelism.pipeline_parallel_schedule", schedule),
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(M)),
        *("--training.mixed_precision_param", "float32", "--training.steps", str(STEPS)),
        "--training.disable_cuda_graphs",
    ]
    if name == MOE and module == "rrfp.titan":  # see MOE_FIRST_LOSS_TOL
        args += ["--parallelism.rrfp_weight_split", "autograd"]
    config = ConfigManager().parse_args(args)
    if name == MOE:
        _shrink_moe(config.model_spec.model)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if not ac:  # torch's ZB-V splits B and W, which a checkpointed region does not allow
        config.activation_checkpoint = None
    if not chunked and module == "llama3":  # torchtitan's with the loss the chunked one wraps
        config.loss = config.loss.loss_fn
    return config


def _shrink_moe(model_config) -> None:
    """MOE_LAYERS layers of MOE_EXPERTS experts in place of the debug model's, built as
    torchtitan's registry builds the debug model's, with its attention and RoPE."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    attention = model_config.layers[0].attention
    model_config.layers = _build_qwen3_moe_layers(
        n_layers=MOE_LAYERS,
        dim=model_config.dim,
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        moe_hidden_dim=MOE_HIDDEN,
        num_experts=MOE_EXPERTS,
        top_k=MOE_TOP_K,
        attn_backend="flex",  # the test puts ScaledDotProductAttention in after
        moe_comm_backend="standard",
        rope=attention.rope,
    )


def _trainer(config, rank: int):
    """A torchtitan Trainer built as Trainer.__init__ builds its pipeline-parallel parts; the
    parts the training step does not use (data, checkpoints, metrics) are left out."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer

    parallel_dims_module.device_type = "cpu"  # torchtitan's default is cuda without an accelerator
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    parallel_dims = ParallelDims.from_config(config.parallelism, 2)
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    schedule, parts, first, last = spec.pipelining_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder="unused",
        device=torch.device("cpu"),
        model_config=model_config,
        parallelize_fn=spec.parallelize_fn,
        loss_fn=loss_fn,
    )
    torch.manual_seed(rank)  # the same weights for both runs: the same rank holds the same stages
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    if last and isinstance(loss_fn, ChunkedLossWrapper):
        loss_fn.set_lm_head(parts[-1].lm_head)
        parts[-1]._skip_lm_head = True
    trainer = object.__new__(Trainer)
    trainer.config, trainer.model_config, trainer.parallel_dims = (
        config,
        model_config,
        parallel_dims,
    )
    trainer.model_parts, trainer.pp_schedule = parts, schedule
    trainer.pp_has_first_stage, trainer.pp_has_last_stage = first, last
    trainer.device, trainer.ntokens_seen = torch.device("cpu"), 0
    trainer.train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims, spmd_typechecking=False
    )
    trainer.optimizers = config.optimizer.build(model_parts=parts)
    trainer.lr_schedulers = config.lr_scheduler.build(
        optimizers=trainer.optimizers, training_steps=STEPS
    )
    return trainer


def _microbatches(step: int):
    """M microbatches of one sequence each, as torchtitan's dataloader gives them: the input and
    its positions, and the labels."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 2000, (M, 1, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0)
    inputs = [{"input": tokens[i, :, :-1], "positions": positions} for i in range(M)]
    return inputs, [tokens[i, :, 1:] for i in range(M)]


def _torch_step(trainer, inputs, labels, global_valid_tokens):
    """torch 2.14's ``step(arg_mbs=, kwarg_mbs=, target_mbs=)`` on torch 2.13: the per-iteration
    reset of ``step``, then ``_step_microbatches``."""
    schedule = trainer.pp_schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    losses = [] if trainer.pp_has_last_stage else None
    schedule._step_microbatches(
        [(d["input"],) for d in inputs] if trainer.pp_has_first_stage else None,
        [{"positions": d["positions"]} for d in inputs],
        labels if trainer.pp_has_last_stage else None,
        losses,
        False,
        loss_kwargs={"global_valid_tokens": global_valid_tokens},
    )
    return torch.stack(losses).sum() if losses is not None else None


def _train(
    module: str, schedule: str, ac: bool, chunked: bool, rank: int, name: str = DEBUG
) -> dict:
    import torchtitan.distributed.utils as dist_utils

    trainer = _trainer(_config(module, schedule, ac, chunked, name), rank)
    out: dict = {"losses": [], "norms": [], "refused": None}
    before = [p.detach().clone() for m in trainer.model_parts for p in m.parameters()]
    out["initial"] = _named(trainer.model_parts, lambda p: p)
    for step in range(STEPS):
        inputs, labels = _microbatches(step)
        valid = torch.tensor(M * SEQ)
        trainer.optimizers.zero_grad()
        if module == "rrfp.titan":  # torchtitan's own training step
            loss = trainer.pp_forward_backward_step(
                input_dict_mbs=inputs, label_mbs=labels, global_valid_tokens=valid
            )
            loss = loss if trainer.pp_has_last_stage else None
            if step == 0:  # before clipping scales them
                out["grads"] = _named(trainer.model_parts, lambda p: p.grad)
        else:
            if step == 0:  # torch 2.13 splits the pre-split lists as if they were one batch
                try:
                    trainer.pp_forward_backward_step(
                        input_dict_mbs=inputs, label_mbs=labels, global_valid_tokens=valid
                    )
                except ValueError as e:
                    out["refused"] = str(e)
            loss = _torch_step(trainer, inputs, labels, valid)
        norm = dist_utils.clip_grad_norm_(
            [p for m in trainer.model_parts for p in m.parameters()],
            trainer.config.training.max_norm,
            foreach=True,
            pp_mesh=trainer.parallel_dims.get_optional_mesh("pp"),
            ep_enabled=False,
        )
        trainer.optimizers.step()
        trainer.lr_schedulers.step()
        out["losses"].append(None if loss is None else loss.item())
        out["norms"].append(norm.item())
    after = [p.detach() for m in trainer.model_parts for p in m.parameters()]
    out["moved"] = max((a - b).abs().max().item() for a, b in zip(after, before))
    out["params"] = {
        (i, name): p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for i, part in enumerate(trainer.model_parts)
        for name, p in part.named_parameters()
    }
    out["stages"] = [
        s.stage_index
        for s in (
            getattr(trainer.pp_schedule, "_stages", None)
            or [getattr(trainer.pp_schedule, "_stage", None)]
        )
        if s is not None
    ]
    if module == "rrfp.titan":
        ready = trainer.pp_schedule.schedule
        out["ready"] = (
            sorted(s.stage_index for s in ready._stages),
            str(ready._runtime.virtual.placement),
            sorted({t.kind.name for t in ready.last_result.order}),
        )
        trainer.pp_schedule.close()
    return out


def _named(parts, of) -> dict:
    """{the whole model's parameter name: of(parameter)}, torch's wrappers' names taken out."""
    return {
        name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", ""): (
            None if of(p) is None else of(p).detach().clone()
        )
        for part in parts
        for name, p in part.named_parameters()
    }


def _one_process(
    schedule: str, ac: bool, initial: dict, grads: dict, name: str = DEBUG
) -> tuple[int, float]:
    """The whole model in one process on every stage's initial weights and the first step's
    microbatches: (how many gradients the pipeline gave, their largest difference to these)."""
    config = _config("rrfp.titan", schedule, ac, name=name)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    model = model_config.build()
    # every parameter from the stages, copied by name; the buffers as the model builds them (the
    # MoE layers' load-balancing bias starts at zero, as on the stages before their first step).
    # Not a state dict of both: torchtitan's holds the fused QKV weight as its parts (wq, wk,
    # wv), which a load prefers over wqkv
    params = dict(model.named_parameters())
    assert sorted(initial) == sorted(params), sorted(set(initial) ^ set(params))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(initial[name])
    loss_fn = config.loss.build(compile_config=config.compile)
    inputs, labels = _microbatches(0)
    for mb, target in zip(inputs, labels):
        loss, _ = loss_fn(model(mb["input"], positions=mb["positions"]), target, M * SEQ)
        loss.backward()
    given = {n: g for n, g in grads.items() if g is not None}
    return len(given), max(
        (p.grad - given[n]).abs().max().item() for n, p in model.named_parameters() if n in given
    )


def _parity(rank, world, schedule, ac, chunked, name=DEBUG):
    import resource

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        torch_run = _train(MODULES[name], schedule, ac, chunked, rank, name)
        ready_run = _train("rrfp.titan", schedule, ac, chunked, rank, name)
        every = [None] * world  # each rank's stages, for one process on rank 0
        dist.all_gather_object(every, (ready_run.pop("initial"), ready_run.pop("grads")))
    finally:
        dist.destroy_process_group()
    one_process = None
    if rank == 0:
        initial = {k: v for d, _ in every for k, v in d.items()}
        grads = {k: v for _, d in every for k, v in d.items()}
        one_process = (len(initial), *_one_process(schedule, ac, initial, grads, name))
    names = sorted(torch_run["params"])
    return dict(
        one_process=one_process,
        torch={k: v for k, v in torch_run.items() if k not in ("params", "initial")},
        ready={k: v for k, v in ready_run.items() if k != "params"},
        same_names=names == sorted(ready_run["params"]),
        param=max(
            (torch_run["params"][k] - ready_run["params"][k]).abs().max().item() for k in names
        ),
        peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    )


# schedule, activation checkpointing, torchtitan's side with its chunked loss, torch's stage
# indices per rank, rrfp's placement. torch's ZB-V with torchtitan's chunked loss leaves the final
# norm's weight without a gradient (docs/torchtitan.md), so there torchtitan's side runs the loss
# the chunked one wraps, as rrfp.titan does.
CASES = [
    ("1F1B", True, True, {0: [0], 1: [1]}, "interleaved"),
    ("Interleaved1F1B", True, True, {0: [0, 2], 1: [1, 3]}, "interleaved"),
    ("ZBVZeroBubble", False, False, {0: [0, 3], 1: [1, 2]}, "v"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule, ac, chunked, held, placement", CASES)
def test_rrfp_titan_trains_as_torchtitan_on_the_debug_model(schedule, ac, chunked, held, placement):
    results = run_ranks(_parity, 2, schedule, ac, chunked, timeout=540)
    holder = 0 if placement == "v" else 1  # the rank holding the last stage
    for rank, res in sorted(results.items()):
        t, r = res["torch"], res["ready"]
        print(f"{schedule} rank {rank}: torch losses {t['losses']} norms {t['norms']}")
        print(f"{schedule} rank {rank}: rrfp  losses {r['losses']} norms {r['norms']}")
        print(f"{schedule} rank {rank}: max parameter difference {res['param']:.3g}")
        if rank == 0:
            print(f"{schedule}: one process (parameters, gradients, max diff) {res['one_process']}")
        assert t["stages"] == held[rank], (rank, t["stages"])
        stages, ready_placement, kinds = r["ready"]
        assert stages == held[rank] and ready_placement == placement, (rank, r["ready"])
        # activation checkpointing keeps B whole; without it bfw splits off W
        assert kinds == (["B", "F"] if ac else ["B", "F", "W"]), (rank, kinds)
        assert "Expecting 4 arg_mbs but got 1" in (t["refused"] or ""), t["refused"]
        assert res["same_names"]
        for a, b in zip(t["norms"], r["norms"]):
            assert abs(a - b) <= NORM_TOL * max(1.0, abs(a)), (rank, t["norms"], r["norms"])
        if rank == holder:
            assert all(x is not None for x in t["losses"] + r["losses"]), (t, r)
            for a, b in zip(t["losses"], r["losses"]):
                assert abs(a - b) <= LOSS_TOL * abs(a), (t["losses"], r["losses"])
        else:
            assert t["losses"] == r["losses"] == [None] * STEPS
        assert res["param"] < PARAM_TOL, (rank, res["param"])
        if rank == 0:  # every gradient of the first step, against the whole model in one process
            n_params, n_grads, diff = res["one_process"]
            assert n_params == n_grads == 45 and diff < GRAD_TOL, res["one_process"]
        assert t["moved"] > 1e-4 and r["moved"] > 1e-4, (t["moved"], r["moved"])  # they train


# step 1 runs the same float32 operations on the same weights (rrfp's generic split, which asks
# torchtitan's own backward ops for the weight gradients; the split-aware functions compute the
# same gradients in another float32 order: 7.8e-6 off one process at most, observed, and Adam
# turns that into 1.6e-4 by step 2): its gradient norm is the same number, its loss the same up
# to the order torchtitan's chunked loss sums in. From step 2 the weights differ by float32
# rounding (clipping and AdamW on gradients summed in another order), and a token whose two best
# experts nearly tie can pick the other one: observed 2.7e-6 relative in the norm and 5e-7 in the
# loss by step 3, bounded here by 1e-5.
MOE_FIRST_LOSS_TOL, MOE_LATER_TOL, MOE_PEAK_MB = 1e-6, 1e-5, 2048


@pytest.mark.timeout(600)
def test_rrfp_titan_trains_torchtitans_mixture_of_experts():
    """torchtitan's Qwen3 MoE (its MoE layers: token-choice top-k router, grouped experts, the
    load-balancing bias update; experts local, no EP; shrunk to MOE_LAYERS layers of MOE_EXPERTS
    experts; 3 + 10 per layer parameters) under 1F1B placement, activation checkpointing off (B
    and W apart): rrfp.titan gives every first-step gradient of the whole model in one process,
    and trains 3 steps as torchtitan's own 1F1B does, step 1 equal, steps 2 and 3 within
    MOE_LATER_TOL."""
    results = run_ranks(_parity, 2, "1F1B", False, False, MOE, timeout=540)
    for rank, res in sorted(results.items()):
        t, r = res["torch"], res["ready"]
        print(f"moe rank {rank}: torch losses {t['losses']} norms {t['norms']}")
        print(f"moe rank {rank}: rrfp  losses {r['losses']} norms {r['norms']}")
        print(f"moe rank {rank}: one process {res['one_process']}, param diff {res['param']:.3g}")
        print(f"moe rank {rank}: peak RSS {res['peak_mb']:.0f} MB")
        assert res["peak_mb"] < MOE_PEAK_MB, res["peak_mb"]  # the machine's ranks share its RAM
        assert res["same_names"] and r["ready"][2] == ["B", "F", "W"], r["ready"]
        assert t["norms"][0] == r["norms"][0], (t["norms"], r["norms"])
        for a, b in zip(t["norms"][1:], r["norms"][1:]):
            assert abs(a - b) <= MOE_LATER_TOL * a, (rank, t["norms"], r["norms"])
        if rank == 1:  # the last stage's: the losses
            assert abs(t["losses"][0] - r["losses"][0]) <= MOE_FIRST_LOSS_TOL * t["losses"][0]
            for a, b in zip(t["losses"][1:], r["losses"][1:]):
                assert abs(a - b) <= MOE_LATER_TOL * a, (t["losses"], r["losses"])
        else:
            n_params, n_grads, diff = res["one_process"]
            assert n_params == n_grads == 3 + 10 * MOE_LAYERS and diff < GRAD_TOL, res
        assert t["moved"] > 1e-4 and r["moved"] > 1e-4, (t["moved"], r["moved"])
