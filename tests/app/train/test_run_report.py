"""What a real run says about itself: ``rrfp train`` on 2 ranks on your own text prints
the start-up summary before its first step (the layout, the backend and why, the schedule, the
documents it found, each pipeline rank's stages, parameters and memory estimate beside 1F1B's),
then step lines with the gradient norm and each rank's measured peak memory and microbatches in
flight; ``metrics.jsonl`` holds the same per step and ``run.json`` the summary and the run's
measured peaks. The measured peak is at least the estimate (a lower bound) on every rank."""

from __future__ import annotations

import json
import math

import pytest
from harness.train_rows import TrainJob

pytestmark = pytest.mark.e2e

STEPS = 2


def _texts(folder) -> None:
    """Three documents of plain text, long enough for gpt-tiny's rows."""
    folder.mkdir()
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox. " * 40)


@pytest.mark.timeout(240)
def test_a_two_rank_run_says_what_it_is_and_what_it_measured(tmp_path):
    from rrfp.app.config.train_config import TrainConfig

    _texts(tmp_path / "texts")
    sets = [f"run.steps={STEPS}", "schedule.n_microbatches=4", f"data.text={tmp_path / 'texts'}"]
    sets.append(f"output.dir={tmp_path / 'runs' / '{model}'}")
    args = [a for s in sets for a in ("--set", s)]
    job = TrainJob(tmp_path / "job", ["--config", "configs/gpt-tiny.toml", *args]).finish(230)
    assert job.codes() == [0, 0], job.tails()
    cfg = TrainConfig.load("configs/gpt-tiny.toml", sets, world_size=2)
    lines = job.out(0).splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    head = lines[:first_step]
    backend = f"backend {cfg.compute.backend} ({cfg.backend_choice})"
    assert head[0] == f"run: gpt on 2 rank(s): pp=2 x tp=1 x dp=1; {backend} on cpu", head
    assert head[1].startswith("schedule: hint bfw, dispatch ready, budget 2x; 4 microbatches")
    assert head[2].startswith(f"data: data.text = {tmp_path / 'texts'} (3 file(s)): 3 documents")
    assert head[3].startswith("pipeline rank 0: stage 0 (") and "(1F1B: " in head[3], head
    assert head[4].startswith("pipeline rank 1: stage 1 ("), head
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == STEPS
    for line in steps:
        assert "  grad norm " in line and " MiB (rss peak)  in flight " in line, line

    (folder,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    about = json.loads((folder / "run.json").read_text())
    summary, measured = about["summary"], about["measured"]
    assert summary["layout"]["pp"] == 2 and summary["backend"] == cfg.compute.backend
    tokens = sum(f.stat().st_size for f in (tmp_path / "texts").iterdir())  # UTF-8 bytes
    assert summary["data"].endswith(f"3 documents, {tokens:,} tokens (vocab 256)"), summary
    # the parameters per stage add up to the whole model's (no tie in gpt-tiny)
    whole = cfg.workload.build_stage(cfg.model, 0, 1, None)
    stage_params = [n for rank in summary["ranks"] for n in rank["params"]]
    assert sum(stage_params) == sum(p.numel() for p in whole.parameters())
    assert len(rows) == STEPS
    for row in rows:
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0, row
        assert row["memory_measure"] == "rss peak" and len(row["memory"]) == 2, row
        for rank, est in enumerate(summary["ranks"]):
            assert row["memory"][rank] >= est["memory_estimate"], (rank, row, est)
            assert 1 <= row["in_flight"][rank] <= est["in_flight_limit"], (rank, row, est)
    assert measured["memory_measure"] == "rss peak"
    assert measured["memory_peak"] == [max(r["memory"][k] for r in rows) for k in range(2)]
    assert measured["in_flight_peak"] == [max(r["in_flight"][k] for r in rows) for k in range(2)]
