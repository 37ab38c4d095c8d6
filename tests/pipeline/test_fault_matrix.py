"""The fault matrix of the embedding APIs: a fault kind injected on rank 1 in one phase of a
step, and what rank 0 sees. Each row asserts its outcome: the fault named (the error names
rank 1, within ``timeout_s`` plus slack, by the wait the error states where it states one) or
the step finished exactly (rank 1's losses are the single-process reference's). The table in
docs/faults.md is generated from ``ROWS`` (``python tests/pipeline/test_fault_matrix.py``
rewrites it; a test checks it is current).

Kinds: ``kill`` (SIGKILL: a crashed host), ``stop`` (SIGSTOP for good), ``pause`` (SIGSTOP,
continued after a quarter of ``timeout_s``: a peer sees a stop as its length plus up to two beat
periods plus its own scheduling lag, so a longer pause would test the machine's load), ``gil``
(the forward or backward holds the GIL in one C call for 1.5 x ``timeout_s``), ``busy`` (Python
computes for 3 x ``timeout_s``, taking the GIL in turns): the last two are alive but slow;
``idle`` (alive and beating, but never entering the step) and ``hang`` (alive and beating, but
never reaching the DP gradient sync or the final barrier: it sleeps in the ``async with`` block
instead), named after ``timeouts.progress_s``.
Phases: the forward (F) or the backward (B) of rank 1's second microbatch, or the weight gradient
(W) of its second W task under a split backward. APIs: ``ScheduleReady`` (the drop-in) and
``PipelineRuntime`` (``async with``, ``run_iteration``), both with their defaults (the heartbeat
on). Two ranks, a two-layer model, ``timeout_s`` = 2; the sync rows are one pipeline stage of two
DP replicas.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the harness
from harness import ROOT  # noqa: E402
from harness.distributed import start_ranks, started_waits  # noqa: E402

from rrfp.app.faults import FULL_BYTES, pause  # noqa: E402

TIMEOUT_S = 2.0
PROGRESS_S = 2 * TIMEOUT_S  # timeouts.progress_s here (10 x timeout_s by default)
SLACK_S = 3.0  # a loaded two-core machine: a beat read late, a process scheduled late
M, BATCH, WIDTH = 4, 8, 8
DOC = ROOT / "docs" / "faults.md"

FINISHES, NAMED = "finishes exactly", "rank 1 named"
# (api, kind, phase, outcome)
ROWS = (
    [
        (api, kind, phase, NAMED if kind in ("kill", "stop") else FINISHES)
        for api in ("ScheduleReady", "PipelineRuntime")
        for kind in ("kill", "stop", "pause", "gil", "busy")
        for phase in ("F", "B")
    ]
    + [
        (api, kind, "W", NAMED)
        for api in ("ScheduleReady", "PipelineRuntime")
        for kind in ("kill", "stop")
    ]
    + [
        ("PipelineRuntime", "idle", "step", NAMED),
        ("ScheduleReady", "idle", "step", NAMED),
        ("PipelineRuntime", "hang", "sync", NAMED),
        ("PipelineRuntime", "hang", "barrier", NAMED),
    ]
    + [(api, "stuck", "F", NAMED) for api in ("ScheduleReady", "PipelineRuntime")]
)
NEVER = ("kill", "stop", "idle", "hang")  # rank 1 reports nothing: rank 0's line is the outcome
ALIVE = ("idle", "hang")  # beating, never arriving: named after progress_s
TASK_S = 2 * PROGRESS_S  # timeouts.task_s, derived: the bound of a task whose kind was measured


def _fault(kind: str, mark: Path) -> None:
    mark.write_text(repr(time.time()))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "pause":
        pause(TIMEOUT_S / 4)
    elif kind == "gil":
        ctypes.PyDLL(None).sleep(int(1.5 * TIMEOUT_S))  # libc's sleep, the GIL held throughout
    elif kind == "busy":
        end = time.monotonic() + 3 * TIMEOUT_S
        while time.monotonic() < end:
            pass
    elif kind == "stuck":  # a task that never returns, the GIL free: its rank names it
        while True:
            time.sleep(3600)


def _stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)]


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _reference() -> list[float]:
    first, last = _stages()
    x, y = _data()
    return [_loss(last(first(xm)), ym).item() for xm, ym in zip(x.chunk(M), y.chunk(M))]


class _Faulty(torch.nn.Module):
    """Rank 1's stage: the fault fires in the forward, or the backward, of its second microbatch,
    or as its second weight gradient is computed (W, under a split backward)."""

    def __init__(self, inner, kind: str, phase: str, mark: Path) -> None:
        super().__init__()
        self.inner, self.kind, self.phase, self.mark, self.calls = inner, kind, phase, mark, 0
        self.w_calls = 0
        if phase == "W":
            inner.weight.register_hook(self._weight_grad)

    def _weight_grad(self, g):
        self.w_calls += 1
        if self.w_calls == 2:
            _fault(self.kind, self.mark)

    def forward(self, x):
        self.calls += 1
        hit = self.calls == 2
        if hit and self.phase == "F":
            _fault(self.kind, self.mark)
        out = self.inner(x)
        if hit and self.phase == "B":
            out.register_hook(lambda g: _fault(self.kind, self.mark))
        return out


def _schedule_ready_rank(rank, world, kind, phase, mark):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from rrfp.pipelining.schedule import ScheduleReady

    dist.init_process_group("gloo")
    module = _stages()[rank]
    if rank == 1:
        module = _Faulty(module, kind, phase, Path(mark))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    waits = started_waits(TIMEOUT_S, progress_s=PROGRESS_S)  # start-up is no part of a row
    schedule = ScheduleReady(stage, M, loss_fn=_loss, timeouts=waits, split=phase == "W")
    if kind == "idle" and rank == 1:  # alive (beating) but never in the step: no message
        Path(mark).write_text(repr(time.time()))
        time.sleep(3 * PROGRESS_S)
        return {}
    x, y = _data()
    losses: list = []
    try:
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    except Exception as e:  # the row's outcome: what this rank was told, and when
        return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    schedule.close()
    return {"losses": [float(v) for v in losses]}


def _pipeline_runtime_rank(rank, world, kind, phase, mark):
    import asyncio

    import rrfp

    # the sync rows: one stage holding both layers, on two DP replicas
    sync = phase == "sync"
    module = torch.nn.Sequential(*_stages()) if sync else _stages()[rank]
    if rank == 1 and kind not in ALIVE:
        module = _Faulty(module, kind, phase, Path(mark))
    x, y = _data()
    batches = list(zip(x.chunk(M), y.chunk(M)))
    out: dict = {}

    async def hang():  # alive (beating) in the block, but never where rank 0 waits for it
        Path(mark).write_text(repr(time.time()))
        await asyncio.sleep(3 * PROGRESS_S)

    async def main():
        waits = started_waits(TIMEOUT_S, progress_s=PROGRESS_S)  # start-up is no part of a row
        layout = dict(pp=1, dp=world) if sync else dict(pp=world)
        async with rrfp.PipelineRuntime.start(**layout, timeout_s=TIMEOUT_S, timeouts=waits) as rt:
            ex = rt.stage_executor(module, _loss, n_microbatches=M, split=phase == "W" or None)
            # without the executor, sync() starts the DP all-reduce: rank 0 waits for it there
            dp = rt.grad_sync(module)
            if kind == "idle" and rank == 1:  # no message
                await hang()
                return
            await ex.run_iteration(0, batches)
            if kind == "hang" and rank == 1:
                await hang()
                return
            await dp.sync()
            last = [w for w in ex.workers if w.is_last]
            out["losses"] = [float(last[0].losses[mb]) for mb in range(M)] if last else []

    try:
        rrfp.run(main())
    except Exception as e:  # the row's outcome: what this rank was told, and when
        return {"error": f"{type(e).__name__}: {e}", "at": time.time()}
    return out


RANK_FNS = {"ScheduleReady": _schedule_ready_rank, "PipelineRuntime": _pipeline_runtime_rank}


def _run(api: str, kind: str, phase: str, tmp: Path) -> dict:
    """Both ranks; rank 1's result unless it was killed or stopped, rank 0's always; whatever is
    left of rank 1 once rank 0 has reported is killed."""
    mark = tmp / "fault_at"
    procs, queue = start_ranks(RANK_FNS[api], 2, (kind, phase, str(mark)))
    results: dict = {}
    want = {0} if kind in NEVER else {0, 1}
    try:
        deadline = time.monotonic() + 90
        while not want <= results.keys():
            left = deadline - time.monotonic()
            assert left > 0, f"{kind} in {phase}: ranks {want - results.keys()} hung: {results}"
            try:
                rank, status, value = queue.get(timeout=left)
            except Exception:
                continue
            assert status == "ok", f"rank {rank} failed:\n{value}"
            results[rank] = value
        if kind == "stuck":  # the script ends on its error: its process exits, its task stuck
            procs[1].join(10)
            results["exit_code"] = procs[1].exitcode
        if 1 not in results and not mark.exists():  # the fault never fired: what rank 1 saw
            try:
                rank, _, value = queue.get(timeout=10)
                results[rank] = value
            except Exception:  # noqa: BLE001 - nothing more to show: rank 1 said nothing
                pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL; a process that exits meanwhile is no error (Popen._send_signal)
            p.join(5)
    results["fault_at"] = float(mark.read_text()) if mark.exists() else None
    return results


# The wait a naming line states: a silent peer's (``no heartbeat for 2.0 s``), a peer's that beats
# but sends nothing (``sent nothing for 4.0 s``) or never reaches a collective (``waited 4.0 s``).
# Rank 1 can idle or hang from before rank 0 has run its own tasks, so the wall clock from the
# fault would count rank 0's work under the machine's load; the line's wait starts when it waits.
MEASURED = re.compile(r"(?:no heartbeat for|sent nothing for|waited) ([0-9.]+) s")
LONG = ("gil", "busy")  # rows that wait out their fault: the long tier


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("api", "kind", "phase", "outcome"),
    [pytest.param(*row, marks=[pytest.mark.long] if row[1] in LONG else []) for row in ROWS],
)
def test_fault_matrix_row(api, kind, phase, outcome, tmp_path):
    results = _run(api, kind, phase, tmp_path)
    assert results["fault_at"] is not None, f"the fault never fired: {results}"
    if outcome == FINISHES:
        for rank in (0, 1):
            assert "error" not in results[rank], (rank, results[rank])
        reference = _reference()
        assert results[1]["losses"] == pytest.approx(reference, rel=1e-6, abs=0), results[1]
        return
    error, took = results[0].get("error"), None
    assert error is not None, f"rank 0 finished a step whose peer was {kind}ed: {results[0]}"
    took = results[0]["at"] - results["fault_at"]
    assert "rank 1" in error, error
    if kind == "stuck":  # rank 1 names its own task, past its bound; rank 0 names rank 1
        assert "task F1 (microbatch 1) has run for" in results[1]["error"], results[1]
        assert f"over its bound of {TASK_S:g} s" in results[1]["error"], results[1]
        assert results[1]["error"].startswith("TaskOverrun: rank 1 stage 1:"), results[1]
        assert results["exit_code"] == 0, results["exit_code"]  # the rank function returned
    bound = PROGRESS_S if kind in ALIVE else TASK_S if kind == "stuck" else TIMEOUT_S
    measured = MEASURED.search(error)
    if measured:  # the runtime's own clock, from when the fault could be seen (see MEASURED)
        took = float(measured.group(1))
        assert bound - 0.05 <= took, f"named before its bound of {bound:g} s: {error}"
    assert took <= bound + SLACK_S, f"named after {took:.1f} s: {error}"
    print(f"{api} {kind} {phase}: named after {took:.2f} s")


def table() -> str:
    from harness import agent_fault_rows as agents
    from harness import train_fault_rows as train

    lines = [
        "# Fault matrix",
        "",
        "Generated from `ROWS` in tests/pipeline/test_fault_matrix.py,",
        "tests/harness/train_fault_rows.py and tests/harness/agent_fault_rows.py (`python",
        "tests/pipeline/test_fault_matrix.py` rewrites it); each row is a test that injects the",
        "fault on rank 1 of two and asserts the outcome on rank 0. Rows marked long are the `long`",
        "tier (they wait out their fault): `make test-long` runs them, `make test` the others, and",
        "CI both.",
        "",
        "## The embedding APIs",
        "",
        f"The fault named (its error names rank 1 within timeout_s + {SLACK_S:g} s,",
        f"timeout_s = {TIMEOUT_S:g}; an idle or hung peer within timeouts.progress_s +",
        f"{SLACK_S:g} s, progress_s = {PROGRESS_S:g}) or the step finished with the",
        "single-process reference's losses. Where the error states the wait it ended (a silent",
        "peer's, or an idle or hung peer's), that wait is the one bounded: it starts when rank 0",
        "waits, not when rank 1 faulted; otherwise the wall clock from the fault is.",
        "",
        "Kinds: kill (SIGKILL), stop (SIGSTOP for good), pause (SIGSTOP, continued after a",
        "quarter of timeout_s), gil (one C call holding the GIL for 1.5 x timeout_s), busy (Python",
        "computing for 3 x timeout_s), idle (alive and beating, but never entering the step: no",
        "message), hang (alive and beating in the `async with` block after its iteration, never",
        "reaching the collective rank 0 waits at).",
        "Phases: the forward (F) or backward (B) of rank 1's second microbatch, its second weight",
        "gradient (W, under a split backward), the whole step, the DP gradient sync (one stage on",
        "two DP replicas; `grad_sync(module)`, whose `sync()` starts the all-reduce) or the final",
        "barrier. APIs: ScheduleReady and PipelineRuntime, with their defaults (heartbeat on).",
        "",
        "| API | kind | phase | outcome | tier |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {api} | {kind} | {phase} | {outcome} | {'long' if kind in LONG else ''} |"
        for api, kind, phase, outcome in ROWS
    ]
    lines += [
        "",
        "## rrfp train",
        "",
        "Outcomes: rank 1 named (rank 0 exits 1 with one line naming rank 1 within the phase's",
        f"bound + {train.SLACK_S:g} s: timeout_s = {train.TIMEOUT_S:g} once the ranks have met,",
        f"the rendezvous's {train.START_S:g} s at start-up, timeouts.progress_s =",
        f"{train.PROGRESS_S:g} for a hung rank), finishes exactly (both ranks exit 0;",
        "rank 0 prints the losses of the run without the fault), stops, one line (both ranks",
        "exit 143 within the bound; one 'stopped' line for the job, the last completed step",
        "saved), the disk named (both ranks exit 1 with one line each that names the checkpoint,",
        "rank 1 and the cause: `File too large (EFBIG)` and the limit; nothing of the step is",
        "committed, and its partial folder is deleted), falls back, set aside (the resumed job",
        "exits 0 with the uninterrupted run's loss of step 3, resumed from step 2; rank 0's",
        "warning names step 3 and where it went; rejected-step-00000003 holds its files byte for",
        "byte).",
        "",
        "Kinds: kill, stop (for good), pause (SIGSTOP, continued after half of timeout_s), slow",
        "(1.5 x the phase's bound more: a task's lane held, or a sleep in the phase), term",
        "(SIGTERM, as torchrun's agent sends), full (rank 1's file size limit drops to",
        f"{FULL_BYTES // 1024} KiB, as `ulimit -f` sets it, as the checkpoint after step 1 is",
        "written: torch's writer fails on the real file, and rank 1 names the cause), hang (a",
        "sleep for good, alive and beating: rank 0",
        "names it at its next collective once the job made no progress for progress_s, which",
        "every row sets, so the slow rows also show a slow phase under it is not blamed; inside",
        "the F task, rank 1 names its own task once it ran past timeouts.task_s, 2 x progress_s",
        f"= {train.TASK_S:g} s, as that task's kind was measured at step 1: `rank 1 (stage 1):",
        f"iteration 1: task F1 (microbatch 1) has run for {train.TASK_S:.1f} s and not returned,",
        f"over its bound of {train.TASK_S:g} s (...): stuck in its compute, a collective inside it",
        "or a kernel`; a task slower",
        "than usual is not blamed until it runs 10 x the longest of its kind so far), flip (one",
        "byte of the latest checkpoint's commit record, between a complete run and its resume).",
        "Phases:",
        "start-up (before rank 1 joins the",
        "rendezvous: no heartbeat yet, so a rank late past the rendezvous's bound is absent), the",
        "F, B or W (BFW's split) task of step 2's microbatch 1, step 2's gradient sync (2 DP",
        "replicas), the write and the commit of the checkpoint after step 1, the final barrier",
        "after step 3 (a SIGTERM there comes after a complete run), and TP F: step 2's F1 on one",
        "stage of two TP ranks, where rank 1 hangs inside the task before its first TP all-reduce,",
        "and EP F: step 2's F1 on one MoE stage of two EP ranks (configs/moe-tiny.toml, ep = 2),",
        "where rank 1 is killed, stopped or hangs inside the task before its first all-to-all,",
        "and the resume of a complete run from its checkpoints.",
        "Three steps, a two-layer GPT (EP F: a two-layer Llama whose second block is a MoE).",
        "",
        "A TP peer stuck inside a task: TP's all-reduces run inside the task, on the compute",
        "lane's thread, so from outside both ranks are in the task, which counts as progress.",
        "While a rank waits at one, its heartbeat says so (`at the row-parallel all-reduce of",
        "transformer.h.0.attn.c_proj in task F1 of stage 0`), and the TP group's timeout is",
        "timeouts.progress_s. When it ends the wait, the waiting rank names the TP peers whose",
        "heartbeat is not at that all-reduce, as the TP F row shows: `rrfp: error: rank 0:",
        "stopped: the row-parallel all-reduce of transformer.h.0.attn.c_proj in task F1 of stage",
        f"0: rank 1 (alive, in task F1 for {train.PROGRESS_S:g} s) never reached it: waited",
        f"{train.PROGRESS_S:.1f} s (timeouts.progress_s = {train.PROGRESS_S:g} s): stuck",
        "outside it, or at another collective`. The embedding",
        "APIs raise that line as a PeerStuck (tests/pipeline/test_parallel.py).",
        "Without a heartbeat",
        "(`heartbeat=False`) the TP group's timeout is timeouts.process_group_s, and the line says",
        "which all-reduce did not complete in that bound, with its TP peers, but names none as",
        "stuck: nothing tells a stuck peer from one still computing. A TP peer that died ends the",
        "all-reduce at once: one PeerFailure line names the all-reduce and why it failed.",
        "An EP peer is the same: the all-to-alls of a MoE layer run inside the task, the EP",
        "group's timeout is timeouts.progress_s, and the EP F hang row ends `rank 0: stopped: the",
        "EP count all-to-all of layers.1.mlp.experts in task F1 of stage 0: rank 1 (alive, in",
        f"task F1 for {train.PROGRESS_S:g} s) never reached it`; a killed or stopped EP peer is",
        "named as any other,",
        "wherever rank 0 waits for it (the all-to-all, or the EP agreement's round).",
        "",
        "| API | kind | phase | outcome | tier |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {api} | {kind} | {phase} | {outcome} | {'long' if kind in train.LONG else ''} |"
        for api, kind, phase, outcome in train.ROWS
    ]
    lines += [
        "",
        "## One job, one config, one checkpoint folder",
        "",
        "Two torchrun agents as one job (`--nnodes 2`, a c10d rendezvous on one machine, one",
        "rank each), started alike but for one `--set` on node 1 (tests/app/job/",
        "test_fault_matrix_agents.py). Every rank posts its identity on the agent store before",
        "any process group: the resolved config key by key, the model's source file, the",
        "fingerprints of the files [model] and [data] name, the world size. Outcomes: finishes",
        "(both agents exit 0); refused (every rank exits 2 at once, none waiting for a timeout:",
        "the job's waits are set beyond the test's; one `rrfp:` line for the job naming the key,",
        "each value and the nodes and ranks that hold it: `rrfp: error: the ranks of this job",
        "were started with different configs, models or data: run.seed: 0 (node 0 (HOST): rank",
        "0) vs 5 (node 1 (HOST): rank 1) (...)`). Two jobs on one checkpoint.dir (2 ranks",
        "each): a second job started while the first trains is refused",
        "in one line naming the owner (`checkpoint.dir DIR is in use by job ID (host HOST, pid",
        "PID, started TIME): ...`); once the first was killed, its OWNER record is stale (its",
        "pid is gone) and a new job resumes from its newest checkpoint. Two jobs started at once",
        "on an empty folder: one owns it, every step it commits verifies and names it in its",
        "commit record; the other is refused naming it.",
        "",
        "| API | case | outcome | tier |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {api} | {case} | {outcome} | |"
        for api, case, outcome in agents.ROWS + agents.OWNER_ROWS
    ]
    return "\n".join(lines) + "\n"


def test_the_docs_table_is_current():
    assert DOC.read_text() == table(), (
        "docs/faults.md is stale: python tests/pipeline/test_fault_matrix.py"
    )


if __name__ == "__main__":
    DOC.write_text(table())
