"""Checkpoint and resume: a resumed run repeats the losses of an uninterrupted
one; a checkpoint is complete or ignored; a mismatched config is one error line
(exit 2) before any process group; SIGTERM on one rank stops every rank with a saved step.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from harness import ROOT
from harness.checkpoint_run import SMALL, _config, one_error_line, resume_error, rrfp_alone
from harness.distributed import run_ranks
from harness.forked_python import run_python
from harness.launch import child_env
from harness.train_rows import TrainJob

from rrfp.app.train.checkpoint_dir import MARKER, CheckpointDir

# a run of STEPS saves every step, keeping 2 (step 1 pruned); a crash then takes its last
# checkpoint, and the run resumed from step STOP_AT runs the last step again: that step crosses a
# saved optimizer state, RNG state and data position
STEPS, STOP_AT = 3, 2


# executor=fixed; ready BFW; ready BFW under lang noise in emulated time, where tasks interleave by
# timing and ready BFW on two virtual stages per rank (v placement: the turn is local), each saved
# under its stage key
VARIANTS = {
    "fixed": ("fixed", {}),
    "ready": ("ready", {}),
    "ready-lang": ("ready", {"preset": "lang", "unit_ms": 2}),
    "ready-v2": ("ready", {"virtual": 2, "placement": "v", "n_layer": 4}),
}


def _crash_debris(ckdir: Path) -> None:
    """What a crash while the last step was saved leaves: its checkpoint gone and a plain file where
    the resumed run commits it, a partial directory, and a newer step without its marker."""
    store = CheckpointDir(ckdir)
    shutil.rmtree(store.final_path(STEPS))
    store.final_path(STEPS).write_text("debris")
    shutil.copytree(store.final_path(STOP_AT), store.partial_path(STOP_AT + 1))
    shutil.copytree(store.final_path(STOP_AT), store.final_path(STEPS + 1))
    (store.final_path(STEPS + 1) / MARKER).unlink()


def _interrupted_and_whole(rank, world, root):
    """In one process group: per executor, an uninterrupted STEPS-step run, the same run saving
    every step (keeping 2), and, after a crash took its last checkpoint and left debris beside the
    others, a run that resumes it to STEPS."""
    import datetime

    import torch.distributed as dist

    from rrfp.app.train.training import stage_main
    from rrfp.loop import run

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = {}
    for variant, (dispatch, extra) in VARIANTS.items():
        ckdir = Path(root) / variant
        whole = run(stage_main(_config(STEPS, dispatch, **extra))).losses
        saving = run(
            stage_main(
                _config(
                    STEPS,
                    dispatch,
                    checkpoint_dir=str(ckdir),
                    checkpoint_every=1,
                    checkpoint_keep=2,
                    **extra,
                )
            )
        )
        dist.barrier()
        kept = sorted(p.name for p in ckdir.iterdir())
        dist.barrier()
        if rank == 0:
            _crash_debris(ckdir)
        dist.barrier()
        second = run(
            stage_main(
                _config(STEPS, dispatch, checkpoint_dir=str(ckdir), resume="required", **extra)
            )
        )
        dist.barrier()
        out[variant] = dict(
            whole=whole,
            saving=saving.losses,
            second=second.losses,
            resumed_from=second.first_step,
            kept=kept,
            after=sorted(p.name for p in ckdir.iterdir()),
        )
    dist.destroy_process_group()
    return out


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_resumed_run_repeats_the_uninterrupted_losses(tmp_path):
    results = run_ranks(_interrupted_and_whole, 2, str(tmp_path), timeout=180)
    for rank, out in results.items():
        for dispatch, r in out.items():
            where = f"rank {rank}, {dispatch}"
            assert r["kept"] == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"], (
                f"{where}: keep-last-2 left {r['kept']}"
            )
            assert r["resumed_from"] == STOP_AT, f"{where}: resumed from step {r['resumed_from']}"
            # the resumed run committed its last step (no checkpoint_every) and cleaned the debris
            # up
            assert r["after"] == [f"step-{STOP_AT:08d}", f"step-{STEPS:08d}"], (
                f"{where}: {r['after']}"
            )
            resumed = r["saving"][:STOP_AT] + r["second"]
            whole = r["whole"]
            assert len(resumed) == len(whole) == len(r["saving"]) == STEPS, where
            print(
                f"{where}: uninterrupted {whole}\n  resumed {resumed}\n  the uninterrupted run "
                f"that saved {r['saving']}; largest difference to the resumed run "
                f"{max(abs(a - b) for a, b in zip(resumed, whole)):.3g}"
            )
            # bit-exact for both executors: readiness changes how F, B and W interleave, but on
            # every stage each kind still runs in microbatch order (B(m) needs B(m-1)'s gradient
            # from downstream, and the hint ranks W by microbatch), so every parameter's gradient is
            # summed in the same order, and the loss is summed over microbatches in index order
            assert resumed == whole, f"{where}: not bit-exact"
            assert r["saving"] == whole, (
                f"{where}: two uninterrupted runs differ (one saved, one did not)"
            )
        assert out["fixed"]["whole"] == results[0]["fixed"]["whole"], (
            "ranks report different losses"
        )
        for variant in ("ready", "ready-lang"):
            assert out[variant]["whole"] == out["fixed"]["whole"], (
                f"{variant} and fixed BFW sum differently"
            )


# ---- the command line: separate `rrfp train` processes, as torchrun would start them ----


NO_RUN_FOLDER = ("--set", "output.dir=")  # metrics nobody reads: rank 0 writes none each step


def train(tmp: Path, *args: str, limit_s: float = 90) -> TrainJob:
    """`rrfp train` on 2 ranks, each a plain process (not torchrun's child: torchrun would end a
    rank's siblings itself, hiding whether each ends on its own), run to its end."""
    return TrainJob(tmp, [*SMALL, *NO_RUN_FOLDER, "--set", "timeout_s=20", *args]).finish(limit_s)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint directory from a real 2-step run (pp=2, 4 microbatches)."""
    tmp = tmp_path_factory.mktemp("saved")
    ranks = train(tmp / "logs", "--set", "steps=2", "--set", f"checkpoint.dir={tmp / 'ck'}")
    assert ranks.codes() == [0, 0], ranks.tails()
    assert [c.step for c in CheckpointDir(tmp / "ck").complete()] == [2]
    return tmp / "ck"


MISMATCHES = [
    (
        ["pp=1", "tp=2"],
        ["parallel.pp: checkpoint 2, this run 1", "parallel.tp: checkpoint 1, this run 2"],
    ),
    (["model.n_embd=64"], ["model.n_embd: checkpoint 32, this run 64"]),
    (["n_microbatches=8"], ["schedule.n_microbatches: checkpoint 4, this run 8"]),
    (["data.max_seq_len=32"], ["data.max_seq_len: checkpoint 64, this run 32"]),
    (
        ["virtual=2", "placement=v", "model.n_layer=4"],
        ["parallel.virtual: checkpoint 1, this run 2"],
    ),
]
MEANINGLESS = {
    4: "parallel.placement"
}  # the checkpoint has one stage per rank: its placement says nothing


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_resume_with_another_config_is_one_error_line(saved):
    # the command: exit 2 and one line, with a rendezvous nobody serves (so no group was joined)
    res = rrfp_alone(
        "--set",
        "pp=1",
        "--set",
        "tp=2",
        "--set",
        "steps=4",
        "--set",
        f"checkpoint.dir={saved}",
        "--resume",
    )
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    one_error_line(
        res.stderr,
        "cannot resume from",
        str(saved / "step-00000002"),
        "saved with a different config",
        *MISMATCHES[0][1],
    )
    for i, (sets, needles) in enumerate(
        MISMATCHES
    ):  # the check the command ran, on each kind of difference
        message = resume_error(saved, "steps=4", "resume=required", *sets)
        assert "saved with a different config" in message and "\n" not in message, message
        for needle in needles:
            assert needle in message, message
        assert MEANINGLESS.get(i, "\0") not in message, message


def test_placement_differs_only_between_layouts_with_several_stages_per_rank():
    """parallel.placement means something only where both the checkpoint and the run have virtual >
    1: resuming a V = 2 checkpoint at V = 1 names parallel.virtual alone (it once named the
    placement too)."""
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoints import _comparable, differences, fingerprint

    def fp(*sets):
        return fingerprint(TrainConfig.load(SMALL[1], ["model.n_layer=4", *sets], world_size=2))

    v2_v, v2_inter, v1 = fp("virtual=2", "placement=v"), fp("virtual=2"), fp()
    assert differences(*_comparable(v2_v, v1)) == ["parallel.virtual: checkpoint 2, this run 1"]
    assert differences(*_comparable(v1, v2_v)) == ["parallel.virtual: checkpoint 1, this run 2"]
    assert differences(*_comparable(v2_v, v2_inter)) == [
        "parallel.placement: checkpoint 'v', this run 'interleaved'"
    ]
    assert differences(*_comparable(v1, v1)) == []
    before_virtual = {
        **v1,
        "run": {k: v for k, v in v1["run"].items() if k not in ("virtual", "placement")},
    }
    assert (
        differences(*_comparable(before_virtual, v1)) == []
    )  # saved before parallel.virtual existed: V = 1
    assert differences(*_comparable(before_virtual, v2_v)) == [
        "parallel.virtual: checkpoint 1, this run 2"
    ]


@pytest.mark.multirank
def test_resume_problems_found_before_any_process_group(saved, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    (broken / "step-00000002" / ".metadata").write_bytes(b"not a pickle")
    cases = [
        (tmp_path / "empty", ["resume=required"], ["--resume: no complete checkpoint in", "empty"]),
        (
            saved,
            [],
            ["already holds checkpoints (the latest at step 2)", "--resume"],
        ),  # a fresh run would prune them
        (saved, ["resume=auto", "steps=2"], ["it is at step 2 and run.steps = 2: nothing left"]),
        (
            broken,
            ["resume=required", "steps=4"],
            [
                "no checkpoint in",
                "verifies, nothing was loaded",
                "step-00000002: .metadata has 12 bytes",
            ],
        ),
    ]
    for ckdir, sets, needles in cases:
        message = resume_error(ckdir, *sets)
        for needle in needles:
            assert needle in message, (sets, message)
    assert [c.step for c in CheckpointDir(saved).complete()] == [2], (
        "a failed start touched the checkpoints"
    )
    from rrfp.app.config.train_config import TrainConfig
    from rrfp.app.train.checkpoints import resume_point

    fresh = TrainConfig.load(
        SMALL[1], [f"checkpoint.dir={tmp_path / 'empty'}", "resume=auto"], world_size=2
    )
    assert resume_point(fresh) is None  # auto with nothing to resume: step 0


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_checkpoint_that_does_not_load_exits_2_on_every_rank(saved, tmp_path):
    broken = tmp_path / "ck"
    shutil.copytree(saved, broken)
    data = broken / "step-00000002" / "__1_0.distcp"
    data.write_bytes(
        data.read_bytes()[:100]
    )  # a file cut short: its commit record says how long it was
    ranks = train(
        tmp_path / "logs", "--set", "steps=4", "--set", f"checkpoint.dir={broken}", "--resume"
    )
    for r, code in enumerate(ranks.codes()):
        assert code == 2, f"rank {r} exited {code}\n" + ranks.tails()
        # no rendezvous store outside torchrun: each rank prints (under torchrun rank 0 alone does)
        one_error_line(
            ranks.err(r),
            f"no checkpoint in {broken} verifies, nothing was loaded",
            "step-00000002: __1_0.distcp has 100 bytes",
        )


TIMEOUT_S = 10


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_sigterm_on_one_rank_stops_every_rank_with_a_saved_step(tmp_path):
    ckdir = tmp_path / "ck"
    ranks = TrainJob(
        tmp_path / "logs",
        [
            *SMALL,
            *NO_RUN_FOLDER,
            "--set",
            "steps=100000",
            "--set",
            "unit_ms=20",
            "--set",
            f"timeout_s={TIMEOUT_S}",
            "--set",
            f"checkpoint.dir={ckdir}",
            "--set",
            "checkpoint.every=4",
        ],
    )
    try:
        t0 = time.monotonic()
        while sum(ln.startswith("step") for ln in ranks.out(0).splitlines()) < 2:
            assert ranks.codes() == [None, None], "a rank exited early\n" + ranks.tails()
            assert time.monotonic() - t0 < 60, "no steps within 60 s\n" + ranks.tails()
            time.sleep(0.05)
        os.kill(ranks.procs[1].pid, signal.SIGTERM)
        t_sig = time.monotonic()
        ranks.wait(range(2), time.monotonic() + TIMEOUT_S + 10)
        codes = ranks.codes()
        elapsed = time.monotonic() - t_sig
        assert None not in codes, (
            f"rank(s) still running {elapsed:.1f} s after SIGTERM: {codes}\n" + ranks.tails()
        )
        assert codes == [143, 143], f"exit codes {codes}\n" + ranks.tails()
        print(f"every rank ended {elapsed:.2f} s after SIGTERM on rank 1")
        # one line for the job: rank 0's (it hears of the SIGTERM through the store); rank 1: none
        for r in range(2):
            assert "Traceback" not in ranks.err(r), ranks.err(r)
        assert not [ln for ln in ranks.err(1).splitlines() if ln.startswith("rrfp: ")], ranks.err(1)
        lines = [ln for ln in ranks.err(0).splitlines() if ln.startswith("rrfp: ")]
        assert len(lines) == 1 and lines[0].startswith(
            "rrfp: stopped: rank 0: SIGTERM on another rank; "
        ), ranks.err(0)
        step = int(lines[0].split(" is saved;")[0].rsplit("(step ", 1)[1].rstrip(")"))
        assert f"checkpoint {ckdir / f'step-{step:08d}'} (step {step}) is saved" in lines[0], lines[
            0
        ]
        printed = sum(ln.startswith("step") for ln in ranks.out(0).splitlines())
        assert printed == step, f"rank 0 printed {printed} steps, stopped after {step}"
    finally:
        ranks.kill()
    assert CheckpointDir(ckdir).latest().step == step
    assert not CheckpointDir(ckdir).incomplete(), list(ckdir.iterdir())
    # the stopped run's checkpoint continues: two more steps
    resumed = train(
        tmp_path / "resumed",
        "--set",
        f"steps={step + 2}",
        "--set",
        f"checkpoint.dir={ckdir}",
        "--resume",
    )
    assert resumed.codes() == [0, 0], resumed.tails()
    out = resumed.out(0)
    assert f"resume: from {ckdir / f'step-{step:08d}'} (step {step} of {step + 2})" in out, out
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("step")] == [
        f"{step + 1}/{step + 2}",
        f"{step + 2}/{step + 2}",
    ], out
    assert CheckpointDir(ckdir).latest().step == step + 2


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("committed", [False, True])
def test_second_sigterm_leaves_at_once(tmp_path, committed, sig):
    """The first SIGTERM or SIGINT (Ctrl-C) is a request (the run stops without waiting for its
    step); a second one ends the process, 128 + the signal, saying which checkpoint is left: none
    when none was committed, not "the last one stays". One within SAME_REQUEST_S of the first is the
    same request (torchrun's agent, signalled twice, sends SIGINT then SIGTERM at once)."""
    if committed:
        CheckpointDir(tmp_path).partial_path(4).mkdir()
        CheckpointDir(tmp_path).commit(4, {})
    code = (
        "import os, signal, time\n"
        "from rrfp.app.cli.train_command import SAME_REQUEST_S, StopOnSigterm, kept_checkpoint\n"
        f"stop = StopOnSigterm(lambda: kept_checkpoint({str(tmp_path)!r})).install()\n"
        f"os.kill(os.getpid(), signal.{sig}); time.sleep(0.05)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(SAME_REQUEST_S + 0.2)\n"
        "print('requested', stop.requested, stop.signal, flush=True)\n"
        f"os.kill(os.getpid(), signal.{sig}); time.sleep(10)\n"
        "print('still here', flush=True)\n"
    )
    res = run_python(["-c", code], env=child_env(), cwd=ROOT, timeout=60)
    code = 128 + getattr(signal, sig)
    assert (res.returncode, res.stdout) == (code, f"requested True {sig}\n"), (
        res.returncode,
        res.stdout,
        res.stderr,
    )
    kept = (
        f"the last committed checkpoint, {tmp_path / 'step-00000004'} (step 4), stays"
        if committed
        else f"no checkpoint has been committed in {tmp_path}: nothing of this run is kept"
    )
    assert res.stderr.strip() == f"rrfp: second {sig}: leaving now; {kept}"


def test_only_committed_directories_are_checkpoints(tmp_path):
    store = CheckpointDir(tmp_path)
    for step in (1, 2, 3):
        store.partial_path(step).mkdir()
        (store.partial_path(step) / "__0_0.distcp").write_text("data")
        assert store.latest() is None or store.latest().step == step - 1  # not before its commit
        store.commit(step, {"config": {}})
    store.partial_path(4).mkdir()  # a crash while step 4 was written
    store.final_path(5).mkdir()  # a step directory without the marker
    (tmp_path / ".trash-step-00000000").mkdir()  # a crash while deleting
    assert [c.step for c in store.complete()] == [1, 2, 3]
    assert store.latest().meta() == {"config": {}, "step": 3}
    assert {p.name for p in store.incomplete()} == {
        ".partial-step-00000004",
        "step-00000005",
        ".trash-step-00000000",
    }
    removed = store.prune(keep=2)
    assert [p.name for p in removed] == ["step-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    store.partial_path(3).mkdir()
    with pytest.raises(OSError):  # a second step 3 is never mixed into the committed one
        store.commit(3, {"config": {"other": 1}})
    assert store.latest().meta() == {"config": {}, "step": 3}
