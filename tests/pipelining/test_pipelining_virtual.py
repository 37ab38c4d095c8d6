"""ScheduleReady with several stages per rank (virtual stages) on real gloo ranks: given the list
of the rank's PipelineStages, as torch's PipelineScheduleMulti takes it, it must give the losses,
gradients and outputs of each of torch's multi-stage schedules of that placement on the same stages
(ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble for the interleaved placement,
ScheduleZBVZeroBubble and ScheduleDualPipeV for v), and of a single-process run of the same model
and data; stage sets that are neither placement and stages on different devices are refused in one
line. Keyword arguments to every stage: tests/pipelining/test_pipelining_kwargs.py."""

from __future__ import annotations

import copy

import pytest
import torch
from harness.distributed import run_ranks
from harness.pipelining_model import BATCH, VOCAB, M, batch, full_model, grads_of, loss_fn, max_diff
from harness.pipelining_virtual import TOL, V, held_stages, loss_diff, reference

pytestmark = pytest.mark.multirank

# torch's multi-stage schedules of each placement; ScheduleDualPipeV needs M >= S * V microbatches
# (schedules.py, ScheduleDualPipeV.__init__: "DualPipeV requires at least as many microbatches as
# stages"), so at 4 ranks (8 stages) it runs only in the case with M = 8, and refuses M = 4
TORCH_SCHEDULES = {
    "interleaved": ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"),
    "v": ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"),
}
# torch 2.13's v schedules cannot eval: they still run the B of the stage whose predecessor is on
# the same rank, whose hand-off (schedules.py _perform_action, get_local_bwd_output) fails with
# "can't steal_bwd_input if this stage doesn't have backward" (stage.py), as eval's stages have none
TORCH_CANNOT_EVAL = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
RRFP_HINTS = {"interleaved": ("bfw", "1f1b"), "v": ("bfw", "zbv")}


def _run(
    cls,
    stages,
    local_modules,
    first: bool,
    last: bool,
    data,
    m: int,
    evaluate: bool = True,
    **options,
):
    """One step of ``m`` microbatches, a second one without zero_grad (torch divides the accumulated
    .grad by m), and an eval (the parameters have not moved: the first step's losses and output
    again)."""
    (x, y), (x2, y2) = data
    schedule = cls(stages, m, loss_fn=loss_fn, **options)
    losses, eval_losses = [], []
    merged = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    grads1 = {
        (s.stage_index, n): g for s, c in zip(stages, local_modules) for n, g in grads_of(c).items()
    }
    schedule.step(*((x2,) if first else ()), target=y2 if last else None)
    grads2 = {
        (s.stage_index, n): g for s, c in zip(stages, local_modules) for n, g in grads_of(c).items()
    }
    evaluated = None
    if evaluate:
        evaluated = schedule.eval(
            *((x,) if first else ()), target=y if last else None, losses=eval_losses
        )
    out = dict(
        losses=[loss.item() for loss in losses],
        grads1=grads1,
        grads2=grads2,
        merged=merged,
        eval_losses=[loss.item() for loss in eval_losses],
        evaluated=evaluated,
    )
    return schedule, out


def torch_schedules_for(placement: str, world: int, m: int) -> tuple[str, ...]:
    """torch's ``placement`` schedules for ``world`` ranks of V stages and ``m`` microbatches."""
    return tuple(
        n for n in TORCH_SCHEDULES[placement] if n != "ScheduleDualPipeV" or m >= world * V
    )


def _virtual_parity(rank, world, placement, m):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from rrfp import ScheduleReady

    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo")
    S = world * V
    mine = held_stages(rank, world, placement)
    first, last = 0 in mine, S - 1 in mine
    model = full_model(S)
    data = (batch(1, 5, rows=BATCH * m), batch(2, 5, rows=BATCH * m))
    runs, result = {}, {}
    try:
        for name in sorted(
            set(TORCH_SCHEDULES[placement]) - set(torch_schedules_for(placement, world, m))
        ):
            stages = [
                PipelineStage(copy.deepcopy(model[s]), s, S, torch.device("cpu")) for s in mine
            ]
            with pytest.raises(
                ValueError
            ) as refused:  # the reason torch_schedules_for leaves it out
                getattr(torch_schedules, name)(stages, m, loss_fn=loss_fn)
            result[f"{name} refused"] = str(refused.value)
        for name, cls, options in [
            *[
                (n, getattr(torch_schedules, n), {"evaluate": n not in TORCH_CANNOT_EVAL})
                for n in torch_schedules_for(placement, world, m)
            ],
            *[(f"rrfp {h}", ScheduleReady, {"hint": h}) for h in RRFP_HINTS[placement]],
        ]:
            local_modules = [copy.deepcopy(model[s]) for s in mine]
            stages = [
                PipelineStage(c, s, S, torch.device("cpu")) for s, c in zip(mine, local_modules)
            ]
            if (
                cls is ScheduleReady
            ):  # torch needs them in model order (its warm-up hangs otherwise); rrfp sorts
                stages, local_modules = stages[::-1], local_modules[::-1]
            schedule, runs[name] = _run(cls, stages, local_modules, first, last, data, m, **options)
            if cls is ScheduleReady:
                result[f"{name} runtime stages"] = (
                    tuple(schedule._runtime.stages),
                    str(schedule._runtime.virtual.placement),
                )
                # the hint reached the executor: 1f1b runs whole backwards, bfw and zbv split off W
                result[f"{name} kinds"] = sorted({t.kind.name for t in schedule.last_result.order})
                schedule.close()
    finally:
        dist.destroy_process_group()
    ref_losses, ref, ref_out = reference(S, mine, *data[0])
    for name, r in runs.items():
        res = dict(
            ref_grad=max_diff(ref, r["grads1"]), names=len(r["grads1"]), n_losses=len(r["losses"])
        )
        if last:
            res.update(
                ref_loss=loss_diff(ref_losses, r["losses"]),
                ref_merged=(ref_out - r["merged"]).abs().max().item(),
                shape=tuple(r["merged"].shape),
            )
        if not name.startswith("rrfp"):
            result[name] = res
            continue
        if last:
            res.update(
                eval_loss=loss_diff(ref_losses, r["eval_losses"]),
                n_eval=len(r["eval_losses"]),
                evaluated=(ref_out - r["evaluated"]).abs().max().item(),
            )
        else:
            res.update(merged=r["merged"], losses=r["losses"], evaluated=r["evaluated"])
        for t_name in torch_schedules_for(
            placement, world, m
        ):  # ScheduleReady against each of torch's
            t = runs[t_name]
            vs = dict(
                grad1=max_diff(t["grads1"], r["grads1"]), grad2=max_diff(t["grads2"], r["grads2"])
            )
            if last:
                vs.update(
                    loss=loss_diff(t["losses"], r["losses"]),
                    merged=(t["merged"] - r["merged"]).abs().max().item(),
                )
                if t["evaluated"] is not None:
                    vs.update(
                        eval_loss=loss_diff(t["eval_losses"], r["eval_losses"]),
                        evaluated=(t["evaluated"] - r["evaluated"]).abs().max().item(),
                    )
            res[t_name] = vs
        result[name] = res
    return result


@pytest.mark.timeout(300)
# M = 4 everywhere, where DualPipeV refuses 4 ranks (8 stages); and v at 4 ranks with DualPipeV's
# least M, S * V = 8
@pytest.mark.parametrize(
    "placement, world, m",
    [("interleaved", 2, M), ("interleaved", 4, M), ("v", 2, M), ("v", 4, M), ("v", 4, 4 * V)],
)
def test_virtual_stages_equal_torch_multi_stage_schedules_and_one_process(placement, world, m):
    results = run_ranks(_virtual_parity, world, placement, m, timeout=240)
    holder = 0 if placement == "v" else world - 1  # the rank holding the last global stage
    schedules = torch_schedules_for(placement, world, m)
    left_out = sorted(set(TORCH_SCHEDULES[placement]) - set(schedules))
    assert left_out == (["ScheduleDualPipeV"] if (placement, world, m) == ("v", 4, M) else []), (
        left_out
    )
    for rank, res in sorted(results.items()):
        for name in left_out:  # torch refuses that shape itself, on every rank
            assert res[f"{name} refused"] == (
                f"DualPipeV requires at least as many microbatches as stages, but got "
                f"{m} microbatches and {world * V} stages."
            ), res[f"{name} refused"]
        for (
            t_name
        ) in schedules:  # torch's own run against one process, and where it puts the losses
            t = res[t_name]
            print(f"{placement} world {world} M {m} rank {rank} {t_name}: {t}")
            assert t["names"] > 0 and t["n_losses"] == (m if rank == holder else 0), (
                rank,
                t_name,
                t,
            )
            assert t["ref_grad"] < TOL, (rank, t_name, t)
            if rank == holder:
                assert t["ref_loss"] < TOL and t["ref_merged"] < TOL, (rank, t_name, t)
        for hint in RRFP_HINTS[placement]:
            r = res[f"rrfp {hint}"]
            print(f"{placement} world {world} M {m} rank {rank} hint {hint}: {r}")
            assert res[f"rrfp {hint} runtime stages"] == (
                held_stages(rank, world, placement),
                placement,
            )
            assert res[f"rrfp {hint} kinds"] == (
                ["B", "F"] if hint == "1f1b" else ["B", "F", "W"]
            ), (rank, hint)
            assert r["names"] > 0
            assert r["ref_grad"] < TOL, (rank, hint, r)
            for t_name in schedules:
                vs = r[t_name]
                assert vs["grad1"] < TOL and vs["grad2"] < TOL, (rank, hint, t_name, vs)
                if rank == holder:
                    assert vs["loss"] < TOL and vs["merged"] < TOL, (rank, hint, t_name, vs)
                    if t_name not in TORCH_CANNOT_EVAL:
                        assert vs["eval_loss"] < TOL and vs["evaluated"] < TOL, (
                            rank,
                            hint,
                            t_name,
                            vs,
                        )
            if rank == holder:
                assert r["n_losses"] == m and r["n_eval"] == m, (rank, hint, r)
                assert r["ref_loss"] < TOL and r["eval_loss"] < TOL, (rank, hint, r)
                assert r["ref_merged"] < TOL and r["evaluated"] < TOL, (rank, hint, r)
                assert r["shape"] == (BATCH * m, 5, VOCAB), r
            else:  # only the last stage's rank gets an output and losses, as in torch
                assert r["merged"] is None and r["evaluated"] is None and r["losses"] == [], (
                    rank,
                    hint,
                    r,
                )


# -- refusals: one line naming the problem, on every rank, before any schedule runs
# -----------------

REFUSALS = {
    # looped placement (ScheduleLoopedBFS's): rank r holds r * V .. r * V + V - 1; each rank names
    # its own
    "looped": (
        {0: (0, 1), 1: (2, 3)},
        ValueError,
        r"group rank {r} holds stages \[\d, \d\] of 4: ScheduleReady places a rank's stages "
        r"interleaved \[{r}, {i}\] or v \[{r}, \d\], not otherwise",
    ),
    # one stage per rank: each rank checks its own (both are wrong here)
    "one stage, another rank's": (
        {0: (1,), 1: (0,)},
        ValueError,
        r"group rank {r} holds stage {h} of 2: ScheduleReady needs stage i on rank i of the group",
    ),
    "uneven": (
        {0: (0,), 1: (1, 2, 3)},
        ValueError,
        r"group rank {r} holds stages \[.*\] of 4 on 2 ranks: ScheduleReady "
        r"needs the same number of stages on every rank \(4 / 2 each\)",
    ),
    "mixed devices": (
        {0: (0, 2), 1: (1, 3)},
        ValueError,
        r"this rank's stages \[{r}, {i}\] are on different devices \['cpu', 'cuda:0'\]",
    ),
    # each rank's own stages are a placement, but not the same one: rank 0 interleaved, rank 1 v
    "ranks disagree": (
        {0: (0, 2), 1: (1, 2)},
        ValueError,
        r"the ranks' stages are not one placement: rank 0 holds "
        r"\[0, 2\] \(interleaved\), rank 1 holds \[1, 2\] \(v\)",
    ),
    # one rank alone refuses its arguments: the other fails at once with that rank's error, not
    # after waiting in group creation (whose timeout, 120 s here, is past the test's)
    "one rank's module is wrapped (V = 1)": (
        {0: (0,), 1: (1,)},
        NotImplementedError,
        r"^{who}ScheduleReady does not support a stage module wrapped in "
        r"DistributedDataParallel: use rrfp's data parallelism",
    ),
    "one rank's microbatch count (V = 2)": (
        {0: (0, 2), 1: (1, 3)},
        ValueError,
        r"^{who}n_microbatches must be a positive int, got 0$",
    ),
    # an error no check meant to raise (here planted in rank 1's module check) reaches the others
    # too
    "one rank's unexpected error": (
        {0: (0,), 1: (1,)},
        RuntimeError,
        r"^{who}planted: rank 1 cannot inspect its stage$",
    ),
    "one rank passes no stage": (
        {0: (0,), 1: (1,)},
        ValueError,
        r"^{who}ScheduleReady needs at least one PipelineStage, got an empty list$",
    ),
    # 4 ranks, pp 2 x dp 2: rank 0's stage group is [0, 1], not a pipeline of the layout ([0, 2],
    # [1, 3])
    "one rank's group": (
        {0: (0,), 1: (0,), 2: (1,), 3: (1,)},
        NotImplementedError,
        r"^{who}the stage's group has ranks \[0, 1\]; ScheduleReady supports the whole world or "
        r"the pipelines of .*\(\[\[0, 2\], \[1, 3\]\]\)$",
    ),
}
# (the refusing rank, what the others' errors start with) where it is not rank 1 and "rank 1: "
WHO = {
    "one rank's unexpected error": (1, "rank 1: RuntimeError: "),
    "one rank's group": (0, "rank 0: "),
}


def _refused(rank, world, case):
    import datetime

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady

    held, error, pattern = REFUSALS[case]
    refuser, others = WHO.get(case, (1, "rank 1: "))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    n = (
        len({s for stages in held.values() for s in stages})
        if case == "one rank's group"
        else sum(map(len, held.values()))
    )
    model = full_model(n)
    modules = {s: model[s] for s in held[rank]}
    alone = dist.new_group([1])  # every rank creates it; rank 1 wraps its stage in DDP over itself
    if case.startswith("one rank's module") and rank == 1:
        modules = {
            s: torch.nn.parallel.DistributedDataParallel(m, process_group=alone)
            for s, m in modules.items()
        }
    group = None
    if case == "one rank's group":  # every rank creates every group, in one order
        groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3), (0, 1))}
        group = groups[{0: (0, 1), 1: (1, 3), 2: (0, 2), 3: (1, 3)}[rank]]
    stages = [PipelineStage(modules[s], s, n, torch.device("cpu"), group=group) for s in held[rank]]
    if case == "one rank passes no stage" and rank == 1:
        stages = []
    if case == "mixed devices":
        stages[-1].device = torch.device(
            "cuda", 0
        )  # as a stage built for the GPU reads; no GPU needed to refuse
    count = 0 if case.startswith("one rank's microbatch") and rank == 1 else M
    if case == "one rank's unexpected error" and rank == 1:
        import rrfp.pipelining.schedule as schedule

        def planted(module):
            raise RuntimeError("planted: rank 1 cannot inspect its stage")

        schedule._check_module = planted
    try:
        with pytest.raises(error) as caught:
            ScheduleReady(stages, count, loss_fn=loss_fn, timeout_s=120)
    finally:
        dist.destroy_process_group()
    return str(caught.value), pattern.replace("{r}", str(rank)).replace(
        "{i}", str(rank + world)
    ).replace("{h}", str(held[rank][0])).replace("{who}", "" if rank == refuser else others)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_fail_every_rank_at_once_in_one_line(case):
    import re

    world = len(REFUSALS[case][0])
    results = run_ranks(_refused, world, case, timeout=60)  # 60 s: before any timeout
    assert sorted(results) == list(range(world))
    for rank, (message, pattern) in results.items():
        assert "\n" not in message and re.search(pattern, message), (rank, message, pattern)


def _absent(rank, world, flag):
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp import ScheduleReady
    from rrfp.core.errors import StartupError

    dist.init_process_group("gloo")  # the default timeout (30 min): the schedule's own must govern
    try:
        if rank == 1:  # never constructs the schedule; stays up until rank 0 has its error
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.1)
            return None
        from rrfp.pipeline.timeouts import Timeouts

        stage = PipelineStage(full_model(2)[0], 0, 2, torch.device("cpu"))
        messages = []
        try:  # the one timeout_s, then the start's wait set apart from a long timeout_s
            for kwargs in (
                dict(timeout_s=2),
                dict(timeouts=Timeouts.derive(600, process_group_s=2)),
            ):
                t0 = time.monotonic()
                with pytest.raises(StartupError) as caught:
                    ScheduleReady(stage, M, loss_fn=loss_fn, **kwargs)
                messages.append((str(caught.value), time.monotonic() - t0))
        finally:
            open(flag, "w").close()
        return messages
    finally:
        dist.destroy_process_group()


def test_a_rank_that_never_constructs_the_schedule_is_an_error_after_timeout_s(tmp_path):
    (derived, derived_s), (apart, apart_s) = run_ranks(
        _absent, 2, str(tmp_path / "done"), timeout=60
    )[0]  # 60 s: far below the group's 30 min and the 600 s timeout_s
    assert "\n" not in derived and "\n" not in apart, (derived, apart)
    assert derived.startswith(
        "rank 0: not every rank reached ScheduleReady's start within timeout_s = 2 s "
        "(every rank constructs it, in the same order): "
    ), derived
    assert apart.startswith(
        "rank 0: not every rank reached ScheduleReady's start within timeouts.process_group_s = "
        "2 s (every rank constructs it, in the same order): "
    ), apart
    assert derived_s < 30 and apart_s < 30, (derived_s, apart_s)
